"""What keeps each compiled engine step at one dynamic graph (decode's static bs=1 graph is its own step).

Dynamo specializes on more than the sizes a step asks for. The causes met, and the answer to each:

- The sampling op writes ``tokens[:n]``, a view of a graph input. Functionalizing that write
  (``auto_functionalized_v2``) asks whether ``n`` differs from the buffer's rows and guards on the
  answer, so a step compiled with as many rows as the buffer (the decode ladder's top size, a full
  prefill batch) and one compiled with fewer could not share a graph. ``SpareRowSampling`` gives
  the token buffer one row no step writes: ``n`` is always smaller, the guard always holds.
- A compiled call made with grad mode on (the start-up decode capture) and one made under the
  runner's ``inference_mode`` guard on different global state, and the former traces a training
  graph (the parameters require grad). The runner enters inference mode around every compiled call.
- A one-request extend step specializes every per-request size to 1 (Dynamo's 0/1
  specialization, which ``mark_dynamic`` does not lift): its logits rows are padded to two
  (``min_logits_rows``, also the smallest prefill request bucket) and the attention metadata is
  marked unbacked (``mark_extend_request_dims``). The token count is not marked: prefill graphs
  pad it to a bucket of at least 16, and an unbacked token count would hide the GEMMs' sizes from
  Inductor's kernel choice.
- Dynamo asserts at run time that each unbacked size is at least 0, at the top of its graph: the
  request counts would become inputs of the first compiled prefill piece, whose graphs are keyed
  by their inputs' sizes, so a step of 3 requests in the request bucket 4 captured anew after
  start-up (and a piece would capture once per request count). The extend step's backend drops
  these asserts on input sizes (``drop_input_size_asserts``): a tensor's size is never negative.
- EXTEND and MIXED steps read one graph: the forward context hands layers ``attention_mode``, a
  field, so Dynamo guards on EXTEND's identity and not on the step's mode.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from tscompile.sampling import SamplingBuffers, SamplingInputs


class SpareRowSampling(SamplingBuffers):
    """``SamplingBuffers`` whose token buffer has one row past ``max_rows``: steps write at most
    ``max_rows`` rows, so a written view ``tokens[:n]`` never spans the whole buffer."""

    def __init__(self, inputs: SamplingInputs):
        super().__init__(inputs)
        self.tokens = torch.zeros(self.max_rows + 1, dtype=torch.int64, device=inputs.seeds.device)


def mark_extend_request_dims(leaves, completes: torch.Tensor | None, state=None) -> None:
    """Keep an extend/mixed step's request count out of its graph's guards.

    The per-request metadata (each cache group's page table and KV lengths, the narrowing's
    ``completes``, the recurrent-state layers' slots, row offsets and flags of ``state``, a
    ``StateBackend``) is read only by custom ops whose fake kernels never look at its rows, yet a
    one-request step would specialize its size to 1 and compile a second graph. Unbacked sizes
    are never specialized. The logits rows cannot be unbacked (the sampler slices and writes by
    their count, which must be compared with the buffers'): the runner pads them to at least
    ``min_logits_rows`` instead."""
    mark = torch._dynamo.decorators.mark_unbacked
    for leaf in leaves:
        meta = leaf.forward_extend_metadata
        mark(meta.page_table, 0)
        mark(meta.seq_lens, 0)
    if completes is not None:
        mark(completes, 0)
    if state is not None:
        meta = state.forward_extend_metadata
        for t in (meta.state_slots, meta.cu_seqlens, meta.has_state):
            mark(t, 0)


def min_logits_rows(max_num_seqs: int) -> int:
    """The fewest logits rows an extend/mixed step samples (rows past its requests are padding):
    two, so no step's row count is specialized to 1 (an engine of one sequence has only that size)."""
    return min(2, max_num_seqs)


def _is_input_size_lower_bound(node: torch.fx.Node) -> bool:
    """``_assert_scalar(s >= 0)`` where ``s`` is a SymInt graph input (a size, stride or storage offset
    of an input tensor: never negative, so the assert can never fail)."""
    if node.op != "call_function" or node.target is not torch.ops.aten._assert_scalar.default:
        return False
    cond = node.args[0]
    if not isinstance(cond, torch.fx.Node) or cond.op != "call_function" or cond.target is not operator.ge:
        return False
    sym, bound = cond.args
    return (isinstance(sym, torch.fx.Node) and sym.op == "placeholder" and bound == 0
            and isinstance(sym.meta.get("example_value"), torch.SymInt))


def drop_input_size_asserts(gm: torch.fx.GraphModule) -> int:
    """Remove the runtime asserts that an input size is at least 0 from ``gm`` (in place), so the
    sizes they read stop being inputs of the piece they land in; returns how many were removed."""
    dropped = [n for n in gm.graph.nodes if _is_input_size_lower_bound(n)]
    for node in dropped:
        cond = node.args[0]
        gm.graph.erase_node(node)
        if not cond.users:
            gm.graph.erase_node(cond)
    if dropped:
        gm.recompile()
    return len(dropped)
