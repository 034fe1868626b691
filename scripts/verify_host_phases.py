"""Where the host time of a plain decode step and of a speculative verify step goes, phase by phase.

    python3 scripts/verify_host_phases.py --model llama-8b --method replay --num-speculative-tokens 3

Builds the bench's engines (``tscompile bench --speculative``'s: seeded random weights, bf16 on
CUDA, prompts of a repeated block), one plain and one speculative, runs each once to compile and
capture, then once more with every host phase of its decode steps timed by a wrapper
(``bench.workloads.time_method``) and prints the median microseconds per step of each phase:

- plain: planning the step (``Scheduler.schedule``), the runner's launch, and within it the staging
  (``fill``, ``upload``), the metadata refresh and the graph replay;
- verify: the same, plus the drafter's proposal and the whole ``VerifyStep.run`` with and without
  its read-back wait (``EngineStats.spec_host_seconds``: drafting, planning the window, launching,
  then committing the kept tokens).

A step's whole time is its wall time with the device synchronized after it (as ``tscompile bench
--speculative`` times it). On a GPU every phase but the read-back wait is host work the device
waits for; a verify step runs synchronously, so the sum of its phases is what it adds to the step.
A replay engine is settled as the bench settles it (``spec_workload.settle_replay``: handed plain
decode's output, then each run's own, until a run repeats what it was handed), so the timed run
accepts every draft, in a lower dtype too.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from tscompile.bench.spec_workload import greedy_run, repetitive_prompts, settle_replay
from tscompile.bench.workloads import time_method


def _engine(model, device, dtype, bs: int, max_len: int, spec: dict | None):
    import tscompile

    return tscompile.LLM(model, device=device, dtype=dtype, max_num_seqs=bs, max_model_len=max_len, page_size=16,
                         seed=0, speculative_config=spec)


class _StepClock:
    """The ``window`` that ``spec_workload.greedy_run`` tells of each pure-decode step: each step's wall
    time (device synchronized after it) goes under "step"."""

    def __init__(self, phases: dict):
        self.phases, self._start = phases, 0.0

    def before(self, step: int) -> None:
        self._start = time.perf_counter()

    def after(self, step: int) -> None:
        self.phases["step"].append(time.perf_counter() - self._start)


def _instrument(llm, phases: dict) -> None:
    """Wrap the step's host phases; each call's seconds go to ``phases[name]``."""
    runner = llm.runner
    decode = runner.decode
    wraps = [(llm.scheduler, "schedule", "schedule"), (runner, "launch", "launch (plain)"),
             (decode.staging, "fill", "staging.fill"), (decode.staging, "fill_verify", "staging.fill_verify"),
             (decode.staging, "upload", "staging.upload"),
             (decode.attention, "refresh_decode_metadata", "refresh_decode_metadata")]
    if decode.graphs is not None:
        wraps.append((decode.graphs, "replay_graph", "replay_graph"))
    verify = getattr(llm, "_verify", None)
    if verify is not None:
        wraps += [(verify, "run", "VerifyStep.run"), (verify.drafter, "propose", "drafter.propose"),
                  (runner, "launch_verify", "launch_verify")]
    for obj, name, label in wraps:
        time_method(obj, name, lambda s, label=label: phases[label].append(s))


def _report(title: str, phases: dict, steps: int) -> None:
    print(f"\n{title}: {steps} decode steps, median us per step (calls per step)")
    for label, seconds in phases.items():
        per_step = sum(seconds) / max(steps, 1)
        print(f"  {label:28s} {statistics.median(seconds) * 1e6 if seconds else 0:9.1f} "
              f"({len(seconds) / max(steps, 1):.2f} calls, {per_step * 1e6:.1f} us a step in all)")


def main(argv: list[str] | None = None) -> int:
    from tscompile.models import build_model
    from tscompile.utils import resolve_device, resolve_dtype

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--device", default=None, help="default: cuda where torch sees a GPU, else the CPU")
    p.add_argument("--method", default="replay", choices=("replay", "ngram"))
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--output-len", type=int, default=128)
    a = p.parse_args(argv)
    device = resolve_device(a.device)
    dtype = resolve_dtype(None, device)
    model = build_model(a.model, dtype=dtype, device=device, seed=0)
    prompts = repetitive_prompts(a.batch_size, model.config.vocab_size, a.batch_size, 16, 4)
    max_len = -(-(64 + a.output_len + a.num_speculative_tokens + 1) // 16) * 16
    spec = {"method": a.method, "num_speculative_tokens": a.num_speculative_tokens}
    references = None
    for title, config in (("plain decode", None), (f"{a.method} k={a.num_speculative_tokens}", spec)):
        llm = _engine(model, device, dtype, a.batch_size, max_len, config)
        if config is not None and a.method == "replay":
            # as the bench: runs handed the last run's output until one repeats it (compiles and captures
            # in the first), so that the timed run accepts every draft also where a lower dtype's verify
            # step rounds a near tie the other way than plain decode
            settle_replay(llm, prompts, a.output_len, device, references)
        else:
            outputs = greedy_run(llm, prompts, a.output_len, device)["outputs"]  # compiles and captures
            if config is None:
                references = {tuple(q): o for q, o in zip(prompts, outputs)}
        phases: dict[str, list[float]] = defaultdict(list)
        _instrument(llm, phases)
        before = llm.stats()
        greedy_run(llm, prompts, a.output_len, device, _StepClock(phases))
        after = llm.stats()
        verify_steps = after.spec_verify_steps - before.spec_verify_steps
        if verify_steps:  # the verify step's own host measure: all of VerifyStep.run but the read-back wait
            phases["VerifyStep.run less the wait"] = [(after.spec_host_seconds - before.spec_host_seconds)
                                                      / verify_steps] * verify_steps
        _report(title, phases, len(phases["step"]))
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
