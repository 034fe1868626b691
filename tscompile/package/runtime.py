"""Running a package: ``load_package`` builds a ``tscompile.LLM`` over a ``PackageRunner`` (the
packaged programs behind the engine's runner interface, with its own paged KV cache and scheduler)."""

from __future__ import annotations

import os
import time
import zipfile
from dataclasses import dataclass

import torch

from tscompile.attention import create_attention_router
from tscompile.attention.router import AttentionRouter
from tscompile.counters import counters
from tscompile.forward_context import ForwardMode
from tscompile.kv_cache.pool import KVCachePool
from tscompile.kv_cache.spec import CacheGroupSpec
from tscompile.models import ModelConfig
from tscompile.package.compiler_check import refuse_unlinked_cxx_runtime
from tscompile.package.decode_graphs import PackageDecodeGraphs, default_decode_ladder
from tscompile.package.lazy_dynamo import defer_dynamo_import
from tscompile.package.programs import PROGRAMS
from tscompile.package.record import TOKENIZER_PREFIX, check_compatible, read_package_metadata, weights_path
from tscompile.runtime.build import EngineParts, build_pool_and_scheduler
from tscompile.runtime.engine import LLM
from tscompile.runtime.graph_runner import GraphBackend, GraphRunner
from tscompile.runtime.readback import PendingTokens
from tscompile.sampling import SamplingBuffers, SamplingInputs
from tscompile.step_plan import StepPlan
from tscompile.utils import resolve_device, resolve_dtype, upload
from tscompile.validation import validate_package_args


def _bounded(name: str, value: int | None, limit: int) -> int:
    if value is None:
        return limit
    if not 1 <= value <= limit:
        raise ValueError(f"tscompile: {name} {value} is outside the package's bound [1, {limit}]")
    return value


def _check_cuda_graphs(cuda_graphs, device: torch.device) -> None:
    if not isinstance(cuda_graphs, bool):
        raise ValueError(f"tscompile: cuda_graphs={cuda_graphs!r} must be True or False")
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"tscompile: cuda_graphs=True needs a CUDA device; this package loads on "
                         f"{str(device)!r} (use cuda_graphs=False there)")


@dataclass
class PackageInfo:
    """What a loaded package's engine carries about it (``llm.package``)."""

    path: str
    record: dict
    weights: dict[str, torch.Tensor] | None  # the constants the programs borrow (external weights only)
    load_seconds: float
    package_bytes: int


