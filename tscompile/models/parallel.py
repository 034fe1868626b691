"""Megatron-style tensor-parallel layers, and which part of a model each rank holds.

A rank of ``size`` holds 1/size of the query heads, of the KV heads (or one KV head shared with the
ranks of its query group when the model has fewer KV heads than ranks), of the MLP width and of the
(padded) vocabulary; norms are replicated.

- Column-parallel layers (the fused q/k/v and gate/up projections) are plain linears over the rank's
  slice of the output features: no communication.
- Row-parallel layers (o and down) take the rank's slice of the input features and sum the partial
  outputs over the ranks: one all-reduce after attention and one after the MLP.
- The embedding looks up the rank's vocabulary rows (zeros for every other id) and all-reduces; the
  LM head computes the rank's vocabulary columns of the logits and all-gathers them.

The collectives are torch's functional collectives (the ``_c10d_functional`` ops): Dynamo and
Inductor trace them like any op with a fake kernel, CUDA graphs capture them on NCCL, and gloo runs
them on the CPU. With ``tensor_parallel_size=1`` none of these layers is built: the model holds plain
``nn.Linear`` / ``nn.Embedding`` modules and runs no collective.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tscompile.utils import cdiv

if TYPE_CHECKING:
    from tscompile.models.llama import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: ``rank`` in ``[0, size)`` and the name of
    the c10d process group (``ProcessGroup.group_name``) the collectives address."""

    rank: int
    size: int
    group_name: str


def _funcol():
    return torch.ops._c10d_functional


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the ranks (any shape, dtype and device of the group's backend)."""
    ops = _funcol()
    return ops.wait_tensor(ops.all_reduce(x, "sum", group_name))


def all_gather_columns(x: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    """``x: [B, n]`` on each rank -> ``[B, size * n]``, rank r's columns at ``[r * n, (r + 1) * n)``."""
    ops = _funcol()
    rows, cols = x.shape
    gathered = ops.wait_tensor(ops.all_gather_into_tensor(x.contiguous(), size, group_name))  # [size * B, n]
    return gathered.view(size, rows, cols).permute(1, 0, 2).reshape(rows, size * cols)


def min_over_ranks(value: int, tp: TensorParallel | None, device: torch.device) -> int:
    """The smallest ``value`` any rank holds (ranks that size a pool from their own free memory must
    agree on one size); ``value`` itself without tensor parallelism."""
    if tp is None or tp.size == 1:
        return value
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_resolve_process_group(tp.group_name))
    return int(t.item())


def check_tensor_parallel(cfg: "ModelConfig", size: int) -> None:
    """Refuse a ``tensor_parallel_size`` the model cannot be split by."""
    if cfg.narrow_layer is not None:
        raise ValueError(f"tscompile: tensor_parallel_size {size}: the narrowing model (narrow_layer "
                         f"{cfg.narrow_layer}) runs on one device only; use tensor_parallel_size=1")
    divisors = [d for d in range(1, cfg.n_heads + 1) if cfg.n_heads % d == 0 and _kv_splits(cfg.n_kv_heads, d)
                and cfg.intermediate_size % d == 0]
    if cfg.n_heads % size:
        raise ValueError(f"tscompile: tensor_parallel_size {size} must divide the model's {cfg.n_heads} query heads; "
                         f"sizes this model splits into: {divisors}")
    if not _kv_splits(cfg.n_kv_heads, size):
        raise ValueError(f"tscompile: tensor_parallel_size {size} must divide the model's {cfg.n_kv_heads} KV heads "
                         f"or be a multiple of them (each KV head then replicated); sizes this model splits into: "
                         f"{divisors}")
    if cfg.intermediate_size % size:
        raise ValueError(f"tscompile: tensor_parallel_size {size} must divide the MLP width "
                         f"{cfg.intermediate_size}; sizes this model splits into: {divisors}")


def _kv_splits(n_kv_heads: int, size: int) -> bool:
    return n_kv_heads % size == 0 or size % n_kv_heads == 0


@dataclass(frozen=True)
class ShardLayout:
    """Which part of the model ``config`` (the whole model's) rank ``rank`` of ``size`` holds.

    Ranges are of rows of the stored projections (heads times head_dim) or of vocabulary ids."""

    config: "ModelConfig"
    rank: int
    size: int

    @property
    def q_heads(self) -> range:
        n = self.config.n_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def kv_heads(self) -> range:
        """This rank's KV heads: its share, or the one head its query heads read when the model has
        fewer KV heads than ranks (``size / n_kv_heads`` ranks hold a copy of each)."""
        kv = self.config.n_kv_heads
        if kv >= self.size:
            n = kv // self.size
            return range(self.rank * n, (self.rank + 1) * n)
        head = self.rank // (self.size // kv)
        return range(head, head + 1)

    def _rows(self, heads: range) -> range:
        d = self.config.head_dim
        return range(heads.start * d, heads.stop * d)

    @property
    def q_rows(self) -> range:
        return self._rows(self.q_heads)

    @property
    def kv_rows(self) -> range:
        return self._rows(self.kv_heads)

    @property
    def mlp_rows(self) -> range:
        n = self.config.intermediate_size // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def vocab_per_rank(self) -> int:
        """Rows of each rank's embedding and LM head: the vocabulary padded to a multiple of ``size``."""
        return cdiv(self.config.vocab_size, self.size)

    @property
    def vocab_rows(self) -> range:
        """The vocabulary ids this rank holds (the last rank's may fall short of ``vocab_per_rank``)."""
        n, v = self.vocab_per_rank, self.config.vocab_size
        return range(min(self.rank * n, v), min((self.rank + 1) * n, v))

    def local_config(self) -> "ModelConfig":
        """The config of this rank's shard: its query and KV heads and MLP width (vocabulary, width
        and layers as the whole model's). The runtime sizes the KV cache and attention by it."""
        cfg = self.config
        return replace(cfg, n_heads=len(self.q_heads), n_kv_heads=len(self.kv_heads),
                       intermediate_size=len(self.mlp_rows), head_dim=cfg.head_dim)

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole model's parameter ``name`` (native names, ``full`` its whole
        tensor): what the rank's ``Transformer`` holds under the same name."""
        cfg = self.config
        q, kv, inter = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
        if name.endswith("attention.wqkv.weight") or name.endswith("attention.wqkv.bias"):
            wq, wk, wv = full.split([q, kv, kv])
            return torch.cat([_take(wq, self.q_rows), _take(wk, self.kv_rows), _take(wv, self.kv_rows)])
        if name.endswith("attention.wo.weight"):
            return _take(full, self.q_rows, dim=1)
        if name.endswith("feed_forward.w13.weight"):
            gate, up = full.split([inter, inter])
            return torch.cat([_take(gate, self.mlp_rows), _take(up, self.mlp_rows)])
        if name.endswith("feed_forward.w2.weight"):
            return _take(full, self.mlp_rows, dim=1)
        if name in ("tok_embeddings.weight", "output.weight"):
            rows = _take(full, self.vocab_rows)
            pad = self.vocab_per_rank - rows.shape[0]
            return torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])]) if pad else rows
        return full


