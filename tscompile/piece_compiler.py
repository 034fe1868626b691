"""Compile the pieces of a split graph.

The split module is interpreted once over fake inputs (the symbolic shapes Dynamo traced); each
compiled piece is handed to the piece compiler with the fake arguments it sees, so every piece
keeps the symbolic token (or row) dimension. Break pieces are left as plain GraphModules: they run
the attention (or narrowing) op eagerly.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx
from torch._dispatch.python import enable_python_dispatcher

from tscompile.config import TscompileConfig, check_piece_compiler_importable
from tscompile.counters import counters
from tscompile.kernel_policy import KernelPolicy
from tscompile.passes.split import SplitPlan

logger = logging.getLogger("tscompile")

# Inductor patches CUDA graphs get unless the user's inductor_options set them. combo_kernels fuses
# independent pointwise kernels of one graph into one launch (RoPE's query and key rotations, 32 and
# 8 heads). On the H200 (bf16, tscompile bench) it took llama-1b's decode step from 219
# to 203 kernels (bs=1 TPOT 1.162 -> 1.142 ms, bs=32 1.453 -> 1.430 ms, same call). In the kernel tables,
# llama-8b's rotations took 62 us per bs=1 step instead of 93 and
# 47 / 68 / 195 / 707 us per 32 / 128 / 512 / 2048-token prefill instead of 82 / 100 / 241 / 641;
# but in llama-8b's dynamic-batch decode graph (bs 8-64) the combined kernel took 334-361 us per
# step against 132-170 us for the two it replaced (llama-1b's: 30-42 us against 50-54). So static
# graphs (the bs=1 decode step) and the pieces of a split graph (prefill) get it, a whole
# dynamic-shape graph does not. The CPU's C++ backend has no combo kernels: nothing is added there.
CUDA_INDUCTOR_DEFAULTS = {"combo_kernels": True}


@dataclass(frozen=True)
class PieceWrappers:
    """How a caller wraps the pieces of a split graph (the engine: per-bucket CUDA graphs,
    ``runtime/piece_graphs.py``). Given by the caller so this module knows no runtime.

    compiled(name, stage, fn, written) wraps a compiled piece; ``written`` are the indices of the
    inputs the piece mutates. narrow(name, fn, row_outputs, size_outputs) wraps the narrowing break.
    """

    compiled: Callable[[str, str, Callable, frozenset[int]], Callable]
    narrow: Callable[[str, Callable, list[bool], list[bool]], Callable]


def _device_type(example_inputs: list) -> str:
    return next((t.device.type for t in example_inputs if isinstance(t, torch.Tensor)), "cpu")


def compile_piece(gm: torch.fx.GraphModule, example_inputs: list, config: TscompileConfig,
                  cudagraph_trees: bool = False, split_piece: bool = False) -> Callable:
    """One graph -> one callable with the configured piece compiler. ``cudagraph_trees``: Inductor
    captures the graph itself (stock ``mode="reduce-overhead"``); only for a graph compiled whole.
    ``split_piece``: a piece between breaks of a split graph (``piece_inductor_patches``)."""
    counters["pieces_compiled"] += 1
    if config.piece_compiler == "eager":
        return gm.forward
    if config.piece_compiler == "tensorrt":
        check_piece_compiler_importable(config)
        return torch._dynamo.backends.registry.lookup_backend("tensorrt")(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    static = all(not isinstance(s, torch.SymInt) for t in example_inputs if isinstance(t, torch.Tensor)
                 for s in t.shape) and not any(isinstance(t, torch.SymInt) for t in example_inputs)
    patches = piece_inductor_patches(config, static, device_type=_device_type(example_inputs),
                                     split_piece=split_piece, cudagraph_trees=cudagraph_trees)
    return compile_fx(gm, example_inputs, config_patches=patches)


# Set while the engine compiles its own step (``backend.compile_step``): its decode and prefill graphs
# are the ones PDL and the batch GEMV swap were measured in. A torch.compile user's graphs get neither
# unasked (Inductor's PDL is an experimental option upstream); ``inductor_options={"triton.enable_pdl":
# True}`` asks, and the GEMV kernels then launch with PDL too.
_ENGINE_GRAPHS: contextvars.ContextVar[bool] = contextvars.ContextVar("tscompile_engine_graphs", default=False)


@contextlib.contextmanager
def engine_graphs():
    """Graphs compiled inside are the engine's own step (``_ENGINE_GRAPHS``)."""
    token = _ENGINE_GRAPHS.set(True)
    try:
        yield
    finally:
        _ENGINE_GRAPHS.reset(token)


