"""The scheduler's recurrent-state slots: one per running request of a model with state layers.

A request gets a slot when it is admitted and gives it back when it is released: at its finish,
at an abort, and at a preemption, whose re-prefill starts from position 0 (``has_state`` False on
its first chunk) and so recomputes the state in whichever slot it gets next. The step plan carries
the slots beside the block tables (``StepPlan.state_slots``), so one refresh publishes both.
There is one slot per block-table row plus the null slot, so admission never waits for a slot.
"""

from __future__ import annotations

import numpy as np

from tscompile.kv_cache.state_pool import StateSlotAllocator


class StateSlots:
    def __init__(self, max_num_seqs: int):
        self.allocator = StateSlotAllocator(max_num_seqs + 1)  # + the null slot

    def admit(self, request) -> None:
        self.allocator.allocate(request.rid)

    def release(self, request) -> None:
        self.allocator.free(request.rid)

    def plan_slots(self, requests) -> np.ndarray:
        """[B] int64: the slots of ``requests``, in plan row order."""
        return np.array([self.allocator.slot_of(r.rid) for r in requests], dtype=np.int64)