class PackageRunner:
    """Turns a step plan into one call of a packaged program (the ``ModelRunner``'s twin).

    Extend and mixed metadata come from the router's host planner; decode metadata is refreshed
    inside the decode program from the plan's block tables and seq lens. The programs take host
    token ids, so no step chains onto the one before (``can_chain`` is False). With
    ``enable_decode_graphs`` a decode step of a ladder size runs padded, as a CUDA graph replay
    (``package/decode_graphs.py``); larger ones call the decode program as before."""

    compile_seconds = 0.0  # the programs were compiled at export; nothing compiles here

    def __init__(self, programs: dict, attention: AttentionRouter, pool: KVCachePool, n_layers: int, *,
                 max_num_seqs: int, max_blocks: int, banned_width: int, device: torch.device):
        self.programs, self.attention, self.device = programs, attention, device
        self.max_num_seqs, self.max_blocks, self.banned_width = max_num_seqs, max_blocks, banned_width
        self.sampling = SamplingBuffers(SamplingInputs.allocate(max_num_seqs, banned_width, device))
        self.k_caches = [pool.layer_cache(lid)[0] for lid in range(n_layers)]
        self.v_caches = [pool.layer_cache(lid)[1] for lid in range(n_layers)]
        self.launches = 0
        self.decode_graphs: PackageDecodeGraphs | None = None

    @property
    def capture_seconds(self) -> float:
        return self.decode_graphs.capture_seconds if self.decode_graphs is not None else 0.0

    @property
    def graphs(self) -> GraphRunner | None:
        """The ``GraphRunner`` of the decode graphs (its ``replay`` is the switch), or None."""
        return self.decode_graphs.graphs if self.decode_graphs is not None else None

    def enable_decode_graphs(self, ladder: tuple[int, ...] | None = None, *,
                             backend: GraphBackend | None = None) -> None:
        """Run decode steps of a ladder size padded, through CUDA graphs (``package/decode_graphs.py``);
        ``ladder`` defaults to the engine's decode ladder up to ``max_num_seqs``. ``backend``
        ``HostGraphs()`` runs the padded program over the same buffers without graphs (tests, any
        device)."""
        graphs = PackageDecodeGraphs(
            self.programs["decode"], default_decode_ladder(self.max_num_seqs) if ladder is None else ladder,
            max_num_seqs=self.max_num_seqs, num_groups=len(self.attention.specs),
            max_blocks=self.max_blocks, banned_width=self.banned_width, k_caches=self.k_caches,
            v_caches=self.v_caches, device=self.device, backend=backend)
        self.decode_graphs, self.sampling = graphs, graphs.sampling

    def can_chain(self, plan: StepPlan) -> bool:
        return False

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev_rows=None) -> PendingTokens:
        if prev_rows is not None or plan.tokens_on_device.size:
            raise RuntimeError("tscompile: a packaged program takes its token ids from the host")
        self.launches += 1
        return PendingTokens.ready(self.execute(plan))

    def execute(self, plan: StepPlan) -> list[int]:
        n = plan.num_requests
        if plan.mode is ForwardMode.DECODE and self.decode_graphs is not None:
            tokens = self.decode_graphs.run(plan)
            if tokens is not None:
                return tokens  # else above the ladder: the program runs directly, as without graphs
        self.sampling.fill(plan.sampling)
        sampling = self.sampling.inputs.rows(n)
        ids, pos = upload([plan.input_ids, plan.positions], self.device)
        if plan.mode is ForwardMode.DECODE:
            if self.decode_graphs is not None:
                counters["decode_eager"] += 1  # above the graphs' ladder
            dev = upload([a for g in plan.groups for a in (g.block_tables, g.seq_lens)], self.device)
            tokens = self.programs["decode"](ids, pos, dev[0::2], dev[1::2], *sampling, self.k_caches, self.v_caches)
            return tokens[:n].tolist()
        self.attention.init_forward_metadata(plan, {})
        metas = [leaf.metadata(plan.mode) for leaf in self.attention.leaves]
        completes, = upload([plan.completes], self.device)
        tokens = self.programs["prefill"](
            ids, pos, [m.page_table for m in metas], [m.seq_lens for m in metas], [m.qo_indptr for m in metas],
            list(self.attention.extend_write_locations), completes, *sampling, self.k_caches, self.v_caches)
        return tokens[:n].tolist()


def _package_engine(record: dict, programs: dict, *, device: torch.device, max_num_seqs: int,
                    max_model_len: int, max_num_batched_tokens: int, num_pages: int | None,
                    tokenizer=None) -> EngineParts:
    """The engine parts of a loaded package: its cache groups, a pool, a scheduler, its runner."""
    dtype = resolve_dtype(record["dtype"], device)
    config = ModelConfig.from_dict(record["config"])
    specs = [CacheGroupSpec(g["name"], tuple(g["layer_ids"]), g["num_kv_heads"], g["head_dim"], g["window"])
             for g in record["cache_groups"]]
    page_size, ppb = record["page_size"], record["pages_per_block"]
    # table widths are the packaged ones (the programs' static page-table and block-table widths)
    attention = create_attention_router(record["attention_backend"], specs,
                                        max_model_len=record["bounds"]["max_model_len"], page_size=page_size,
                                        pages_per_block=ppb, device=device)
    pool, scheduler = build_pool_and_scheduler(
        specs, attention, num_pages=num_pages, page_size=page_size, pages_per_block=ppb, dtype=dtype, device=device,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
        vocab_size=config.vocab_size, eos_token_ids=tuple(record["eos_token_ids"]), max_blocks=record["max_blocks"],
        limit_note=f" (package bound {record['bounds']['max_model_len']})")
    runner = PackageRunner(programs, attention, pool, config.n_layers, max_num_seqs=max_num_seqs,
                           max_blocks=record["max_blocks"], banned_width=scheduler.banned_width, device=device)
    return EngineParts(config, device, dtype, attention, pool, scheduler, runner, tokenizer=tokenizer)


