"""Rank 0's runner of a tensor-parallel engine: every command goes to the other ranks first, then
to rank 0's own runner, so all ranks run the same steps in the same order.

It wraps the runner from outside: the engine and the scheduler see the ``StepRunner`` interface
(``launch``, ``can_chain``, ``launches``, timings), and every other attribute reads rank 0's runner.
"""

from __future__ import annotations

import atexit
import weakref

from tscompile.distributed.channel import CAPTURE_DECODE, CAPTURE_PREFILL, LAUNCH, STOP, CommandChannel
from tscompile.distributed.group import RankGroup
from tscompile.distributed.worker import JOIN_SECONDS, WorkerProcesses
from tscompile.runtime.readback import PendingTokens
from tscompile.step_plan import StepPlan

_OPEN: "weakref.WeakSet[TensorParallelRunner]" = weakref.WeakSet()


class TensorParallelRunner:
    """Rank 0's ``runner`` plus the command channel to ranks ``1..size-1``.

    A step that raises on any rank leaves the ranks out of step: the runner then stops the group
    (terminating the workers it spawned) and refuses every later step; a worker's own error is raised
    here with its traceback. ``close()`` (also at interpreter exit and when collected) stops the
    workers cleanly."""

    def __init__(self, runner, group: RankGroup, workers: WorkerProcesses | None):
        self.runner = runner
        self.group = group
        self.channel = CommandChannel(group.control)
        self.workers = workers
        self._stopped: str | None = None
        _OPEN.add(self)

    def __getattr__(self, name: str):
        if name in ("runner", "__setstate__"):  # not set yet (a half-built object): no recursion
            raise AttributeError(name)
        return getattr(self.runner, name)

    @property
    def tensor_parallel_size(self) -> int:
        return self.group.tp.size

    # -- the runner interface --------------------------------------------------------------------
    def launch(self, plan: StepPlan, prev_rows: list[int] | None = None) -> PendingTokens:
        return self._everywhere((LAUNCH, plan, prev_rows), lambda: self.runner.launch(plan, prev_rows))

    def execute(self, plan: StepPlan) -> list[int]:
        return self.launch(plan).wait()

    def capture_prefill_graphs(self, plans: list[StepPlan]) -> None:
        self._everywhere((CAPTURE_PREFILL, plans), lambda: self.runner.capture_prefill_graphs(plans))

    def capture_decode_graphs(self) -> None:
        self._everywhere((CAPTURE_DECODE,), self.runner.capture_decode_graphs)

    def _everywhere(self, command: tuple, run):
        if self._stopped is not None:
            raise RuntimeError(self._stopped)
        try:
            self.channel.send(*command)
            return run()
        except BaseException as exc:
            worker_error = self.workers.failure() if self.workers is not None else None
            summary = worker_error or f"{type(exc).__name__} on rank 0: {str(exc).strip()[:500]}"
            self._stopped = (f"tscompile: the tensor-parallel engine stopped after a failed step "
                             f"({summary.splitlines()[0]}); create a new LLM")
            self._shut_down(clean=False)
            if worker_error is not None:
                raise RuntimeError(f"tscompile: a tensor-parallel worker failed during a step on rank 0:\n"
                                   f"{worker_error}") from exc
            raise

    # -- shutdown ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the other ranks and leave the process group; idempotent."""
        if self._stopped is None:
            self._stopped = "tscompile: the tensor-parallel engine is closed; create a new LLM"
            self._shut_down(clean=True)

    def _shut_down(self, *, clean: bool) -> None:
        _OPEN.discard(self)
        if clean:
            try:
                self.channel.send(STOP)
            except (RuntimeError, ValueError):
                clean = False  # a worker is gone already
        if self.workers is not None:
            self.workers.stop(timeout=JOIN_SECONDS if clean else 0.0)
        self.channel.control = None  # the group's last reference goes with ``group.close``
        self.group.close()

    def __del__(self):
        if getattr(self, "_stopped", "") is None:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - a finalizer must not raise; the workers are terminated below
                if self.workers is not None:
                    self.workers.stop(timeout=0.0)


@atexit.register
def _close_open_engines() -> None:
    """At exit, before multiprocessing joins its children: stop every engine's workers."""
    for runner in list(_OPEN):
        try:
            runner.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