def piece_inductor_patches(config: TscompileConfig, static: bool, *, device_type: str, split_piece: bool,
                           cudagraph_trees: bool) -> dict:
    """The ``torch._inductor.config`` patches one graph compiles under: the CUDA defaults (static
    graphs and split pieces only; Inductor's PDL where ``graph_pdl_on`` for the engine's graphs), then
    the user's options (which win), tscompile's post-grad passes on CUDA unless the options set a
    post-grad post pass of their own (``our_post_grad_passes``, their GEMV kernels launched with PDL
    where the graph's Inductor kernels are), and whether Inductor captures the graph. The kernel and
    pass choices are ``config.kernels``."""
    on_cuda = device_type == "cuda"
    engine = _ENGINE_GRAPHS.get()
    defaults = CUDA_INDUCTOR_DEFAULTS if on_cuda and (static or split_piece) else {}
    if on_cuda and graph_pdl_on(config.kernels, static, split_piece, engine):
        defaults = {**defaults, "triton.enable_pdl": True}
    patches = {**defaults, **config.inductor_patches(static)}
    if on_cuda and patches.get("post_grad_custom_post_pass") is None:  # the user's own pass wins
        kernel_pdl = bool(patches.get("triton.enable_pdl"))
        ours = our_post_grad_passes(config.kernels, static, split_piece, engine, kernel_pdl, cuda_device_name())
        if ours:
            from tscompile.passes.pass_chain import PassChain

            patches["post_grad_custom_post_pass"] = ours[0] if len(ours) == 1 else PassChain(ours)
    patches["triton.cudagraphs"] = cudagraph_trees
    return patches


def our_post_grad_passes(policy: KernelPolicy, static: bool, split_piece: bool, engine: bool, kernel_pdl: bool,
                         device_name: str) -> list:
    """The passes a CUDA graph gets: first, with ``policy.fuse_projections``, one matmul per run of
    projections whose weights share a buffer (passes/fused_projections.py); in a split piece the
    residual-addmm unfusing (passes/residual_addmm.py: two device copies per layer fewer); in a static graph that is not a piece (the bs=1 decode step)
    the decode GEMV swap (``policy.decode_gemv``); in the engine's dynamic-batch decode graph the
    few-row swap (``policy.batch_gemv``); either swap only on a GPU named ``device_name`` that its
    tables were timed on. ``kernel_pdl``: the swapped GEMV kernels launch with PDL (the graph's
    Inductor kernels do)."""
    from tscompile.custom_ops.triton_gemv import gemv_tables_apply

    passes = []
    if policy.fuse_projections:  # first: the GEMV swaps below see the fused shapes
        from tscompile.passes.fused_projections import FuseProjections

        passes.append(FuseProjections())
    tables = gemv_tables_apply(device_name)
    if not static and not split_piece and engine and policy.batch_gemv and tables:
        from tscompile.passes.batch_gemv import BatchGemv

        passes.append(BatchGemv(pdl=kernel_pdl))
    if split_piece:  # without it every residual add of a layer becomes an addmm that copies the residual first
        from tscompile.passes.residual_addmm import UnfuseResidualAddmm

        passes.append(UnfuseResidualAddmm())
    if static and not split_piece and policy.decode_gemv and tables:
        from tscompile.passes.decode_gemv import DecodeGemv

        passes.append(DecodeGemv(pdl=kernel_pdl))
    return passes


def graph_pdl_on(policy: KernelPolicy, static: bool, split_piece: bool, engine: bool = True) -> bool:
    """Whether one of the engine's CUDA graphs compiles with Inductor's PDL (a torch.compile user's
    graph, ``engine=False``, never unasked): the prefill pieces with ``policy.prefill_pdl``, every
    other graph (the decode graphs) with ``policy.decode_pdl``, on a GPU that has PDL."""
    if not engine or not (policy.prefill_pdl if split_piece else policy.decode_pdl):
        return False
    from tscompile.custom_ops.triton_attention import pdl_available

    return pdl_available()


