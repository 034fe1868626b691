"""The two packaged programs and their export: thin modules that set a forward context over their
own inputs, example inputs, and dynamic shapes within the declared bounds.

``prefill`` runs one extend or mixed step: flat token rows, then per cache group the page table,
seq lens, qo_indptr and write locations the host planned (``AttentionRouter.init_forward_metadata``,
the one extend planner), ``completes``, the sampling rows and the KV caches. ``decode`` runs one
decode step from per-group block tables and seq lens, refreshing its metadata inside the program
(``tscompile::refresh_decode_metadata``). Both write the caches they are given in place and
return one sampled token per request.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Sequence

import torch
from torch import nn

from tscompile.attention import leaf_class
from tscompile.attention.base import AttentionMetadata
from tscompile.forward_context import ForwardContext, ForwardMode, forward_context
from tscompile.models import Transformer

logger = logging.getLogger("tscompile")
PROGRAMS = ("prefill", "decode")
_MAX_PAGES_DIM = 2**31 - 1


class _ProgramAttention:
    """The ``ctx.attention`` of an exported step: attention over the program's explicit inputs
    (metadata and write locations, one entry per cache group), never over hidden state."""

    def __init__(self, layer_group: dict[int, int], metas: list[AttentionMetadata], write_locs: list[torch.Tensor],
                 k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], impl: str):
        self.layer_group, self.metas, self.write_locs = layer_group, metas, write_locs
        self.k_caches, self.v_caches, self.impl = k_caches, v_caches, impl

    def forward(self, layer_id: int, forward_mode: ForwardMode, q, k, v, k_cache, v_cache, out, scale: float) -> None:
        # the model's own cache buffers are unbound here: the program's cache inputs are the caches
        g = self.layer_group[layer_id]
        m = self.metas[g]
        torch.ops.tscompile.attention(q, k, v, self.k_caches[layer_id], self.v_caches[layer_id], out, m.page_table,
                                      m.seq_lens, m.qo_indptr, self.write_locs[g], scale, m.decode, self.impl)


class _StepProgram(nn.Module):
    def __init__(self, model: Transformer, *, page_size: int, pages_per_block: int, max_pages: int, backend: str):
        super().__init__()
        self.model = model
        self.specs = model.cache_groups()
        self.layer_group = {lid: g for g, s in enumerate(self.specs) for lid in s.layer_ids}
        self.page_size, self.pages_per_block, self.max_pages = page_size, pages_per_block, max_pages
        leaf = leaf_class(backend)
        self.attn_impl, self.refresh_impl = leaf.impl, leaf.refresh_impl

    def _run(self, mode, input_ids, positions, metas, write_locs, completes, sampling, k_caches, v_caches):
        attention = _ProgramAttention(self.layer_group, metas, write_locs, k_caches, v_caches, self.attn_impl)
        # the rows sampled: each request's last row among the last layer's group's rows
        logits_rows = metas[self.layer_group[max(self.layer_group)]].qo_indptr[1:].long() - 1
        qo_indptr = None if mode.is_decode else metas[0].qo_indptr
        with forward_context(ForwardContext(mode, attention, logits_rows, qo_indptr, completes)):
            logits = self.model(input_ids, positions)
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        torch.ops.tscompile.sample(logits, *sampling, tokens)
        return tokens


class PrefillProgram(_StepProgram):
    """One extend or mixed step over host-planned metadata (``[g]`` lists hold one entry per group)."""

    def forward(self, input_ids, positions, page_tables, seq_lens, qo_indptrs, write_locs, completes,
                temperature, top_k, top_p, seeds, steps, banned, k_caches, v_caches):
        metas = [AttentionMetadata(p, s, q, False) for p, s, q in zip(page_tables, seq_lens, qo_indptrs)]
        return self._run(ForwardMode.EXTEND, input_ids, positions, metas, list(write_locs), completes,
                         (temperature, top_k, top_p, seeds, steps, banned), k_caches, v_caches)


class DecodeProgram(_StepProgram):
    """One decode step; the decode metadata is refreshed inside the program from block tables."""

    def forward(self, input_ids, positions, block_tables, seq_lens, temperature, top_k, top_p, seeds, steps,
                banned, k_caches, v_caches):
        bs, dev = input_ids.shape[0], input_ids.device
        qo_indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev)
        metas, write_locs = [], []
        for table, lens in zip(block_tables, seq_lens):
            page_table = torch.zeros(bs, self.max_pages, dtype=torch.int32, device=dev)
            lens_out = torch.zeros(bs, dtype=torch.int32, device=dev)
            write_loc = torch.zeros(bs, dtype=torch.int64, device=dev)
            torch.ops.tscompile.refresh_decode_metadata(table, lens, page_table, lens_out, write_loc,
                                                        self.pages_per_block, self.page_size, self.refresh_impl)
            metas.append(AttentionMetadata(page_table, lens_out, qo_indptr, True))
            write_locs.append(write_loc)
        return self._run(ForwardMode.DECODE, input_ids, positions, metas, write_locs, None,
                         (temperature, top_k, top_p, seeds, steps, banned), k_caches, v_caches)





def _top(hi: int, floor: int) -> int:
    """The declared top of a dynamic dimension whose real bound is ``hi``. Export and Inductor treat a
    backed size as at least 2 (a size of 1 still runs: the programs never branch on it), so a range
    topping out at 2 would collapse to the constant 2; the top is raised to ``floor`` (and the example
    sizes get room), while the runtime keeps the real bound."""
    return hi if hi <= 1 else max(hi, floor)


def _dim(name: str, lo: int, hi: int):
    return None if hi <= lo else torch.export.Dim(name, min=lo, max=hi)


def _pick(lo: int, hi: int, taken: set[int], prefer: Sequence[int], avoid: frozenset[int] = frozenset(),
          also: int = 0) -> int:
    """An example size inside [lo, hi] that no other dynamic example size equals (export's duck sizing
    would tie the two dimensions together), nor 0/1, nor where possible a static size; ``also`` = 1
    keeps ``v + 1`` (a derived size, like qo_indptr's) apart too. A fixed size (lo == hi) is static."""
    if lo == hi:
        return lo
    candidates = list(itertools.chain(prefer, range(lo, min(hi, lo + 64) + 1)))
    for blocked in (taken | avoid | {0, 1}, taken | {0, 1}):
        for v in candidates:
            if lo <= v <= hi and v not in blocked and v + also not in blocked:
                taken.update({v, v + also})
                return v
    raise ValueError(f"tscompile: no example size in [{lo}, {hi}] apart from {sorted(taken)}; widen the bounds")


def _sampling_inputs(n: int, banned_width: int, device) -> list[torch.Tensor]:
    return [torch.zeros(n, device=device), torch.ones(n, dtype=torch.int32, device=device),
            torch.ones(n, device=device), torch.zeros(n, dtype=torch.int64, device=device),
            torch.zeros(n, dtype=torch.int64, device=device),
            torch.full((n, banned_width), -1, dtype=torch.int64, device=device)]


def _example_programs(model: Transformer, record: dict, device: torch.device, dtype: torch.dtype):
    """(module, example args, dynamic shapes) per program. Examples use the null page only, and every
    example is its own tensor: export treats one tensor passed twice as one input."""
    cfg, b = model.config, record["bounds"]
    specs = model.cache_groups()
    page_size, ppb = record["page_size"], record["pages_per_block"]
    max_pages, max_blocks = record["max_pages"], record["max_blocks"]
    banned_width = record["banned_width"]
    static = frozenset({max_pages, max_blocks, page_size, cfg.n_kv_heads, cfg.head_dim, banned_width})
    taken: set[int] = set()
    nb, nt = _top(b["max_num_seqs"], 3), _top(b["max_num_batched_tokens"], 8)
    bs = _pick(1, nb, taken, [3, 2], static, also=1)
    tokens = _pick(max(2, bs), nt, taken, [11, 13, 17], static)  # a prefill step has a row per request
    rows = [_pick(1, nt, taken, [7, 5, 9], static) if s.narrowed else tokens for s in specs]
    pages = [_pick(2, _MAX_PAGES_DIM, taken, [41, 43, 47], static) for _ in specs]
    batch_d, token_d = _dim("batch", 1, nb), _dim("tokens", 1, nt)
    row_d = [_dim(f"rows_{g}", 1, nt) if s.narrowed else token_d for g, s in enumerate(specs)]
    page_d = [_dim(f"pages_{g}", 2, _MAX_PAGES_DIM) for g in range(len(specs))]
    kw = dict(device=device)

    def caches():
        shape = lambda g: (pages[g], page_size, cfg.n_kv_heads, cfg.head_dim)  # noqa: E731
        group = {lid: g for g, s in enumerate(specs) for lid in s.layer_ids}
        return [[torch.zeros(shape(group[lid]), dtype=dtype, **kw) for lid in range(cfg.n_layers)] for _ in "kv"]

    group_of = {lid: g for g, s in enumerate(specs) for lid in s.layer_ids}
    cache_ds = [[{0: page_d[group_of[lid]]} for lid in range(cfg.n_layers)] for _ in "kv"]
    sampling_ds = [{0: batch_d}] * 6
    q_lens = [tokens - bs + 1] + [1] * (bs - 1)
    qo = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    G = len(specs)
    prefill_args = (
        torch.zeros(tokens, dtype=torch.int64, **kw), torch.arange(tokens, **kw),
        [torch.zeros(bs, max_pages, dtype=torch.int32, **kw) for _ in specs],
        [torch.tensor(q_lens, dtype=torch.int32, **kw) for _ in specs], [qo.to(device).clone() for _ in specs],
        [torch.zeros(r, dtype=torch.int64, **kw) for r in rows], torch.ones(bs, dtype=torch.bool, **kw),
        *_sampling_inputs(bs, banned_width, device), *caches(),
    )
    prefill_ds = ({0: token_d}, {0: token_d}, [{0: batch_d}] * G, [{0: batch_d}] * G,
                  [{0: batch_d + 1 if batch_d is not None else None}] * G, [{0: d} for d in row_d], {0: batch_d},
                  *sampling_ds, *cache_ds)
    decode_args = (
        torch.zeros(bs, dtype=torch.int64, **kw), torch.arange(bs, **kw),
        [torch.zeros(bs, max_blocks, dtype=torch.int32, **kw) for _ in specs],
        [torch.ones(bs, dtype=torch.int32, **kw) for _ in specs], *_sampling_inputs(bs, banned_width, device),
        *caches(),
    )
    decode_ds = ({0: batch_d}, {0: batch_d}, [{0: batch_d}] * G, [{0: batch_d}] * G, *sampling_ds, *cache_ds)
    common = dict(page_size=page_size, pages_per_block=ppb, max_pages=max_pages, backend=record["attention_backend"])
    return {"prefill": (PrefillProgram(model, **common), prefill_args, prefill_ds),
            "decode": (DecodeProgram(model, **common), decode_args, decode_ds)}


def export_programs(model: Transformer, record: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """``{name: (ExportedProgram, example args)}`` for the two steps, each export logged at INFO as it
    starts and with its seconds when it ends."""
    out = {}
    with torch.no_grad():
        for name, (module, args, ds) in _example_programs(model, record, device, dtype).items():
            logger.info("tscompile export: exporting the %s program (torch.export) ...", name)
            start = time.perf_counter()
            ep = torch.export.export(module.eval(), args, dynamic_shapes=ds, strict=False)
            logger.info("tscompile export: exporting the %s program (torch.export) done in %.1f s", name,
                        time.perf_counter() - start)
            out[name] = (ep, args)
    return out


def program_ops(ep) -> list[str]:
    """The ``tscompile::`` ops an exported program calls (also under a functionalization wrapper)."""
    names = set()
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        for target in (node.target, *(a for a in node.args[:1] if callable(a))):
            if isinstance(target, torch._ops.OpOverload) and target.namespace == "tscompile":
                names.add(target._schema.name)
    return sorted(names)

