"""Build a tensor-parallel engine: start (or join) the ranks, build every rank's shard in step, hand
rank 0 an ``EngineParts`` whose runner drives the others.

Spawned (the default): the calling process is rank 0; it opens a TCP store on a free port of the
loopback interface and starts ``size - 1`` workers (``torch.multiprocessing``, spawn), rank ``i`` on
``cuda:i`` or the CPU. Launched externally (``torchrun``, or a process group the caller initialised):
each process is the rank the group says, on ``cuda:<LOCAL_RANK>``; on ranks other than 0 the ``LLM``
constructor serves rank 0 until rank 0 closes its engine, then ends the process (``SystemExit(0)``),
so code after the constructor runs on rank 0 only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tscompile.distributed.group import RankGroup, join_group, launched_externally, torchrun_local_rank
from tscompile.distributed.runner import TensorParallelRunner
from tscompile.distributed.rank import build_rank, exchange_build_errors
from tscompile.distributed.worker import WorkerProcesses, WorkerSpec, serve
from tscompile.distributed.channel import CommandChannel
from tscompile.runtime.build import EngineParts


def check_tensor_parallel_model(model, size: int, device: torch.device) -> None:
    """Refuse what cannot be split ``size`` ways, before any process starts."""
    from tscompile.models import Transformer, model_config
    from tscompile.models.parallel import check_tensor_parallel
    from tscompile.models.qwen3_next import Qwen3NextConfig

    if isinstance(model, Transformer):
        raise ValueError(f"tscompile: tensor_parallel_size {size} needs a preset name, a ModelConfig or a checkpoint "
                         "directory (each rank builds its own shard), not a built Transformer")
    if device.type == "cuda" and device.index is not None:
        raise ValueError(f"tscompile: device {str(device)!r} with tensor_parallel_size {size}: rank r runs on "
                         "cuda:<its local rank>; pass device='cuda' (choose the GPUs with CUDA_VISIBLE_DEVICES)")
    if device.type == "cuda" and not launched_externally() and size > torch.cuda.device_count():
        raise ValueError(f"tscompile: tensor_parallel_size {size} needs {size} GPUs, {torch.cuda.device_count()} "
                         "are visible; use a smaller tensor_parallel_size")
    cfg = model_config(model)
    if isinstance(cfg, Qwen3NextConfig):
        raise ValueError(f"tscompile: tensor_parallel_size {size} is not supported for a model with recurrent-state "
                         "(linear-attention) layers (hybrid Qwen3-Next); use tensor_parallel_size=1")
    check_tensor_parallel(cfg, size)


def build_tensor_parallel_engine(model, size: int, build_kwargs: dict) -> EngineParts:
    """Rank 0's ``EngineParts`` (its runner a ``TensorParallelRunner``); on another rank of an
    externally launched group: serve, then ``SystemExit(0)``. ``build_kwargs``: those of
    ``build_model_engine``, the resolved ``device`` among them."""
    device = build_kwargs["device"]
    check_tensor_parallel_model(model, size, device)
    workers = None
    if launched_externally():
        group = join_group(rank=-1, size=size, device=device, local_rank=torchrun_local_rank())
    else:
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
        workers = WorkerProcesses.start(WorkerSpec(model, build_kwargs, size, store.port, torch.get_num_threads()))
        try:
            workers.wait_started(store, size)
            group = join_group(rank=0, size=size, device=device, local_rank=0, store=store)
        except BaseException:
            workers.stop(timeout=0.0)
            raise
    try:
        parts, error = build_rank(model, build_kwargs, group)
        errors = exchange_build_errors(group, error)
    except BaseException:
        if workers is not None:
            workers.stop(timeout=0.0)
        group.close()
        raise
    if errors:
        if workers is not None:
            workers.stop()
        group.close()
        if error is not None:
            raise error  # this rank's own (a refusal stays the ValueError it is)
        raise RuntimeError("tscompile: a tensor-parallel rank could not build its shard:\n" + "\n".join(errors))
    if group.rank != 0:
        try:
            serve(parts.runner, CommandChannel(group.control))
        finally:
            group.close()
        raise SystemExit(0)
    parts.runner = TensorParallelRunner(parts.runner, group, workers)
    return parts
