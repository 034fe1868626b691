"""Model packages: ``tscompile export`` writes one ``.pt2``; ``tscompile.load_package`` runs it.

A package holds two AOTInductor programs built with ``torch.export`` from one model:

* ``prefill`` runs one extend or mixed step. Its inputs are the flat token rows, then per cache
  group the page table, seq lens, qo_indptr and write locations that the host planned
  (``CacheGroupRouter.init_forward_metadata``, the one extend planner), ``completes``, the sampling
  rows and the KV caches.
* ``decode`` runs one decode step. It takes per cache group the block tables and seq lens and runs
  ``tscompile::refresh_decode_metadata`` itself, then the model and the sampler.

Both write the KV caches they are given in place (the runtime owns them) and return one sampled
token per request. The custom ops stay in the graphs: AOTInductor calls them through its proxy
executor, so importing tscompile (which registers them) is what a loaded package needs. Batch and
token dimensions are dynamic within the bounds declared at export; a record of the model config,
versions, device, dtype, page size, bounds and attention backend rides along as ``tscompile.json``.

``--weights inside`` stores every weight once in the archive, shared by both programs;
``--weights external`` writes them beside the package (``<name>.safetensors``) and the loaded
programs borrow the tensors read from it (``user_managed`` constants), so no second copy exists.
"""

from __future__ import annotations

import itertools
import json
import os
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from tscompile.attention import create_attention_backend, leaf_class
from tscompile.attention.base import AttentionMetadata, ForwardMode
from tscompile.attention.router import CacheGroupRouter
from tscompile.kv_cache.pool import KVCachePool
from tscompile.kv_cache.spec import CacheGroupSpec
from tscompile.models import ModelConfig, Transformer, build_model
from tscompile.runtime.engine import LLM, resolve_dtype
from tscompile.runtime.forward_context import ForwardContext, forward_context
from tscompile.runtime.scheduler import ScheduledBatch, Scheduler
from tscompile.sampling import SamplingBuffers, SamplingParams

FORMAT_VERSION = 1
METADATA_FILE = "tscompile.json"
PROGRAMS = ("prefill", "decode")
_MAX_PAGES_DIM = 2**31 - 1


# ---------------------------------------------------------------------------------------------
# The programs: a thin module per step that sets a forward context over its own inputs.


class _ProgramBackend:
    """The ``ctx.backend`` of an exported step: metadata, write locations and attention over the
    program's explicit inputs (one entry per cache group), never over hidden state."""

    def __init__(self, layer_group: dict[int, int], metas: list[AttentionMetadata], write_locs: list[torch.Tensor],
                 k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], impl: str):
        self.layer_group, self.metas, self.write_locs = layer_group, metas, write_locs
        self.k_caches, self.v_caches, self.impl = k_caches, v_caches, impl

    def metadata(self, layer_id: int, forward_mode: ForwardMode) -> AttentionMetadata:
        return self.metas[self.layer_group[layer_id]]

    def write_locations(self, layer_id: int, forward_mode: ForwardMode) -> torch.Tensor:
        return self.write_locs[self.layer_group[layer_id]]

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
        shim = _ProgramBackend(self.layer_group, metas, write_locs, k_caches, v_caches, self.attn_impl)
        with forward_context(ForwardContext(mode, shim, completes)):
            logits = self.model(input_ids, positions)
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        torch.ops.tscompile.sample(logits, *sampling, tokens)
        return tokens


class PrefillProgram(_StepProgram):
    """One extend or mixed step over host-planned metadata (``[g]`` lists hold one entry per group)."""

    def forward(self, input_ids, positions, page_tables, seq_lens, qo_indptrs, write_locs, completes,
                temperature, top_k, top_p, seeds, steps, k_caches, v_caches):
        metas = [AttentionMetadata(p, s, q, False) for p, s, q in zip(page_tables, seq_lens, qo_indptrs)]
        return self._run(ForwardMode.EXTEND, input_ids, positions, metas, list(write_locs), completes,
                         (temperature, top_k, top_p, seeds, steps), k_caches, v_caches)


class DecodeProgram(_StepProgram):
    """One decode step; the decode metadata is refreshed inside the program from block tables."""

    def forward(self, input_ids, positions, block_tables, seq_lens, temperature, top_k, top_p, seeds, steps,
                k_caches, v_caches):
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
                         (temperature, top_k, top_p, seeds, steps), k_caches, v_caches)


