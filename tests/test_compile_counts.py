"""How many times Dynamo compiles each engine step: the decode step twice (a static bs=1 graph and one
dynamic graph for every other batch size), the extend step once (every request count, extend and
mixed), and the tokens those graphs sample equal the eager engine's. Also that the extend step's
backend drops only Dynamo's runtime asserts that an input size is not negative (they made the request
counts inputs of the first prefill piece, which would capture once per count).

The order of the start-up on CUDA is replayed on the CPU: the decode ladder's "captures" largest
first (the top size fills the sampled-token buffer) and outside the runner's ``launch`` (grad mode
on), then real steps: a one-request prompt, a full batch, a mixed step and decodes of every size."""

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries

from tscompile import SamplingParams
from tscompile.forward_context import ForwardMode
from tscompile.runtime.dynamic_sizes import drop_input_size_asserts

from helpers import ids, record_inductor_patches, record_modes, small_llm

MAX_NUM_SEQS = 4


def compiles(step) -> int:
    """Dynamo's compiled entries of one engine step (each engine steps over a code object of its own)."""
    return len(cache_entries(step.__wrapped__.__code__))


def run_workload(llm) -> list[list[int]]:
    """One prompt alone, a full batch (extend with MAX_NUM_SEQS requests, then decode at that size
    and smaller ones as requests finish) and a mixed step (a prompt joins running decodes)."""
    out = ids(llm.generate([[4, 8, 15]], SamplingParams(max_new_tokens=3)))
    full = [[i + 3] * (2 + 3 * i) for i in range(MAX_NUM_SEQS)]
    out += ids(llm.generate(full, [SamplingParams(max_new_tokens=2 + i) for i in range(MAX_NUM_SEQS)]))
    first = [llm.add_request([9, 7, 5, 3], SamplingParams(max_new_tokens=6)) for _ in range(2)]
    llm.step()  # both prompts: an extend step
    llm.step()  # a decode step of 2
    late = llm.add_request([11, 12, 13, 14, 15], SamplingParams(max_new_tokens=4))
    while llm.scheduler.running or llm.scheduler.waiting:
        llm.step()  # the late prompt's prefill joins the decodes: a mixed step
    llm.sync()
    return out + [list(r.output) for r in [*first, late]]


def start_up_like_cuda(llm) -> None:
    runner = llm.runner
    for bs in sorted((1, 2, MAX_NUM_SEQS), reverse=True):
        runner.decode.idle_inputs(bs)
        runner.decode.run_compiled(bs, True)


@pytest.mark.parametrize("piece_compiler", ["inductor"])
def test_decode_compiles_twice_and_extend_once_with_eager_tokens(piece_compiler):
    kw = dict(dtype=torch.float32, max_num_seqs=MAX_NUM_SEQS, max_model_len=64)
    eager = small_llm(enforce_eager=True, **kw)
    llm = small_llm(compile_options={"piece_compiler": piece_compiler}, **kw)
    start_up_like_cuda(llm)
    runner = llm.runner
    # the top size's dynamic graph, and bs=1's static one (a step of its own)
    assert compiles(runner.decode.compiled) == 1 and compiles(runner.decode.compiled_one) == 1
    assert compiles(runner.prefill.compiled) == 0
    modes = record_modes(llm)
    tokens = run_workload(llm)
    assert {ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE} <= set(modes)
    assert tokens == run_workload(eager)
    assert compiles(runner.decode.compiled) == 1 and compiles(runner.decode.compiled_one) == 1
    assert compiles(runner.prefill.compiled) == 1


def test_the_extend_backend_drops_only_the_asserts_that_an_input_size_is_not_negative():
    def asserts(gm):
        return [str(n.args[1]) for n in gm.graph.nodes if n.target is torch.ops.aten._assert_scalar.default]

    seen = []

    def capture(gm, example_inputs):
        before = asserts(gm)
        dropped = drop_input_size_asserts(gm)
        read = {p.name for p in gm.graph.find_nodes(op="placeholder") if p.users}
        seen.append((before, dropped, asserts(gm), read))
        return gm.forward

    def f(x, y):
        torch._check(y.shape[0] >= 2)  # a check of the code's own: it stays
        return x * 2, y.sum()

    x, y = torch.randn(5), torch.randn(3)
    for t in (x, y):
        torch._dynamo.decorators.mark_unbacked(t, 0)
    doubled, total = torch.compile(f, backend=capture, dynamic=True)(x, y)
    assert torch.equal(doubled, x * 2) and torch.allclose(total, y.sum())
    [(before, dropped, after, read)] = seen
    assert len(before) == 2 and any(">= 0" in a for a in before)  # Dynamo's own, for x's size
    assert dropped == 1 and len(after) == 1 and ">= 2" in after[0]
    assert len([r for r in read if r.startswith("u")]) == 1  # x's size is read by nothing any more


def test_only_the_bs1_decode_graph_gets_the_static_inductor_options(monkeypatch):
    """The bs=1 decode step compiles with every size static, so ``static_inductor_options`` (on CUDA:
    coordinate-descent tuning, which turns its one-row matmuls into GEMV reductions) reach it; the
    dynamic decode graph and the extend graph do not get them."""
    seen = record_inductor_patches(monkeypatch)
    llm = small_llm(dtype=torch.float32, max_num_seqs=MAX_NUM_SEQS, max_model_len=64,
                    compile_options={"static_inductor_options": {"epilogue_fusion": False}})
    start_up_like_cuda(llm)  # sizes 4, 2, 1: the dynamic graph first, then bs=1's
    assert len(seen) == 2
    assert "epilogue_fusion" not in seen[0] and seen[1]["epilogue_fusion"] is False
    seen.clear()
    llm.generate([[4, 8, 15]], SamplingParams(max_new_tokens=2))  # the extend graph's pieces
    assert seen and all("epilogue_fusion" not in p for p in seen)