def _take(t: torch.Tensor, rows: range, dim: int = 0) -> torch.Tensor:
    return t.narrow(dim, rows.start, len(rows))


class ColumnParallelLinear(nn.Linear):
    """A linear over this rank's slice of the output features (``[out_local, in]`` weight); its
    output stays split over the ranks (the next row-parallel layer consumes it as it is)."""


class RowParallelLinear(nn.Linear):
    """A linear over this rank's slice of the input features (``[out, in_local]`` weight), summed
    over the ranks: ``x: [T, in_local]`` -> ``[T, out]``, the same on every rank. No bias (a bias
    would be added once per rank)."""

    def __init__(self, in_local: int, out_features: int, tp: TensorParallel):
        super().__init__(in_local, out_features, bias=False)
        self.group_name = tp.group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(F.linear(x, self.weight), self.group_name)


class VocabParallelEmbedding(nn.Embedding):
    """The rows ``[vocab_start, vocab_start + vocab_per_rank)`` of the embedding; an id outside them
    looks up zeros here and its row on the rank that holds it, and the all-reduce sums the ranks.
    ``ids: [T] int64`` -> ``[T, dim]``."""

    def __init__(self, layout: ShardLayout, tp: TensorParallel):
        super().__init__(layout.vocab_per_rank, layout.config.dim)
        self.vocab_start = layout.vocab_rows.start
        self.group_name = tp.group_name

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(local * inside, self.weight)  # an outside id reads row 0, then zeroed
        return all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype), self.group_name)


class ParallelLMHead(nn.Linear):
    """The LM head over this rank's vocabulary rows (``[vocab_per_rank, dim]``, tied or not to the
    embedding's shard); the logits of all ranks are gathered and the padding columns dropped:
    ``h: [B, dim]`` -> ``[B, vocab_size]``, the same on every rank (so every rank samples alike)."""

    def __init__(self, layout: ShardLayout, tp: TensorParallel):
        super().__init__(layout.config.dim, layout.vocab_per_rank, bias=False)
        self.vocab_size = layout.config.vocab_size
        self.size, self.group_name = tp.size, tp.group_name

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = all_gather_columns(F.linear(h, self.weight), self.size, self.group_name)
        return logits[:, : self.vocab_size]


# -- what the model builds: plain layers without tensor parallelism --------------------------------------
def column_linear(in_features: int, out_local: int, bias: bool, tp: TensorParallel | None) -> nn.Linear:
    cls = nn.Linear if tp is None else ColumnParallelLinear
    return cls(in_features, out_local, bias=bias)


def row_linear(in_local: int, out_features: int, tp: TensorParallel | None) -> nn.Linear:
    if tp is None:
        return nn.Linear(in_local, out_features, bias=False)
    return RowParallelLinear(in_local, out_features, tp)


def embedding(cfg: "ModelConfig", tp: TensorParallel | None) -> nn.Embedding:
    """``cfg``: the whole model's config."""
    if tp is None:
        return nn.Embedding(cfg.vocab_size, cfg.dim)
    return VocabParallelEmbedding(ShardLayout(cfg, tp.rank, tp.size), tp)


def lm_head(cfg: "ModelConfig", tp: TensorParallel | None) -> nn.Linear:
    """``cfg``: the whole model's config."""
    if tp is None:
        return nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
    return ParallelLMHead(ShardLayout(cfg, tp.rank, tp.size), tp)
