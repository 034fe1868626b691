"""A torch.compile user's whole graph without its last piece (``tscompile/user_graph_tail.py``): the
head and tail split of a split module's forward, which outputs come from memory of the tail's own,
and a transformers decoder run with its vocabulary projection outside the graph where its logits
are large, equal to eager (CPU, padded without graphs; the replay is in test_user_compile_gpu.py)."""

import operator

import pytest
import torch
import torch.fx

from tscompile import user_graph_tail, user_graphs
from tscompile.counters import counters

from test_user_compile import run_lengths, tiny_llama

TAIL_ON = {"kernels": {"user_graph_eager_tail": True}}


class _Twice(torch.nn.Module):
    def forward(self, x):
        return x * 2, x + 1


class _ViewAndScale(torch.nn.Module):
    def forward(self, x):
        return x.view(-1), x * 3


def _two_pieces(last: torch.nn.Module, compute_after: bool = False):
    """``submod_0`` then ``last``; the forward returns the last piece's outputs around one of the
    first's (or, with ``compute_after``, adds to one of the last piece's outputs first)."""
    root = torch.nn.Module()
    root.submod_0, root.submod_1 = _Twice(), last
    g = torch.fx.Graph()
    x = g.placeholder("x")
    first = g.call_module("submod_0", (x,))
    kept = g.call_function(operator.getitem, (first, 0))
    second = g.call_module("submod_1", (kept,))
    out0 = g.call_function(operator.getitem, (second, 0))
    out1 = g.call_function(operator.getitem, (second, 1))
    if compute_after:
        out0 = g.call_function(operator.add, (out0, 1))
    g.output((out0, kept, out1))
    return torch.fx.GraphModule(root, g)


def test_the_head_and_tail_give_the_forward_and_only_the_tails_own_memory_is_fresh():
    x = torch.randn(3, 4)
    for last in (_Twice(), _ViewAndScale()):
        module = _two_pieces(last)
        tail = user_graph_tail.split_off_tail(module, {"submod_1": last}, {"submod_1": [x]}, [x, x, x], None)
        head_out = tail.head(x)
        out, fresh = tail.finish(head_out, live=3)
        want = module(x)
        assert len(out) == 3 and all(torch.equal(o, w) for o, w in zip(out, want))
        assert out[1] is head_out[1][0]  # made before the tail: the head's own output
        # a view of the tail's argument lives where the argument does (graph memory under a replay)
        assert fresh == ({id(out[0]), id(out[2])} if isinstance(last, _Twice) else {id(out[2])})


def test_only_the_outputs_the_tail_makes_count_toward_the_limit(monkeypatch):
    """The forward's second output comes from before the tail (copied out of graph memory either
    way): however large, it does not make leaving the tail out pay."""
    small, huge = torch.empty(2, 4), torch.empty(1000, 1000)
    module = _two_pieces(_Twice())
    tail = user_graph_tail.split_off_tail(module, {"submod_1": _Twice()}, {"submod_1": [small]}, [small, huge, small],
                                          None)
    monkeypatch.setattr(user_graph_tail, "EAGER_TAIL_MIN_BYTES", 2 * small.nbytes)
    assert tail.pays_at(1)
    monkeypatch.setattr(user_graph_tail, "EAGER_TAIL_MIN_BYTES", 2 * small.nbytes + 1)
    assert not tail.pays_at(1)


def test_no_tail_where_the_forward_computes_after_its_last_piece_or_does_not_know_it():
    x = torch.randn(3, 4)
    assert user_graph_tail.split_off_tail(_two_pieces(_Twice(), compute_after=True), {"submod_1": _Twice()},
                                          {"submod_1": [x]}, [x, x, x], None) is None
    assert user_graph_tail.split_off_tail(_two_pieces(_Twice()), {}, {}, [x, x, x], None) is None


