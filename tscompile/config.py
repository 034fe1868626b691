"""The one config of the tscompile backend: a frozen dataclass, validated from ``options={...}``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field

DEFAULT_TOKEN_LADDER = (16, 32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_DECODE_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
PIECE_COMPILERS = ("inductor", "eager", "tensorrt")


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
        around the Inductor-compiled step (one pool), and in the engine's prefill one per compiled
        piece per token bucket (the narrowing decoder per row bucket; another pool).
    inductor_options: ``torch._inductor.config`` patches for every piece Inductor compiles (a dict).
    static_inductor_options: more patches only for graphs whose input sizes are all static. The
        engine's decode step sets ``coordinate_descent_tuning=True`` here on CUDA unless either dict
        sets it: Inductor then turns the bs=1 graph's one-row matmuls into fused GEMV reductions and
        tunes them (the gpt-fast setting), while the dynamic-batch graph skips the costly tuning.
    debug_dir: write each piece's FX code and the split plan here (env TSCOMPILE_DEBUG_DIR).
    """

    piece_compiler: str = "inductor"
    split_ops: tuple[str, ...] = ("tscompile::attention",)
    split_sdpa: bool = False
    split_narrowing: bool = True
    token_ladder: tuple[int, ...] = DEFAULT_TOKEN_LADDER
    prefill_graph_max_tokens: int = 2048
    decode_ladder: tuple[int, ...] = DEFAULT_DECODE_LADDER
    cudagraphs: bool = True
    inductor_options: tuple[tuple[str, object], ...] = ()
    static_inductor_options: tuple[tuple[str, object], ...] = ()
    debug_dir: str | None = field(default_factory=lambda: os.environ.get("TSCOMPILE_DEBUG_DIR") or None)

    # fields that change where artifacts are written, not what is compiled
    HASH_IGNORED = frozenset({"debug_dir"})

    def __post_init__(self):
        if self.piece_compiler not in PIECE_COMPILERS:
            raise ValueError(f"tscompile: piece_compiler {self.piece_compiler!r} unknown; known: {list(PIECE_COMPILERS)}")
        for name in ("token_ladder", "decode_ladder"):
            ladder = tuple(int(x) for x in getattr(self, name))
            if not ladder or list(ladder) != sorted(set(ladder)) or ladder[0] < 1:
                raise ValueError(f"tscompile: {name} must be strictly increasing positive ints, got {ladder}")
            object.__setattr__(self, name, ladder)
        object.__setattr__(self, "split_ops", tuple(self.split_ops))
        for name in ("inductor_options", "static_inductor_options"):
            object.__setattr__(self, name, _inductor_pairs(name, getattr(self, name)))
        if int(self.prefill_graph_max_tokens) < 0:
            raise ValueError(f"tscompile: prefill_graph_max_tokens must be >= 0 (0: no prefill graphs), "
                             f"got {self.prefill_graph_max_tokens}")

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
        return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def inductor_patches(self, static_shapes: bool) -> dict:
        patches = dict(self.inductor_options)
        if static_shapes:
            patches.update(self.static_inductor_options)
        return patches

    def bucket(self, ladder: tuple[int, ...], n: int) -> int | None:
        """The smallest ladder entry >= n, or None above the ladder."""
        for size in ladder:
            if size >= n:
                return size
        return None


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
