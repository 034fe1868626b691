"""Tensor parallelism on ``torch.distributed``: the ranks of an engine, their process group, and the
command channel over which rank 0's scheduler drives them (``docs/tensor_parallel.md``).

The model side (column/row-parallel layers, the vocabulary split, sharded loading) lives in
``tscompile/models/parallel.py``; this package only starts, joins, drives and stops ranks.
"""

from tscompile.distributed.engine import build_tensor_parallel_engine, check_tensor_parallel_model
from tscompile.distributed.runner import TensorParallelRunner

__all__ = ["TensorParallelRunner", "build_tensor_parallel_engine", "check_tensor_parallel_model"]