# ---------------------------------------------------------------------------------------------
# Export: example inputs, dynamic shapes, AOTInductor, one archive.


def _dim(name: str, lo: int, hi: int):
    return None if hi <= lo else torch.export.Dim(name, min=lo, max=hi)


def _pick(lo: int, hi: int, taken: set[int], prefer: Sequence[int]) -> int:
    """An example size inside [lo, hi] that no other example size (or static size) equals, so export's
    duck sizing never ties two independent dimensions together."""
    for v in itertools.chain(prefer, range(lo, hi + 1)):
        if lo <= v <= hi and v not in taken:
            taken.add(v)
            return v
    raise ValueError(f"tscompile: no free example size in [{lo}, {hi}]")


def _sampling_inputs(n: int, device) -> list[torch.Tensor]:
    return [torch.zeros(n, device=device), torch.ones(n, dtype=torch.int32, device=device),
            torch.ones(n, device=device), torch.zeros(n, dtype=torch.int64, device=device),
            torch.zeros(n, dtype=torch.int64, device=device)]


def _example_programs(model: Transformer, record: dict, device: torch.device, dtype: torch.dtype):
    """(module, example args, dynamic shapes) per program. Examples use the null page only, and every
    example is its own tensor: export treats one tensor passed twice as one input."""
    cfg, b = model.config, record["bounds"]
    specs = model.cache_groups()
    page_size, ppb = record["page_size"], record["pages_per_block"]
    max_pages, max_blocks = record["max_pages"], record["max_blocks"]
    taken = {max_pages, max_blocks, page_size, cfg.n_kv_heads, cfg.head_dim, 0, 1}
    nb, nt = b["max_num_seqs"], b["max_num_batched_tokens"]
    bs = _pick(1, nb, taken, [3, 2])
    tokens = _pick(bs, nt, taken, [11, 13, 17])
    rows = [_pick(1, nt, taken, [7, 5, 9]) if s.narrowed else tokens for s in specs]
    pages = [_pick(2, _MAX_PAGES_DIM, taken, [41, 43, 47]) for _ in specs]
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
    sampling_ds = [{0: batch_d}] * 5
    q_lens = [tokens - bs + 1] + [1] * (bs - 1)
    qo = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    G = len(specs)
    prefill_args = (
        torch.zeros(tokens, dtype=torch.int64, **kw), torch.arange(tokens, **kw),
        [torch.zeros(bs, max_pages, dtype=torch.int32, **kw) for _ in specs],
        [torch.tensor(q_lens, dtype=torch.int32, **kw) for _ in specs], [qo.to(device).clone() for _ in specs],
        [torch.zeros(r, dtype=torch.int64, **kw) for r in rows], torch.ones(bs, dtype=torch.bool, **kw),
        *_sampling_inputs(bs, device), *caches(),
    )
    prefill_ds = ({0: token_d}, {0: token_d}, [{0: batch_d}] * G, [{0: batch_d}] * G,
                  [{0: batch_d + 1 if batch_d is not None else None}] * G, [{0: d} for d in row_d], {0: batch_d},
                  *sampling_ds, *cache_ds)
    decode_args = (
        torch.zeros(bs, dtype=torch.int64, **kw), torch.arange(bs, **kw),
        [torch.zeros(bs, max_blocks, dtype=torch.int32, **kw) for _ in specs],
        [torch.ones(bs, dtype=torch.int32, **kw) for _ in specs], *_sampling_inputs(bs, device), *caches(),
    )
    decode_ds = ({0: batch_d}, {0: batch_d}, [{0: batch_d}] * G, [{0: batch_d}] * G, *sampling_ds, *cache_ds)
    common = dict(page_size=page_size, pages_per_block=ppb, max_pages=max_pages, backend=record["attention_backend"])
    return {"prefill": (PrefillProgram(model, **common), prefill_args, prefill_ds),
            "decode": (DecodeProgram(model, **common), decode_args, decode_ds)}


