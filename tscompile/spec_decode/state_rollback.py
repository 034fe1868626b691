"""Speculative decoding over recurrent-state layers: the state after the kept tokens only.

A verify step runs its whole window (the newest token, then k drafts) through every layer, so a
linear-attention layer's state leaves the step having folded in all N rows, rejected drafts too.
Paged KV needs nothing for that (rejected rows are never read again); a recurrent state does. Before
the step the live requests' slots are copied aside; after acceptance, a request that kept fewer than
N tokens gets its copy back and re-advances through the kept rows in one extend step (the kept
tokens at their positions, sampled and discarded). A request that kept its whole window, or that
finished, needs neither. The re-advance is a second forward for those requests only: exact, and
without per-row state checkpoints in the kernels.
"""

from __future__ import annotations

import numpy as np
import torch

from tscompile.forward_context import ForwardMode
from tscompile.kv_cache.state_pool import StatePool
from tscompile.step_plan import GroupPlan, SamplingRows, StepPlan, no_drafts, row_offsets


class StateRollback:
    def __init__(self, pool: StatePool, banned_width: int):
        self.pool, self.banned_width = pool, banned_width
        self.readvanced_requests = 0  # requests whose state was put back and re-advanced

    def snapshot(self, slots: np.ndarray) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A copy of ``slots``' state in every layer (conv windows and recurrent states)."""
        index = torch.from_numpy(np.ascontiguousarray(slots)).to(next(iter(self.pool.conv.values())).device)
        return index, [t.index_select(0, index) for t in self._tensors()]

    def restore(self, saved: tuple[torch.Tensor, list[torch.Tensor]], rows: list[int]) -> None:
        """Put back the snapshot of the snapshot's ``rows`` (positions in its slot array)."""
        index, copies = saved
        pick = torch.tensor(rows, dtype=torch.int64, device=index.device)
        for t, copy in zip(self._tensors(), copies):
            t.index_copy_(0, index.index_select(0, pick), copy.index_select(0, pick))

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.pool.conv.values(), *self.pool.ssm.values()]

    def readvance_plan(self, verify: StepPlan, rows: list[int], kept: list[int]) -> StepPlan:
        """The extend step that folds ``kept[j]`` leading rows of verify request ``rows[j]``'s
        window into its (restored) state: greedy, its samples discarded."""
        width = verify.verify_width
        start = verify.prefix_lens[rows].astype(np.int64)
        q_lens = np.array(kept, dtype=np.int32)
        ids = np.concatenate([verify.input_ids[r * width: r * width + n] for r, n in zip(rows, kept)])
        positions = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(start, kept)])
        b = len(rows)
        qo = row_offsets(q_lens)
        group = verify.groups[0]
        greedy = SamplingRows(np.zeros(b, np.float32), np.ones(b, np.int32), np.ones(b, np.float32),
                              np.zeros(b, np.int64), (start + q_lens).astype(np.int64),
                              np.full((b, self.banned_width), -1, np.int64), True, False)
        plan_group = GroupPlan(q_lens, (start + q_lens).astype(np.int32), group.block_tables[rows], group.block_size)
        no = np.zeros(b, dtype=bool)
        return StepPlan(ForwardMode.EXTEND, tuple(verify.request_ids[r] for r in rows), b, ids, positions, q_lens,
                        start.astype(np.int32), no, no, (plan_group,), (qo[1:] - 1).astype(np.int64), greedy, 1,
                        no_drafts(b), verify.state_slots[rows])