def test_large_logits_run_the_last_piece_at_the_live_rows_and_equal_eager(monkeypatch):
    """Outputs at the 128-token bucket (128 x 96 float32 logits) over the limit, at 32 under it: a
    100-token prompt runs its vocabulary projection after the bucket's head, a 17-token one inside."""
    torch.compiler.reset()
    monkeypatch.setattr(user_graph_tail, "EAGER_TAIL_MIN_BYTES", 100 * 96 * 4)
    model = tiny_llama(layers=2)
    rows_seen = []
    finish = user_graph_tail.GraphTail.finish

    def spy(self, head_out, live):
        out, fresh = finish(self, head_out, live)
        rows_seen.append((live, out[0].shape))
        return out, fresh

    monkeypatch.setattr(user_graph_tail.GraphTail, "finish", spy)
    fwd = torch.compile(model.forward, backend="tscompile", dynamic=True,
                        options={"split_sdpa": True, "cudagraphs": True, "token_ladder": (32, 128), **TAIL_ON})
    tails, wholes = counters["user_eager_tails"], counters["user_whole_graphs"]
    with user_graphs.pad_without_graphs():
        run_lengths(fwd, model, (17, 100, 120))
    assert counters["user_whole_graphs"] - wholes == 1
    assert counters["user_eager_tails"] - tails == 2
    assert rows_seen == [(100, torch.Size([1, 100, 96])), (120, torch.Size([1, 120, 96]))]


def test_the_tail_stays_in_the_graph_unless_the_policy_asks(monkeypatch):
    """``KernelPolicy.user_graph_eager_tail`` is off by default: outputs of any size are copied."""
    torch.compiler.reset()
    monkeypatch.setattr(user_graph_tail, "EAGER_TAIL_MIN_BYTES", 0)
    model = tiny_llama(layers=1)
    fwd = torch.compile(model.forward, backend="tscompile", dynamic=True,
                        options={"split_sdpa": True, "cudagraphs": True, "token_ladder": (32, 128)})
    tails, wholes = counters["user_eager_tails"], counters["user_whole_graphs"]
    with user_graphs.pad_without_graphs():
        run_lengths(fwd, model, (17, 100))
    assert counters["user_whole_graphs"] - wholes == 1 and counters["user_eager_tails"] == tails


def test_a_batch_of_prompts_hands_the_tail_dense_rows(monkeypatch):
    """Two prompts a call ([2, tokens] ids): the tail's arguments cut to the live rows from the bucket's
    are not dense (the batch dim's stride is the bucket's), so they are copied dense before the
    compiled tail piece, which asserts dense strides at the live row count."""
    torch.compiler.reset()
    monkeypatch.setattr(user_graph_tail, "EAGER_TAIL_MIN_BYTES", 0)
    model = tiny_llama(layers=2)
    # the token dim dynamic, the batch of two static (a graph with another dynamic size runs unpadded)
    fwd = torch.compile(model.forward, backend="tscompile",
                        options={"split_sdpa": True, "cudagraphs": True, "token_ladder": (32, 128), **TAIL_ON})
    tails = counters["user_eager_tails"]
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad(), user_graphs.pad_without_graphs():
        for n in (20, 100, 128):
            ids = torch.randint(0, 96, (2, n), generator=gen)
            torch._dynamo.mark_dynamic(ids, 1)
            out = torch.full((2, n, 96), float("nan"))
            out.copy_(fwd(input_ids=ids, use_cache=False).logits)
            torch.testing.assert_close(out, model(input_ids=ids, use_cache=False).logits, rtol=1e-5, atol=1e-5,
                                       msg=f"length {n}")
    assert counters["user_eager_tails"] - tails == 3


class _TokenDim1:
    """The token positions of one output shaped [1, tokens, 96]."""
    where = [(1,)]


@pytest.mark.parametrize("rows,pays", [(32, False), (128, True)])
def test_the_limit_counts_the_outputs_at_the_bucket(monkeypatch, rows, pays):
    monkeypatch.setattr(user_graph_tail, "EAGER_TAIL_MIN_BYTES", 64 * 96 * 4)
    tail = user_graph_tail.GraphTail(None, None, None, None, [torch.empty(1, 7, 96)], _TokenDim1())
    assert tail.pays_at(rows) is pays