def export_programs(model: Transformer, record: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """``{name: (ExportedProgram, example args)}`` for the two steps."""
    out = {}
    with torch.no_grad():
        for name, (module, args, ds) in _example_programs(model, record, device, dtype).items():
            ep = torch.export.export(module.eval(), args, dynamic_shapes=ds, strict=False)
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


def _aoti_compile(ep, args, options: dict) -> list:
    try:
        gm = ep.module(check_guards=False)
    except TypeError:  # older torch: no guards module to skip
        gm = ep.module()
    return torch._inductor.aot_compile(gm, args, {}, options={**options, "aot_inductor.package": True})


def _weights_path(package: str | os.PathLike) -> Path:
    return Path(package).with_suffix(".safetensors")


def _unique_weights(model: Transformer) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's parameters and buffers (KV cache buffers excepted), one entry per storage; tied
    tensors become aliases of the first name, since safetensors refuses shared storage."""
    tensors, aliases, seen = {}, {}, {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name.endswith(("k_cache", "v_cache")):
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = t.detach().contiguous()
    return tensors, aliases


def export_package(
    model: str | ModelConfig = "llama-tiny",
    out: str | os.PathLike = "model.pt2",
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    max_num_seqs: int = 8,
    max_model_len: int = 512,
    page_size: int = 16,
    pages_per_block: int = 1,
    max_num_batched_tokens: int | None = None,
    attention_backend: str = "auto",
    weights: str = "inside",
    seed: int = 0,
    inductor_configs: dict | None = None,
) -> dict:
    """Export the prefill and decode steps of a preset (or config) and package both into ``out``.

    Returns the metadata record written into the package."""
    from tscompile import __version__
    from tscompile.attention import default_backend_name

    if weights not in ("inside", "external"):
        raise ValueError(f"tscompile: --weights must be 'inside' or 'external', got {weights!r}")
    if not os.fspath(out).endswith(".pt2"):
        raise ValueError(f"tscompile: a package path must end in .pt2, got {os.fspath(out)!r}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("tscompile: --device cuda asked for, but CUDA is not available here")
    dtype = resolve_dtype(dtype, device)
    built = build_model(model, dtype=dtype, device=device, seed=seed)
    cfg = built.config
    if max_model_len > cfg.max_position:
        raise ValueError(f"tscompile: max_model_len {max_model_len} exceeds the model's max_position {cfg.max_position}")
    if max_num_seqs < 1 or max_model_len < 1 or page_size < 1:
        raise ValueError(f"tscompile: bounds must be positive, got max_num_seqs {max_num_seqs}, "
                         f"max_model_len {max_model_len}, page_size {page_size}")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = min(2048, max_num_seqs * max_model_len)
    backend = default_backend_name(device) if attention_backend == "auto" else attention_backend
    leaf_class(backend)  # unknown or unimportable backends refuse here, before any work
    block_size = page_size * pages_per_block
    record = {
        "format": FORMAT_VERSION, "tscompile_version": __version__, "torch_version": torch.__version__,
        "device": device.type, "dtype": str(dtype).removeprefix("torch."),
        "model": model if isinstance(model, str) else None, "config": cfg.to_dict(),
        "cache_groups": [dict(name=s.name, layer_ids=list(s.layer_ids), num_kv_heads=s.num_kv_heads,
                              head_dim=s.head_dim, window=s.window) for s in built.cache_groups()],
        "page_size": page_size, "pages_per_block": pages_per_block,
        "max_pages": -(-max_model_len // page_size), "max_blocks": -(-max_model_len // block_size),
        "bounds": {"max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
                   "max_num_batched_tokens": max_num_batched_tokens},
        "attention_backend": backend, "weights": weights, "programs": list(PROGRAMS), "seed": seed,
    }
    tensors, aliases = _unique_weights(built)
    record["weight_aliases"] = aliases
    options = dict(inductor_configs or {})
    options["aot_inductor.package_constants_in_so"] = False
    if weights == "inside":
        options["aot_inductor.package_constants_on_disk_format"] = "pickle_weights"
    else:
        record["weights_file"] = _weights_path(out).name
    start = time.perf_counter()
    programs = export_programs(built, record, device, dtype)
    record["ops"] = {name: program_ops(ep) for name, (ep, _) in programs.items()}
    files = {name: _aoti_compile(ep, args, options) for name, (ep, args) in programs.items()}
    record["build_seconds"] = round(time.perf_counter() - start, 1)
    from torch.export.pt2_archive._package import package_pt2

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    package_pt2(os.fspath(out), aoti_files=files, extra_files={METADATA_FILE: json.dumps(record, indent=1)})
    if weights == "external":
        from safetensors.torch import save_file

        save_file({k: v.cpu() for k, v in tensors.items()}, os.fspath(_weights_path(out)),
                  metadata={"tscompile_package": Path(out).name})
    return record


# ---------------------------------------------------------------------------------------------
# Loading: metadata first (no program is touched before every check passed), then the programs.


def read_package_metadata(path: str | os.PathLike) -> dict:
    """The package's ``tscompile.json`` record, read without loading any program."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"tscompile: no package at {path!r}")
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.endswith(f"extra/{METADATA_FILE}")]
            if not names:
                raise ValueError(f"tscompile: {path!r} is not a tscompile package (no extra/{METADATA_FILE})")
            return json.loads(zf.read(names[0]))
    except zipfile.BadZipFile:
        raise ValueError(f"tscompile: {path!r} is not a .pt2 package (not a zip archive)") from None


