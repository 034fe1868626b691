"""Rank 0 -> every other rank: the commands of a tensor-parallel engine, in order.

A command is a tuple: ``("launch", plan, prev_rows)`` (one step: the scheduler's immutable
``StepPlan`` and the rows of the previous sample that feed its decode rows),
``("capture_prefill", plans)`` and ``("capture_decode",)`` (start-up captures run by every rank in
step), ``("stop",)``. Commands travel pickled over the gloo control group
(``broadcast_object_list``): a plan is a few numpy arrays of the step's size.
"""

from __future__ import annotations

import torch.distributed as dist

LAUNCH, CAPTURE_PREFILL, CAPTURE_DECODE, STOP = "launch", "capture_prefill", "capture_decode", "stop"


class CommandChannel:
    def __init__(self, control: dist.ProcessGroup):
        self.control = control

    def send(self, *command) -> None:
        """Rank 0: hand ``command`` to every other rank (returns once it is sent)."""
        dist.broadcast_object_list([command], src=0, group=self.control)

    def receive(self) -> tuple:
        """Any other rank: wait for rank 0's next command."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]
