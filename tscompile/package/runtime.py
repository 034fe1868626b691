"""Running a package: ``load_package`` and ``PackagedLLM`` (``tscompile.LLM``'s ``generate`` over the
packaged programs, with its own paged KV cache and scheduler)."""

from __future__ import annotations

import itertools
import os
import random
import time
from typing import Sequence

import torch

from tscompile.attention import create_attention_backend
from tscompile.attention.base import ForwardMode
from tscompile.attention.router import CacheGroupRouter
from tscompile.kv_cache.pool import KVCachePool
from tscompile.kv_cache.spec import CacheGroupSpec
from tscompile.models import ModelConfig
from tscompile.package.programs import PROGRAMS
from tscompile.package.record import check_compatible, read_package_metadata, weights_path
from tscompile.runtime.engine import LLM
from tscompile.runtime.readback import PendingTokens
from tscompile.runtime.scheduler import ScheduledBatch, Scheduler
from tscompile.sampling import SamplingBuffers, SamplingParams
from tscompile.utils import cdiv, resolve_device, resolve_dtype


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
                           [len(r.prompt) + r.num_generated for r in reqs], n)
        s = self.sampling
        return [s.temperature[:n], s.top_k[:n], s.top_p[:n], s.seeds[:n], s.steps[:n]]

    def _block_tables(self, sched: Scheduler, batch: ScheduledBatch) -> list[torch.Tensor]:
        slots = [r.slot for r in batch.requests]
        return [torch.from_numpy(t[slots]).to(self.device, non_blocking=True) for t in sched.block_tables]

    launches = 0  # never chained: see can_chain

    def can_chain(self, batch: ScheduledBatch) -> bool:
        return False  # the programs take host token ids: every step waits for the one before

    @torch.inference_mode()
    def launch(self, sched: Scheduler, batch: ScheduledBatch, prev_rows=None) -> PendingTokens:
        if prev_rows is not None:
            raise RuntimeError("tscompile: a packaged program takes its token ids from the host")
        return PendingTokens.ready(self.execute(sched, batch))

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
        completes = sched.completes(batch) + [False] * len(batch.decodes)
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
        self.path, self.record, self.weights, self.load_seconds = os.fspath(path), record, weights, load_seconds
        self.package_bytes = os.path.getsize(path) + (
            os.path.getsize(weights_path(path)) if record["weights"] == "external" else 0)
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
        blocks_per_seq = cdiv(max_model_len, page_size * ppb)
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
        self.async_scheduling, self._inflight, self._ready = False, None, []

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
    wpath = weights_path(path)
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
    if record["weights"] == "external" and not weights_path(path).is_file():
        raise ValueError(f"tscompile: package {os.fspath(path)!r} was exported with --weights external, but its "
                         f"weights file {os.fspath(weights_path(path))!r} is missing")
    programs, weights = _load_programs(os.fspath(path), record, device)
    return PackagedLLM(path, record, programs, device=device, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                       max_num_batched_tokens=max_num_batched_tokens, num_pages=num_pages, seed=seed,
                       weights=weights, load_seconds=time.perf_counter() - start)