def _package_tokenizer(path: str, record: dict):
    """The tokenizer a package carries (exported from a checkpoint), or None."""
    names = record.get("tokenizer_files") or []
    if not names:
        return None
    import tempfile

    from tscompile.text import load_tokenizer

    folder = tempfile.mkdtemp(prefix="tscompile_tokenizer_")
    with zipfile.ZipFile(path) as zf:
        members = {m.rsplit(f"extra/{TOKENIZER_PREFIX}", 1)[-1]: m for m in zf.namelist()
                   if f"extra/{TOKENIZER_PREFIX}" in m}
        for name in names:
            if name not in members:
                raise ValueError(f"tscompile: package {path!r} lacks its tokenizer file {name!r}")
            with open(os.path.join(folder, name), "wb") as f:
                f.write(zf.read(members[name]))
    return load_tokenizer(folder)


def _load_programs(path: str, record: dict, device: torch.device, single_threaded: tuple[str, ...] = ()):
    """``({name: program}, external weights or None)``; the programs share one copy of the weights.
    The programs named in ``single_threaded`` run without AOTInductor's completion events (what a
    CUDA graph capture needs)."""
    from tscompile.package.aoti_load import load_aoti_programs

    external = record["weights"] == "external"
    with zipfile.ZipFile(path) as zf:
        stored = {n.split("/", 1)[-1] for n in zf.namelist()}
    missing = [p for p in PROGRAMS if not any(n.startswith(f"data/aotinductor/{p}/") for n in stored)]
    if missing:
        raise ValueError(f"tscompile: package {path!r} lacks the programs {missing}")
    programs = load_aoti_programs(path, PROGRAMS, device, single_threaded=single_threaded)
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
                 seed: int = 0, verify: bool = False, cuda_graphs: bool = False) -> LLM:
    """Load a package written by ``tscompile export``; returns a ``tscompile.LLM`` over its programs
    (``llm.package`` says what was loaded).

    ``device`` defaults to the package's device; the runtime limits default to the packaged bounds
    and may only be lowered. Every refusal is a ``ValueError('tscompile: ...')`` raised before any
    program is loaded. The package's members are checked against their CRC-32 (external weights:
    header and size), and its shared libraries must link the C++ runtime they call (a package
    compiled elsewhere by a compiler that leaves ``libstdc++`` out crashes while loading);
    ``verify=True`` also checks the weights' bytes (slow for large models).

    ``cuda_graphs=True`` (CUDA only; on another device a ``ValueError``) replays the decode program
    as one CUDA graph per padded batch size of the engine's decode ladder up to ``max_num_seqs``,
    each captured on its first use; a batch above the ladder calls the program directly
    (``package/decode_graphs.py``)."""
    start = time.perf_counter()
    record = read_package_metadata(path, verify=verify)
    validate_package_args(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=max_num_batched_tokens, num_pages=num_pages, seed=seed,
                          pages_per_block=record["pages_per_block"])
    check_compatible(record, torch.device(device if device is not None else record["device"]))
    device = resolve_device(device if device is not None else record["device"])
    _check_cuda_graphs(cuda_graphs, device)
    bounds = record["bounds"]
    max_num_seqs = _bounded("max_num_seqs", max_num_seqs, bounds["max_num_seqs"])
    max_model_len = _bounded("max_model_len", max_model_len, bounds["max_model_len"])
    max_num_batched_tokens = _bounded("max_num_batched_tokens", max_num_batched_tokens,
                                      bounds["max_num_batched_tokens"])
    if record["weights"] == "external" and not weights_path(path).is_file():
        raise ValueError(f"tscompile: package {os.fspath(path)!r} was exported with --weights external, but its "
                         f"weights file {os.fspath(weights_path(path))!r} is missing")
    # a library built without its C++ runtime can crash the process inside dlopen: judge it first
    refuse_unlinked_cxx_runtime(path, record)
    programs, weights = _load_programs(os.fspath(path), record, device,
                                       single_threaded=("decode",) if cuda_graphs else ())
    defer_dynamo_import()  # the programs call tscompile's ops; nothing here needs Dynamo (lazy_dynamo.py)
    parts = _package_engine(record, programs, device=device, max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                            num_pages=num_pages, tokenizer=_package_tokenizer(os.fspath(path), record))
    if cuda_graphs:
        parts.runner.enable_decode_graphs()
    llm = LLM.from_parts(parts, seed=seed, async_scheduling=False)
    size = os.path.getsize(path) + (os.path.getsize(weights_path(path)) if record["weights"] == "external" else 0)
    llm.package = PackageInfo(os.fspath(path), record, weights, time.perf_counter() - start, size)
    return llm
