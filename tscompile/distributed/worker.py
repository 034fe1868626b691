"""The ranks other than 0: build the shard, then run rank 0's commands until it says stop.

``serve`` is the loop (a spawned worker and a torchrun rank run the same one); ``spawned_worker`` is
the entry point of a process the engine starts (``torch.multiprocessing``, spawn), and
``WorkerProcesses`` is rank 0's handle on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tscompile.distributed.channel import CAPTURE_DECODE, CAPTURE_PREFILL, LAUNCH, STOP, CommandChannel
from tscompile.distributed.group import join_group
from tscompile.distributed.rank import build_rank, exchange_build_errors

JOIN_SECONDS = 30.0  # how long a clean stop waits for the workers before terminating them


def serve(runner, channel: CommandChannel) -> None:
    """Run every command of rank 0 on this rank's ``runner`` until ``stop``. The sampled tokens stay
    on the device (every rank samples the same gathered logits alike; rank 0 reads them back)."""
    while True:
        command = channel.receive()
        kind = command[0]
        if kind == LAUNCH:
            runner.launch(command[1], command[2])
        elif kind == CAPTURE_PREFILL:
            runner.capture_prefill_graphs(command[1])
        elif kind == CAPTURE_DECODE:
            runner.capture_decode_graphs()
        elif kind == STOP:
            return
        else:
            raise RuntimeError(f"tscompile: unknown tensor-parallel command {kind!r}")


@dataclass(frozen=True)
class WorkerSpec:
    """What a spawned worker needs to build its shard as rank 0 builds its own."""

    model: object  # a preset name, a ModelConfig or a checkpoint directory (picklable)
    build_kwargs: dict  # build_model_engine's keyword arguments, the device among them
    size: int
    store_port: int
    num_threads: int


def spawned_worker(index: int, spec: WorkerSpec) -> None:
    """Entry point of worker ``index`` (rank ``index + 1``), started by ``WorkerProcesses.start``.
    An exception ends the process; torch.multiprocessing hands its traceback to rank 0."""
    torch.set_num_threads(spec.num_threads)
    rank = index + 1
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.size, is_master=False)
    store.set(_started_key(rank), "1")
    group = join_group(rank=rank, size=spec.size, device=spec.build_kwargs["device"], local_rank=rank, store=store)
    try:
        parts, error = build_rank(spec.model, spec.build_kwargs, group)
        if exchange_build_errors(group, error):
            return  # rank 0 raises the error
        serve(parts.runner, CommandChannel(group.control))
    finally:
        group.close()


class WorkerProcesses:
    """Rank 0's handle on the worker processes it spawned."""

    def __init__(self, context: mp.ProcessContext):
        self.context = context

    @classmethod
    def start(cls, spec: WorkerSpec) -> "WorkerProcesses":
        context = mp.start_processes(spawned_worker, args=(spec,), nprocs=spec.size - 1, join=False,
                                     start_method="spawn")
        return cls(context)

    def wait_started(self, store: dist.Store, size: int) -> None:
        """Wait until every worker has reached its entry point; a worker that died on the way (its
        import of the calling script, say) is refused here rather than hanging the rendezvous."""
        for rank in range(1, size):
            while not store.check([_started_key(rank)]):
                why = self.failure(timeout=0.2)
                if why is not None:
                    raise RuntimeError(
                        f"tscompile: tensor-parallel worker rank {rank} ended before joining the group ({why}). "
                        "Workers are spawned: a script that builds a tensor-parallel LLM at its top level must "
                        "guard it with `if __name__ == \"__main__\":`")

    def failure(self, timeout: float = 5.0) -> str | None:
        """Why a worker ended, when one failed (its traceback, or its exit signal); None while all run
        or after they all ended cleanly. Waits up to ``timeout`` s for a failing worker to end."""
        try:
            self.context.join(timeout)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:  # raised or killed (others terminated)
            return str(exc).strip()
        return None

    def stop(self, timeout: float = JOIN_SECONDS) -> None:
        """Wait for the workers to end (after ``stop`` was sent), then terminate any still running."""
        try:
            self.context.join(timeout)
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            pass  # already reported, or a worker killed on the way down: nothing left to wait for
        for process in self.context.processes:
            if process.is_alive():
                process.terminate()
                process.join(JOIN_SECONDS)
            if process.is_alive():
                process.kill()

    def pids(self) -> list[int]:
        return self.context.pids()


def _started_key(rank: int) -> str:
    return f"tscompile/worker-started/{rank}"