def applied_kernel_policy(policy: KernelPolicy, device_name: str) -> dict[str, bool]:
    """What ``policy`` turns on for the engine's graphs on a CUDA GPU named ``device_name`` (a bench
    record): each GEMV swap where its tables were timed on that GPU, each PDL choice where it has PDL."""
    from tscompile.custom_ops.triton_gemv import gemv_tables_apply

    tables = gemv_tables_apply(device_name)
    return {"fuse_projections": policy.fuse_projections, "chunked_gated_delta": policy.chunked_gated_delta,
            "fused_gated_delta": policy.fused_gated_delta,
            "split_gated_delta_heads": policy.fused_gated_delta and policy.split_gated_delta_heads,
            "user_graph_eager_tail": policy.user_graph_eager_tail,
            "decode_gemv": policy.decode_gemv and tables, "batch_gemv": policy.batch_gemv and tables,
            "decode_pdl": graph_pdl_on(policy, False, False), "prefill_pdl": graph_pdl_on(policy, False, True),
            "state_pdl": policy.state_pdl and graph_pdl_on(policy, False, False)}


def cuda_device_name() -> str:
    """The current CUDA device's name ("NVIDIA H200"), "" without CUDA."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else ""


def _fake_mode(example_inputs: list):
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(example_inputs)
    if mode is None:
        ctx = torch._guards.TracingContext.try_get()
        mode = ctx.fake_mode if ctx is not None else None
    return mode


class _PieceCompileInterpreter(torch.fx.Interpreter):
    def __init__(self, module: torch.fx.GraphModule, compile_names: set[str], config: TscompileConfig, fake_mode):
        super().__init__(module)
        self.compile_names = compile_names
        self.config = config
        self.fake_mode = fake_mode
        self.compiled: dict[str, Callable] = {}
        self.fake_outputs: dict[str, object] = {}
        self.fake_args: dict[str, tuple] = {}

    def run(self, *args):
        fake_args = [self.fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        # as Dynamo propagates fake values: with the Python dispatcher, composite ops (matmul) read
        # symbolic sizes; without it torch 2.11 lowers their size queries to ints, which guards the
        # token count to the first call's value and recompiles the frame for every new length
        with self.fake_mode, enable_python_dispatcher():
            return super().run(*fake_args)

    def call_module(self, target, args, kwargs):
        out = super().call_module(target, args, kwargs)
        self.fake_outputs[target] = out
        self.fake_args[target] = tuple(args)
        if target in self.compile_names:
            self.compiled[target] = compile_piece(self.fetch_attr(target), list(args), self.config, split_piece=True)
        else:
            # A narrowing piece's fake kernel minted an unbacked row count. It is bound right here,
            # as this piece's output; left pending, the next piece's trace would try to bind it to
            # its own placeholders.
            shape_env = self.fake_mode.shape_env
            if shape_env is not None:
                shape_env.pending_fresh_unbacked_symbols.clear()
        return out


def _call_breaks_directly(split: torch.fx.GraphModule, plan: SplitPlan) -> None:
    """Break pieces run eagerly anyway: let their attention nodes call the op's body directly and
    skip the dispatcher's per-call host work (a break per layer, every prefill step)."""
    from tscompile.custom_ops.attention import run_attention
    from tscompile.passes.split import op_name

    for piece in plan.of_kind("break"):
        gm = getattr(split, piece.name)
        for node in gm.graph.nodes:
            if node.op == "call_function" and op_name(node.target) == "tscompile::attention" and not node.kwargs:
                node.target = run_attention
        gm.recompile()


