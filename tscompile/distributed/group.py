"""The process group of a tensor-parallel engine: one the engine set up over its spawned workers,
or the one ``torchrun`` describes (or the caller initialised).

Every rank joins the default (world) process group, whose backend carries the model's collectives
(NCCL on CUDA, gloo on the CPU), and one more gloo group, the control channel, over which rank 0
sends each step's plan: a plan is host data, and on CUDA it then never waits behind the GPU work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tscompile.models.parallel import TensorParallel

# what torchrun (and torch's env:// rendezvous) sets for every process it starts
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# how long a collective may wait for a peer before it fails (a dead worker under NCCL hangs until then)
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


# set while an engine of this process owns the default process group it made for its spawned workers
_ENGINE_GROUP: list[bool] = [False]


def launched_externally() -> bool:
    """Whether this process is one rank of a group started outside the engine: a process group the
    caller initialised, or torchrun's variables (``torch.distributed``'s env:// convention)."""
    if dist.is_available() and dist.is_initialized():
        if _ENGINE_GROUP[0]:
            raise ValueError("tscompile: another tensor-parallel engine of this process still holds its ranks; "
                             "call close() on it before building a new one (one at a time per process)")
        return True
    return all(v in os.environ for v in TORCHRUN_VARIABLES)


def collective_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class RankGroup:
    """This process's membership: ``tp`` (rank, size, the world group's name the model's collectives
    address), its ``device``, the gloo ``control`` group, and whether the engine initialised the
    default process group (then it also destroys it)."""

    tp: TensorParallel
    device: torch.device
    control: dist.ProcessGroup
    owns_default_group: bool

    @property
    def rank(self) -> int:
        return self.tp.rank

    def exchange(self, value) -> list:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        out = [None] * self.tp.size
        dist.all_gather_object(out, value, group=self.control)
        return out

    def close(self) -> None:
        """Leave the group: destroys the control group, and the default group if the engine made it.
        The control group object is dropped here too: left to the interpreter's teardown, its gloo
        threads can be destroyed unjoined, which aborts a process that has finished its work
        ("terminate called without an active exception", about one torchrun exit in three)."""
        control, self.control = self.control, None
        if control is None or not dist.is_initialized():
            return
        try:
            dist.destroy_process_group(control)
            if self.owns_default_group:
                dist.destroy_process_group()
        except (RuntimeError, ValueError):  # a peer died or the group is gone already: nothing left to free
            pass
        finally:
            if self.owns_default_group:
                _ENGINE_GROUP[0] = False


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of a rank: ``cuda:<local rank>`` on CUDA (one GPU per rank), the CPU otherwise."""
    if device.type != "cuda":
        return device
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"tscompile: tensor-parallel rank with local rank {local_rank} needs cuda:{local_rank}, but "
                         f"{torch.cuda.device_count()} CUDA device(s) are visible; use a tensor_parallel_size of at "
                         "most the GPUs per node")
    return torch.device("cuda", local_rank)


def join_group(*, rank: int, size: int, device: torch.device, local_rank: int,
               store: dist.Store | None = None) -> RankGroup:
    """Join (or adopt) the default process group as ``rank`` of ``size`` and make the control group.

    ``store``: the rendezvous of an engine's spawned workers; None: torch's env:// rendezvous
    (torchrun's variables), unless a group is initialised already."""
    device = rank_device(device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns:
        backend = collective_backend(device)
        if store is None:
            dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        _ENGINE_GROUP[0] = True
    world = dist.get_world_size()
    if world != size:
        raise ValueError(f"tscompile: tensor_parallel_size {size}, but the process group has {world} processes; "
                         f"one engine spans every process of the group: start {size} processes (torchrun "
                         f"--nproc-per-node {size}) or pass tensor_parallel_size={world}")
    rank = dist.get_rank()
    control = dist.new_group(backend="gloo")
    group = RankGroup(TensorParallel(rank, size, dist.group.WORLD.group_name), device, control, owns)
    if device.type == "cuda":
        # NCCL makes its communicator at the first collective: here, not inside a graph capture
        dist.all_reduce(torch.zeros(1, device=device))
        torch.cuda.synchronize(device)
    return group


def torchrun_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
