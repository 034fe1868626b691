"""``tscompile bench``'s ``package`` mode: the bench model exported with ``tscompile export`` (or a
package given with ``--package``), loaded, and measured by the engine's own loops.

The packaged programs run without CUDA graphs (AOTInductor calls from the host), so the decode
rows beside ``tscompile-<backend>`` show what the graphs are worth; ``--package-cuda-graphs`` loads
the package with ``cuda_graphs=True`` (its decode program replayed as CUDA graphs) instead. The mode
also reports how long a loaded package takes to its first token: ``load_package`` plus one bs=1
greedy token.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch

from .workloads import EngineRunner

PACKAGE_MODE = "package"


def _check_matches(record: dict, path: str, cfg, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a ``--package`` of another model or dtype: its rows would sit beside the engine's
    and the float32 reference as if they measured the same thing."""
    if record["config"] != cfg.to_dict():
        raise ValueError(f"tscompile: --package {path!r} was exported from another model ({record.get('model')!r}, "
                         f"config {record['config']}) than --model's; export it from the bench model")
    want = str(dtype).removeprefix("torch.")
    if record["dtype"] != want:
        raise ValueError(f"tscompile: --package {path!r} holds {record['dtype']} programs, the bench runs --dtype "
                         f"{want}; pass --dtype {record['dtype']} or export it again")
    if record["device"] != device.type:
        raise ValueError(f"tscompile: --package {path!r} was built for {record['device']!r}, the bench runs on "
                         f"{device.type!r}")


class PackageRunner(EngineRunner):
    """A loaded package behind ``EngineRunner``'s loops (``run_batch``, ``run_prefill``).

    ``package`` None exports the bench model first (``export_s``) into a temporary folder removed by
    ``close``; a given path is checked against the bench's model, dtype and device, and its bounds
    against the bench's limits (``load_package`` refuses limits beyond them)."""

    def __init__(self, model_name, cfg, *, package: str | None, device: torch.device, dtype: torch.dtype,
                 max_num_seqs: int, max_model_len: int, page_size: int, max_num_batched_tokens: int,
                 seed: int, first_prompt: list[int], cuda_graphs: bool = False):
        import tscompile
        from tscompile.export import export_package, read_package_metadata

        self.device = torch.device(device)
        self._params = tscompile.SamplingParams
        self._folder = None
        self.export_s = None
        self.cuda_graphs = cuda_graphs
        limits = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      max_num_batched_tokens=max_num_batched_tokens)
        if package is None:
            self._folder = tempfile.TemporaryDirectory(prefix="tscompile_bench_package_")
            package = os.path.join(self._folder.name, "bench.pt2")
            t0 = time.perf_counter()
            # verified: a package that crashes while loading would take the whole bench with it
            export_package(model_name, package, device=self.device, dtype=dtype, page_size=page_size, seed=seed,
                           **limits)
            self.export_s = time.perf_counter() - t0
        record = read_package_metadata(package)
        _check_matches(record, package, cfg, dtype, self.device)
        # a given package's step budget is its own: a bigger batch's prompts are chunked to it, as a
        # server running that package would (the sequence and length limits still have to fit)
        limits["max_num_batched_tokens"] = min(max_num_batched_tokens, record["bounds"]["max_num_batched_tokens"])
        self.max_num_batched_tokens = limits["max_num_batched_tokens"]
        self.bench_max_num_batched_tokens = max_num_batched_tokens
        self.path, self.record = package, record
        # load to first token: what a serving process pays before it answers, with the programs'
        # first-call work (kernel modules, library handles) inside
        t0 = time.perf_counter()
        self.llm = tscompile.load_package(package, device=self.device, seed=seed, cuda_graphs=cuda_graphs, **limits)
        loaded = time.perf_counter()
        self.llm.generate([first_prompt], self._params(max_new_tokens=1, temperature=0.0))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.load_s, self.first_token_s = loaded - t0, time.perf_counter() - loaded

    def info(self) -> dict:
        """What the mode's entry in the result carries about the package."""
        pkg = self.llm.package
        return {"package_path": self.path if self._folder is None else None, "exported": self._folder is not None,
                "export_s": self.export_s, "load_s": self.load_s, "first_token_s": self.first_token_s,
                "load_to_first_token_s": self.load_s + self.first_token_s, "package_bytes": pkg.package_bytes,
                "package_weights": self.record["weights"], "attention_backend": self.record["attention_backend"],
                "compiler": self.record.get("compiler"), "bounds": self.record["bounds"],
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "bench_max_num_batched_tokens": self.bench_max_num_batched_tokens,
                "cuda_graphs": self.cuda_graphs}

    def close(self) -> None:
        self.llm = None
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None


def markdown_section(modes: dict) -> str:
    """The package mode's start-up line (empty when the mode did not run)."""
    info = modes.get(PACKAGE_MODE)
    if not info or info.get("load_to_first_token_s") is None:
        return ""
    export = f"exported in {info['export_s']:.1f} s, " if info.get("export_s") is not None else "given by --package, "
    compiler = (info.get("compiler") or {}).get("path") or (info.get("compiler") or {}).get("command") or "unknown"
    graphs = ("Its decode program replays CUDA graphs (--package-cuda-graphs; a graph is captured on each padded "
              "batch size's first use, in the warm-up runs when there are any); its prefill program, and batches "
              "above the decode ladder, run without them."
              if info.get("cuda_graphs") else
              "Its programs run without CUDA graphs: its decode rows beside the tscompile rows show what the graphs "
              "are worth.")
    budget, bench_budget = info.get("max_num_batched_tokens"), info.get("bench_max_num_batched_tokens")
    if budget and bench_budget and budget < bench_budget:
        graphs += (f" Its steps hold at most {budget} tokens (the package's bound; the other modes {bench_budget}), "
                   f"so its larger batches' prompts are chunked: its TTFT is not the others' workload.")
    return (f"### Package\n\n`{PACKAGE_MODE}`: {export}{info['package_bytes'] / 2**20:.1f} MiB (weights "
            f"{info['package_weights']}, {info['attention_backend']} attention, C++ by {compiler}); load "
            f"{info['load_s']:.2f} s + first token {info['first_token_s']:.2f} s = load to first token "
            f"{info['load_to_first_token_s']:.2f} s. {graphs}\n")
