"""The one config of the tscompile backend: a frozen dataclass, validated from ``options={...}``.

No behaviour is switched by environment variables. Two debugging aids read one each, when used:
``TSCOMPILE_DEBUG_DIR`` is ``debug_dir``'s default (read when a config is made), and
``TSCOMPILE_GRAPH_DEBUG=1`` turns on the graph-debug checks before every CUDA-graph replay
(``tscompile/runtime/pointer_guard.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from tscompile.kernel_policy import KernelPolicy

DEFAULT_TOKEN_LADDER = (16, 32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_DECODE_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
PIECE_COMPILERS = ("inductor", "eager", "tensorrt")
PREFILL_GRAPH_MODES = ("auto", "whole", "piecewise")
PREFILL_CAPTURE_MODES = ("startup", "lazy")


@dataclass(frozen=True)
class TscompileConfig:
    """Options of ``torch.compile(..., backend="tscompile", options={...})``.

    piece_compiler: compiles the pieces between breaks ("inductor", "eager", "tensorrt").
    split_ops: op names every node of which becomes its own eagerly-run piece.
    split_sdpa: also break at ``scaled_dot_product_attention`` (stock models get piecewise graphs).
    split_narrowing: break at ``tscompile::narrow_rows`` (encoder / decoder parts).
    token_ladder: prefill token buckets; prefill above ``prefill_graph_max_tokens`` runs without graphs
        (0 turns prefill graphs off and keeps decode graphs).
    decode_ladder: decode batch sizes captured as CUDA graphs; larger batches run the same compiled
        step without a graph.
    cudagraphs: capture CUDA graphs (CUDA only): one torch.cuda.CUDAGraph per decode ladder size
        around the Inductor-compiled step (one pool), and in the engine's prefill as
        ``prefill_graph_mode`` says (another pool).
    prefill_graph_mode: "auto" (the default): "whole" where it can run (a backend whose extend launches
        inside a graph, a model without the narrowing), else "piecewise", said in the log at info level.
        "whole": one graph per (token bucket, request bucket) around the whole extend step,
        attention breaks and sampler included (``runtime/prefill_graphs.py``); where it cannot run the
        engine says so as a warning and runs "piecewise". "piecewise": one graph per compiled piece
        per token bucket (the narrowing decoder per row bucket) with the attention breaks run eagerly
        between them. Measured on the H200 (llama-1b, bf16, Triton): one prompt's first token in
        2.20 / 3.33 / 9.07 ms whole vs 5.93 / 4.69 / 10.20 ms piecewise at 32 / 512 / 2048 tokens
        (the piecewise 32-token figure, above its own 512-token one, is not explained).
    prefill_capture: when the engine captures its prefill graphs (only where it has them: CUDA with
        ``cudagraphs``). "lazy" (the default): each graph is captured by the first real step that
        needs it. "startup": while the engine is built, after the decode ladder, one placeholder
        step per graph key (token bucket, request bucket, the narrowing model's row bucket; extend
        and mixed steps, greedy) that writes only the null page, so the first request of each size
        pays no compile or capture; sampled steps still capture on first use, as decode does. Not
        yet the default: its memory on llama-1b/8b has not been measured against the pool's margin,
        and the fix for the one narrowing-model graph it missed on the H200 has run on the CPU only.
    inductor_options: ``torch._inductor.config`` patches for every piece Inductor compiles (a dict).
    static_inductor_options: more patches only for graphs whose input sizes are all static (the
        engine's bs=1 decode graph). ``{"coordinate_descent_tuning": True}`` here is the gpt-fast
        setting: Inductor turns the one-row matmuls into fused GEMV reductions and tunes them, and the
        decode GEMV pass puts back the projections its measured policy gives to the Triton GEMV or
        cuBLAS (passes/decode_gemv.py). Off by default: on the H200 it doubles llama-1b's start-up
        (README, start-up), and with that policy it gained 0.8% at llama-8b bs=1 and nothing on
        llama-1b.
    kernels: the kernel and pass choices (``KernelPolicy``: the decode GEMV swaps, PDL), a dict of its
        fields in ``options`` (unknown keys refused); see ``tscompile.kernel_policy.KernelPolicy``.
    debug_dir: write each piece's FX code and the split plan here; its default is the environment
        variable ``TSCOMPILE_DEBUG_DIR`` (read when the config is made), a debugging aid only.
    """

    piece_compiler: str = "inductor"
    # the recurrent-state ops read per-step metadata (each request's slot, its row offsets) that a
    # piece graphed per token bucket would keep from its capture: they run eagerly, as attention does
    split_ops: tuple[str, ...] = ("tscompile::attention", "tscompile::causal_conv1d", "tscompile::gated_delta_rule")
    split_sdpa: bool = False
    split_narrowing: bool = True
    token_ladder: tuple[int, ...] = DEFAULT_TOKEN_LADDER
    prefill_graph_max_tokens: int = 2048
    prefill_graph_mode: str = "auto"
    prefill_capture: str = "lazy"
    decode_ladder: tuple[int, ...] = DEFAULT_DECODE_LADDER
    cudagraphs: bool = True
    inductor_options: tuple[tuple[str, object], ...] = ()
    static_inductor_options: tuple[tuple[str, object], ...] = ()
    kernels: KernelPolicy = field(default_factory=KernelPolicy)
    debug_dir: str | None = field(default_factory=lambda: os.environ.get("TSCOMPILE_DEBUG_DIR") or None)

    # fields that change where artifacts are written or when they are built, not what is compiled:
    # prefill_capture only moves the prefill compiles and captures to start-up (the same graphs)
    HASH_IGNORED = frozenset({"debug_dir", "prefill_capture"})

    def __post_init__(self):
        if not isinstance(self.piece_compiler, str) or self.piece_compiler not in PIECE_COMPILERS:
            raise ValueError(f"tscompile: piece_compiler must be one of {list(PIECE_COMPILERS)}, "
                             f"got {self.piece_compiler!r}")
        if self.prefill_graph_mode not in PREFILL_GRAPH_MODES:
            raise ValueError(f"tscompile: prefill_graph_mode must be one of {list(PREFILL_GRAPH_MODES)}, "
                             f"got {self.prefill_graph_mode!r}")
        if not isinstance(self.prefill_capture, str) or self.prefill_capture not in PREFILL_CAPTURE_MODES:
            raise ValueError(f"tscompile: prefill_capture must be one of {list(PREFILL_CAPTURE_MODES)}, "
                             f"got {self.prefill_capture!r}")
        for name in ("split_sdpa", "split_narrowing", "cudagraphs"):
            _check_bool(name, getattr(self, name))
        object.__setattr__(self, "split_ops", _str_sequence("split_ops", self.split_ops))
        for name in ("token_ladder", "decode_ladder"):
            object.__setattr__(self, name, _ladder(name, getattr(self, name)))
        if not _is_int(self.prefill_graph_max_tokens) or self.prefill_graph_max_tokens < 0:
            raise ValueError(f"tscompile: prefill_graph_max_tokens must be >= 0 (an int; 0: no prefill "
                             f"graphs), got {self.prefill_graph_max_tokens!r}")
        for name in ("inductor_options", "static_inductor_options"):
            object.__setattr__(self, name, _inductor_pairs(name, getattr(self, name)))
        object.__setattr__(self, "kernels", KernelPolicy.from_options(self.kernels))
        if isinstance(self.debug_dir, os.PathLike):
            object.__setattr__(self, "debug_dir", os.fspath(self.debug_dir))
        if self.debug_dir is not None and not isinstance(self.debug_dir, str):
            raise ValueError(f"tscompile: debug_dir must be a str path or None, got {self.debug_dir!r}")

    @classmethod
    def from_options(cls, options: dict | None = None, mode: str | None = None) -> "TscompileConfig":
        options = dict(options or {})
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"tscompile: unknown option(s) {unknown}; known options: {known}")
        if mode not in (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
            raise ValueError(f"tscompile: unknown mode {mode!r}")
        if mode == "max-autotune-no-cudagraphs":
            options.setdefault("cudagraphs", False)
        return cls(**options)

    def compute_hash(self) -> str:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self.HASH_IGNORED}
        fields["kernels"] = self.kernels.as_dict()
        return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def inductor_patches(self, static_shapes: bool) -> dict:
        patches = dict(self.inductor_options)
        if static_shapes:
            patches.update(self.static_inductor_options)
        return patches


def _is_int(value) -> bool:
    # bool is an int subclass, but True as a size is a typo, not a size
    return isinstance(value, int) and not isinstance(value, bool)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"tscompile: {name} must be True or False, got {value!r}")


def _str_sequence(name: str, value) -> tuple[str, ...]:
    # a bare str is a sequence of one-letter strs: refuse it rather than split "aten::mm" into letters
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or \
            not all(isinstance(v, str) for v in value):
        raise ValueError(f"tscompile: {name} must be a sequence of op names (str), got {value!r}")
    return tuple(value)


def _ladder(name: str, value) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or \
            not all(_is_int(v) for v in value):
        raise ValueError(f"tscompile: {name} must be a sequence of ints, got {value!r}")
    ladder = tuple(value)
    if not ladder or list(ladder) != sorted(set(ladder)) or ladder[0] < 1:
        raise ValueError(f"tscompile: {name} must be strictly increasing positive ints, got {value!r}")
    return ladder


def check_piece_compiler_importable(config: TscompileConfig) -> None:
    """Refuse, at engine construction, a piece compiler whose package cannot be imported here: found
    at the first compile it would surface wrapped in torch's BackendCompilerFailed."""
    if config.piece_compiler != "tensorrt":
        return
    try:
        import torch_tensorrt  # noqa: F401
    except (ImportError, OSError, RuntimeError) as e:  # OSError/RuntimeError: present but its libraries fail
        raise ValueError(
            "tscompile: piece_compiler='tensorrt' needs torch-tensorrt, which is not importable "
            f"({type(e).__name__}: {e}); install tscompile[tensorrt] or use piece_compiler='inductor'"
        ) from None


def _inductor_pairs(name: str, options) -> tuple[tuple[str, object], ...]:
    """A dict of ``torch._inductor.config`` names -> values, as sorted pairs (hashable, stable)."""
    pairs = options.items() if isinstance(options, dict) else options
    try:
        pairs = tuple(sorted((str(k), v) for k, v in pairs))
    except (TypeError, ValueError):
        raise ValueError(f"tscompile: {name} must be a dict of torch._inductor.config names to values, "
                         f"got {options!r}") from None
    import torch._inductor.config as inductor_config

    unknown = [k for k, _ in pairs if k not in inductor_config._config]
    if unknown:
        raise ValueError(f"tscompile: {name} names unknown torch._inductor.config entries {unknown}")
    return pairs