def compile_split_module(split: torch.fx.GraphModule, plan: SplitPlan, example_inputs: list,
                         config: TscompileConfig, wrappers: PieceWrappers | None = None) -> torch.fx.GraphModule:
    """Replace each compiled piece of ``split`` by its compiled callable (in place), wrapped by
    ``wrappers`` when given."""
    names = {p.name for p in plan.of_kind("compiled")}
    fake_mode = _fake_mode(example_inputs)
    if fake_mode is None:
        raise RuntimeError("tscompile: no fake mode found for the traced graph")
    interp = _PieceCompileInterpreter(split, names, config, fake_mode)
    fake_result = interp.run(*example_inputs)
    # what the pieces saw while compiling, for wrappers that need the symbolic shapes (user_graphs.py)
    split.meta["tscompile_fake"] = (interp.fake_args, interp.fake_outputs, fake_result)
    for piece in plan.pieces:
        # nn.Module.__setattr__ would refuse a plain callable; the split module's code only calls it
        if piece.kind == "compiled":
            fn = interp.compiled[piece.name]
            if wrappers is not None:
                fn = wrappers.compiled(piece.name, piece.stage, fn, mutated_inputs(getattr(split, piece.name)))
            split.__dict__[piece.name] = fn
        elif piece.kind == "narrow" and wrappers is not None:
            rows, sizes = narrowed_outputs(piece.name, interp.fake_outputs[piece.name])
            split.__dict__[piece.name] = wrappers.narrow(piece.name, getattr(split, piece.name), rows, sizes)
    _call_breaks_directly(split, plan)
    return split


_VIEW_METHODS = {"view", "reshape", "narrow", "select", "__getitem__", "as_strided", "flatten", "unsqueeze",
                 "squeeze", "expand", "t", "transpose", "permute", "view_as", "unflatten", "contiguous"}


def _is_view(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op == "call_function":
        return node.target is operator.getitem or getattr(node.target, "__name__", "") in _VIEW_METHODS
    return False


def _written_args(node: torch.fx.Node) -> list:
    """The arguments ``node`` writes in place."""
    if node.op == "call_method":
        in_place = node.target.endswith("_") and not node.target.startswith("_")
        return [node.args[0]] if in_place else []
    if node.op != "call_function":
        return []
    if node.target is operator.setitem:  # x[i] = v
        return [node.args[0]]
    fn = node.target.default if isinstance(node.target, torch._ops.OpOverloadPacket) else node.target
    schema = getattr(fn, "_schema", None)
    if schema is None:  # a plain function such as torch.Tensor.add_
        name = getattr(fn, "__name__", "")
        return [node.args[0]] if node.args and name.endswith("_") and not name.startswith("_") else []
    return [node.args[pos] if pos < len(node.args) else node.kwargs.get(arg.name)
            for pos, arg in enumerate(schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write]


def mutated_inputs(gm: torch.fx.GraphModule) -> frozenset[int]:
    """Indices of ``gm``'s placeholders that a node writes to in place (directly or through a view):
    an in-place Tensor method (``x.add_``), ``x[i] = v``, or an op whose schema marks the argument
    written."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}

    def root(node):
        while isinstance(node, torch.fx.Node) and node not in index and _is_view(node) and node.args:
            node = node.args[0]
        return index.get(node) if isinstance(node, torch.fx.Node) else None

    written = {root(t) for node in gm.graph.nodes for t in _written_args(node)}
    written.discard(None)
    return frozenset(written)


def narrowed_outputs(name: str, fake_out) -> tuple[list[bool], list[bool]]:
    """Which outputs of the narrowing piece are row-shaped tensors and which are the row count."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    outs = list(fake_out) if isinstance(fake_out, (tuple, list)) else [fake_out]
    rows, sizes = [], []
    for i, o in enumerate(outs):
        dims = list(o.shape) if isinstance(o, torch.Tensor) else [o]
        unbacked = [bool(free_unbacked_symbols(d)) if isinstance(d, torch.SymInt) else False for d in dims]
        plain = isinstance(dims[0], torch.SymInt) and dims[0].node.expr.is_Symbol if dims else False
        if any(unbacked[1:]) or (unbacked and unbacked[0] and not plain):
            raise ValueError(f"tscompile: output {i} of narrowing piece {name} has a row count other than dim 0 "
                             f"({dims}); prefill graphs cannot pad it (set cudagraphs=False)")
        is_row = bool(unbacked and unbacked[0])
        rows.append(is_row and isinstance(o, torch.Tensor))
        sizes.append(is_row and not isinstance(o, torch.Tensor))
    return rows, sizes
