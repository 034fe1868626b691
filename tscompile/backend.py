"""The ``tscompile`` torch.compile backend.

Registered through the ``torch_dynamo_backends`` entry point to the plain function
``tscompile_backend``, so ``torch.compile(model, backend="tscompile")`` works in a process that
never imported tscompile. A graph without break ops is compiled whole by the piece compiler
(Inductor by default, behaving like ``backend="inductor"``); a graph with breaks is split
(``passes/split.py``) and every piece between breaks is compiled on its own.

Models with ``tscompile::narrow_rows`` need ``torch._dynamo.config.capture_dynamic_output_shape_ops
= True`` while tracing (``tscompile.backend.tracing_config`` sets it, and the engine uses it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
import weakref
from typing import Callable

import torch
import torch.fx

from tscompile import custom_ops  # noqa: F401  (the ops must exist before a graph is traced)
from tscompile.config import TscompileConfig
from tscompile.counters import counters
from tscompile.counters import reset as reset_counters
from tscompile.passes.debug_dump import dump_split
from tscompile.passes.split import has_breaks, split_graph
from tscompile.piece_compiler import PieceWrappers, compile_piece, compile_split_module, engine_graphs

logger = logging.getLogger("tscompile")


def tscompile_backend(gm: torch.fx.GraphModule, example_inputs: list, *, mode: str | None = None,
                      options: dict | None = None) -> Callable:
    config = TscompileConfig.from_options(options, mode)
    # The config's cudagraphs default is the engine's; a torch.compile user opts in, as with stock
    # torch.compile: mode="reduce-overhead" or options={"cudagraphs": True}.
    user_graphs = mode == "reduce-overhead" or (options or {}).get("cudagraphs") is True
    return compile_graph(gm, example_inputs, config, user_graphs=user_graphs)


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list, config: TscompileConfig,
                  wrappers: PieceWrappers | None = None, user_graphs: bool = False) -> Callable:
    """Compile one Dynamo graph: whole when it has no break, else split and compiled piece by
    piece (``wrappers`` wraps the pieces, e.g. the engine's per-bucket CUDA graphs).

    ``user_graphs`` (a torch.compile user's cudagraphs): a graph without breaks is captured whole by
    Inductor's CUDA-graph trees, like stock reduce-overhead; a split graph gets per-bucket piece
    graphs with the breaks run eagerly between them (``user_graphs.py``)."""
    counters["graphs"] += 1
    if not has_breaks(gm, config.split_ops, config.split_sdpa, config.split_narrowing):
        if config.debug_dir:
            dump_split(config.debug_dir, gm, None, None)
        return compile_piece(gm, example_inputs, config, cudagraph_trees=user_graphs and config.cudagraphs)
    split, plan = split_graph(gm, split_ops=config.split_ops, split_sdpa=config.split_sdpa,
                              split_narrowing=config.split_narrowing)
    counters["breaks"] += plan.num_breaks
    if config.debug_dir:
        folder = dump_split(config.debug_dir, gm, split, plan)
        logger.info("tscompile: split plan and pieces written to %s", folder)
    split = compile_split_module(split, plan, example_inputs, config, wrappers)
    if user_graphs and config.cudagraphs and wrappers is None:
        from tscompile.user_graphs import wrap_split

        ladder = tuple(b for b in config.token_ladder if b <= config.prefill_graph_max_tokens)
        return wrap_split(split, plan, example_inputs, ladder, eager_tail=config.kernels.user_graph_eager_tail)
    return split.forward


def _reset() -> None:
    """Called by ``torch.compiler.reset()``: drop tscompile's in-process state."""
    reset_counters()


tscompile_backend.reset = _reset  # type: ignore[attr-defined]


def own_code(fn: Callable) -> Callable:
    """``fn`` (a function or bound method) over a private copy of its code object.

    Dynamo keeps compiled entries on the code object. Two engines stepping the same method would
    share them: the second engine's model guards its way into recompiles until the recompile limit,
    or worse, replays prefill graphs captured around the first engine's tensors. A private code
    object per engine gives each its own cache."""
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", fn)
    code = func.__code__.replace()
    clone = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    clone.__kwdefaults__ = func.__kwdefaults__
    clone.__qualname__ = func.__qualname__
    # Dynamo maps each code object it writes back to the one it compiled, and keeps each compiled
    # graph in the module's globals until the written code goes; ``code`` holds the written code in
    # a slot the garbage collector does not see, so a deleted engine's compiled graphs would stay
    # for the process's life. Clearing ``code``'s entries once its owner is gone lets them go (the
    # graphed prefill pieces drop their captures apart: ``piece_graphs.release_captures``).
    weakref.finalize(owner if owner is not None else clone, forget_compiled_entries, code)
    return types.MethodType(clone, owner) if owner is not None else clone


def forget_compiled_entries(code: types.CodeType) -> None:
    """Drop Dynamo's compiled entries of ``code`` (what ``torch._dynamo.reset`` does for every code)."""
    torch._C._dynamo.eval_frame.reset_code(code)


def compile_step(fn: Callable, config: TscompileConfig, wrappers: PieceWrappers | None = None,
                 graph_pass: Callable[[torch.fx.GraphModule], object] | None = None, dynamic: bool = True) -> Callable:
    """``torch.compile`` ``fn`` with this backend, traced under ``tracing_config``; ``fn`` gets a code
    object of its own (``own_code``). ``graph_pass`` edits Dynamo's graph in place before the split.
    ``dynamic=False``: every size static, so the graph gets ``static_inductor_options`` too."""
    fn = own_code(fn)

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        if graph_pass is not None:
            graph_pass(gm)
        with engine_graphs():  # the engine's own step: its PDL and GEMV defaults apply (piece_compiler)
            return compile_graph(gm, example_inputs, config, wrappers)

    compiled = torch.compile(fn, backend=backend, dynamic=dynamic)

    @functools.wraps(fn)
    def run(*args):
        with tracing_config():
            return compiled(*args)

    return run


RECOMPILE_LIMIT = 64  # Dynamo entries per engine step before a recompile is an error


@contextlib.contextmanager
def tracing_config():
    """Dynamo settings the engine traces under: floats stay constants (no CPU scalar inputs in a
    captured graph), ops with data-dependent output sizes (``narrow_rows``) stay in the graph, and
    equal sizes are not assumed equal."""
    import torch.fx.experimental._config as fx_config

    # no duck sizing: a metadata view of bs + 1 rows must not be tied to a buffer that happens to
    # have as many rows, or a later batch size recompiles
    dynamo = {"specialize_float": True, "capture_dynamic_output_shape_ops": True}
    # hitting the recompile limit must fail loudly: Dynamo would otherwise run the step eagerly from
    # then on, slow and without graphs, and nothing would say so
    # An engine's step takes a bounded set of variants (greedy vs sampled; decode's static bs=1 graph
    # is a step of its own; see tscompile/runtime/dynamic_sizes.py): room for all of them.
    known = torch._dynamo.config._config
    missing = [k for k in ("fail_on_recompile_limit_hit", "recompile_limit") if k not in known]
    if missing:  # without them a recompiling step would fall back to eager silently: refuse instead
        raise RuntimeError(f"tscompile: torch {torch.__version__} lacks torch._dynamo.config {missing}; "
                           "tscompile needs torch 2.11 or newer")
    dynamo["fail_on_recompile_limit_hit"] = True
    dynamo["recompile_limit"] = RECOMPILE_LIMIT
    with torch._dynamo.config.patch(**dynamo), fx_config.patch(use_duck_shape=False):
        yield