def _release(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def check_compatible(record: dict, device: torch.device) -> None:
    """Refuse (``ValueError('tscompile: ...')``) a package this process cannot run: another format,
    another tscompile or torch release (major.minor; the programs link this torch's runtime and call
    this tscompile's ops), or another device type."""
    import tscompile

    if record.get("format") != FORMAT_VERSION:
        raise ValueError(f"tscompile: package format {record.get('format')} is not supported "
                         f"(this tscompile reads format {FORMAT_VERSION}); re-export the model")
    built, here = record["tscompile_version"], tscompile.__version__
    if _release(built) != _release(here):
        raise ValueError(f"tscompile: package was built with tscompile {built}, this is tscompile {here} "
                         f"(releases {'.'.join(map(str, _release(built)))} and "
                         f"{'.'.join(map(str, _release(here)))} are incompatible); re-export the model")
    built, here = record["torch_version"], torch.__version__
    if _release(built) != _release(here):
        raise ValueError(f"tscompile: package was built with torch {built}, this is torch {here} "
                         f"(AOTInductor programs need the same major.minor release); re-export the model")
    if device.type != record["device"]:
        raise ValueError(f"tscompile: package was built for device {record['device']!r}, cannot load it on "
                         f"{device.type!r}; export it again with --device {device.type}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("tscompile: package was built for device 'cuda', but CUDA is not available here")


def _bounded(name: str, value: int | None, limit: int) -> int:
    if value is None:
        return limit
    if not 1 <= value <= limit:
        raise ValueError(f"tscompile: {name} {value} is outside the package's bound [1, {limit}]")
    return value


class _PackageRunner:
    """Turns a scheduled batch into one call of a packaged program (the ModelRunner's twin).

    Extend and mixed metadata come from the router's host planner; decode metadata is refreshed
    inside the decode program from the block tables and seq lens handed to it."""

    compile_seconds = 0.0  # the programs were compiled at export; nothing compiles or captures here
    capture_seconds = 0.0

    def __init__(self, programs: dict, backend: CacheGroupRouter, pool: KVCachePool, n_layers: int, *,
                 max_num_seqs: int, device: torch.device):
        self.programs, self.backend, self.device = programs, backend, device
        self.sampling = SamplingBuffers(max_num_seqs, device)
        self.k_caches = [pool.layer_cache(lid)[0] for lid in range(n_layers)]
        self.v_caches = [pool.layer_cache(lid)[1] for lid in range(n_layers)]

    def _to_device(self, values, dtype=torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _sampling_rows(self, batch: ScheduledBatch) -> list[torch.Tensor]:
        reqs = batch.requests
        n = len(reqs)
        self.sampling.fill([r.params for r in reqs], [r.seed for r in reqs],
                           [len(r.prompt) + len(r.output) for r in reqs], n)
        s = self.sampling
        return [s.temperature[:n], s.top_k[:n], s.top_p[:n], s.seeds[:n], s.steps[:n]]

    def _block_tables(self, sched: Scheduler, batch: ScheduledBatch) -> list[torch.Tensor]:
        slots = [r.slot for r in batch.requests]
        return [torch.from_numpy(t[slots]).to(self.device, non_blocking=True) for t in sched.block_tables]

    def execute(self, sched: Scheduler, batch: ScheduledBatch) -> list[int]:
        n = len(batch.requests)
        lens = sched.group_lens_after(batch)
        ids, pos = sched.input_rows(batch)
        ids, pos = self._to_device(ids, torch.int64), self._to_device(pos, torch.int64)
        tables = self._block_tables(sched, batch)
        if batch.mode is ForwardMode.DECODE:
            tokens = self.programs["decode"](ids, pos, tables, [self._to_device(g) for g in lens],
                                             *self._sampling_rows(batch), self.k_caches, self.v_caches)
            return tokens[:n].tolist()
        ext = torch.tensor([c for _, c in batch.extends], dtype=torch.int32)
        prefix = torch.tensor([r.num_computed for r, _ in batch.extends], dtype=torch.int32)
        seq_lens_cpu = torch.tensor(lens[0], dtype=torch.int32)
        self.backend.init_forward_metadata(
            forward_mode=batch.mode, req_pool_indices=self._to_device([r.slot for r in batch.requests], torch.int64),
            seq_lens=seq_lens_cpu.to(self.device), seq_lens_cpu=seq_lens_cpu,
            block_tables=dict(enumerate(tables)), num_extends=len(batch.extends),
            extend_seq_lens=ext.to(self.device), extend_seq_lens_cpu=ext,
            extend_prefix_lens=prefix.to(self.device), extend_prefix_lens_cpu=prefix,
            extend_with_prefix=bool((prefix > 0).any()),
            extend_prompt_lens_cpu=torch.tensor([len(r.prompt) for r, _ in batch.extends], dtype=torch.int32),
            group_seq_lens_cpu={g: torch.tensor(lens[g], dtype=torch.int32)
                                for g, s in enumerate(sched.specs) if s.narrowed},
        )
        metas = [leaf.metadata(batch.mode) for leaf in self.backend.leaves]
        completes = [r.num_computed + c == len(r.prompt) for r, c in batch.extends] + [False] * len(batch.decodes)
        tokens = self.programs["prefill"](
            ids, pos, [m.page_table for m in metas], [m.seq_lens for m in metas], [m.qo_indptr for m in metas],
            list(self.backend.extend_write_locations), self._to_device(completes, torch.bool),
            *self._sampling_rows(batch), self.k_caches, self.v_caches)
        return tokens[:n].tolist()


class PackagedLLM(LLM):
    """A loaded package: the packaged programs behind ``tscompile.LLM``'s ``generate``.

    It owns its paged KV cache (the programs' cache inputs) and its scheduler; ``record`` is the
    package's metadata, ``weights`` the constants the programs borrow (external weights only)."""

    def __init__(self, path: str | os.PathLike, record: dict, programs: dict, *, device: torch.device,
                 max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int, num_pages: int | None,
                 seed: int, weights: dict[str, torch.Tensor] | None, load_seconds: float):
        import itertools
        import random

        self.path, self.record, self.weights, self.load_seconds = os.fspath(path), record, weights, load_seconds
        self.package_bytes = os.path.getsize(path) + (
            os.path.getsize(_weights_path(path)) if record["weights"] == "external" else 0)
        self.device = device
        self.dtype = resolve_dtype(record["dtype"], device)
        self.config = ModelConfig.from_dict(record["config"])
        self.model = None  # the programs are the model
        self.max_model_len = max_model_len
        bounds = record["bounds"]
        specs = [CacheGroupSpec(g["name"], tuple(g["layer_ids"]), g["num_kv_heads"], g["head_dim"], g["window"])
                 for g in record["cache_groups"]]
        page_size, ppb = record["page_size"], record["pages_per_block"]
        # table widths are the packaged ones (the programs' static page-table and block-table widths)
        blocks_per_seq = -(-max_model_len // (page_size * ppb))
        if num_pages is None:
            num_pages = (max_num_seqs * blocks_per_seq + 1) * ppb
        self.backend = create_attention_backend(record["attention_backend"], specs,
                                                max_model_len=bounds["max_model_len"], page_size=page_size,
                                                device=device)
        self.pool = KVCachePool.allocate(specs, [num_pages] * len(specs), page_size=page_size,
                                         pages_per_block=ppb, dtype=self.dtype, device=device)
        self.backend.set_cache_pool(self.pool)
        self.scheduler = Scheduler(
            specs, [self.pool.num_blocks(g) for g in range(len(specs))], block_size=page_size * ppb,
            max_num_seqs=max_num_seqs, max_model_len=bounds["max_model_len"],
            max_num_batched_tokens=max_num_batched_tokens, vocab_size=self.config.vocab_size,
        )
        self.runner = _PackageRunner(programs, self.backend, self.pool, self.config.n_layers,
                                     max_num_seqs=max_num_seqs, device=device)
        self.enforce_eager, self.compile_config = True, None  # compiled ahead of time, nothing at run time
        self.graph_support = None
        self._ids = itertools.count()
        self._rng = random.Random(seed)

    def _check_request(self, prompt: Sequence[int], params: SamplingParams) -> None:
        total = len(prompt) + params.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(f"tscompile: prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) = {total} "
                             f"exceeds max_model_len {self.max_model_len} (package bound "
                             f"{self.record['bounds']['max_model_len']})")

    def add_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams):
        self._check_request(prompt_token_ids, sampling_params)
        return super().add_request(prompt_token_ids, sampling_params)

    def generate(self, prompt_token_ids: list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[list[int]]:
        params = sampling_params if isinstance(sampling_params, list) else \
            [sampling_params or SamplingParams()] * len(prompt_token_ids)
        for prompt, p in zip(prompt_token_ids, params):
            self._check_request(prompt, p)
        return super().generate(prompt_token_ids, sampling_params)


def _load_programs(path: str, record: dict, device: torch.device):
    """``({name: runner}, external weights or None)``; the runners share one copy of the weights."""
    from torch.export.pt2_archive._package import load_pt2

    index = device.index if device.index is not None else -1
    external = record["weights"] == "external"
    contents = load_pt2(path, device_index=index, load_weights_from_disk=not external)
    missing = [p for p in PROGRAMS if p not in contents.aoti_runners]
    if missing:
        raise ValueError(f"tscompile: package {path!r} lacks the programs {missing}")
    programs = {p: contents.aoti_runners[p] for p in PROGRAMS}
    if not external:
        return programs, None
    wpath = _weights_path(path)
    if not wpath.is_file():
        raise ValueError(f"tscompile: package {path!r} was exported with --weights external, but its weights "
                         f"file {os.fspath(wpath)!r} is missing")
    from safetensors.torch import load_file

    weights = load_file(os.fspath(wpath), device=str(device))
    for name, target in record.get("weight_aliases", {}).items():
        weights[name] = weights[target]
    for name, program in programs.items():
        wanted = program.get_constant_fqns()
        absent = [f for f in wanted if f.removeprefix("model.") not in weights]
        if absent:
            raise ValueError(f"tscompile: weights file {os.fspath(wpath)!r} lacks {absent[:3]} "
                             f"(program {name!r} needs {len(wanted)} tensors)")
        program.load_constants({f: weights[f.removeprefix("model.")] for f in wanted}, check_full_update=True,
                               user_managed=True)
    return programs, weights


def load_package(path: str | os.PathLike, device: str | torch.device | None = None, *,
                 max_num_seqs: int | None = None, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, num_pages: int | None = None,
                 seed: int = 0) -> PackagedLLM:
    """Load a package written by ``tscompile export``; returns an object with ``LLM.generate``.

    ``device`` defaults to the package's device; the runtime limits default to the packaged bounds
    and may only be lowered. Every refusal is a ``ValueError('tscompile: ...')`` raised before any
    program is loaded."""
    start = time.perf_counter()
    record = read_package_metadata(path)
    device = torch.device(device if device is not None else record["device"])
    check_compatible(record, device)
    bounds = record["bounds"]
    max_num_seqs = _bounded("max_num_seqs", max_num_seqs, bounds["max_num_seqs"])
    max_model_len = _bounded("max_model_len", max_model_len, bounds["max_model_len"])
    max_num_batched_tokens = _bounded("max_num_batched_tokens", max_num_batched_tokens,
                                      bounds["max_num_batched_tokens"])
    programs, weights = _load_programs(os.fspath(path), record, device)
    return PackagedLLM(path, record, programs, device=device, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                       max_num_batched_tokens=max_num_batched_tokens, num_pages=num_pages, seed=seed,
                       weights=weights, load_seconds=time.perf_counter() - start)
