"""How many times Dynamo compiles each engine step: the decode step twice (a static bs=1 graph and one
dynamic graph for every other batch size), the extend step twice (a one-request step specializes
its request sizes to 1; every other request count, extend and mixed, shares one graph), and the tokens those graphs sample equal the eager engine's.

The order of the start-up on CUDA is replayed on the CPU: the decode ladder's "captures" largest
first (the top size fills the sampled-token buffer) and outside the runner's ``launch`` (grad mode
on), then real steps: a one-request prompt, a full batch, a mixed step and decodes of every size."""

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries

from tscompile import SamplingParams
from tscompile.forward_context import ForwardMode

from helpers import ids, record_modes, small_llm

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
        runner._prepare_decode_capture(bs)
        runner._run_decode(bs, True)


@pytest.mark.parametrize("piece_compiler", ["inductor"])
def test_decode_compiles_twice_and_extend_twice_with_eager_tokens(piece_compiler):
    kw = dict(dtype=torch.float32, max_num_seqs=MAX_NUM_SEQS, max_model_len=64)
    eager = small_llm(enforce_eager=True, **kw)
    llm = small_llm(compile_options={"piece_compiler": piece_compiler}, **kw)
    start_up_like_cuda(llm)
    runner = llm.runner
    assert compiles(runner.decode_step) == 2  # the top size's dynamic graph and bs=1's static one
    assert compiles(runner.extend_step) == 0
    modes = record_modes(llm)
    tokens = run_workload(llm)
    assert {ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE} <= set(modes)
    assert tokens == run_workload(eager)
    assert compiles(runner.decode_step) == 2
    assert compiles(runner.extend_step) == 2  # one request (sizes of 1 specialized) and every other count
