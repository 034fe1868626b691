"""Where a step's host time goes: cProfile over the bench engine's prefills of one prompt and over
a decode run, after warm-up (compiles and captures are not in it).

    python3 scripts/host_profile.py --model qwen3-next-1b --prompt-len 32 --out /tmp/host_profile

Writes, per phase (prefill, decode), the functions by own time and by cumulative time
(``PHASE.txt``) and the raw profile (``PHASE.prof``, for snakeviz or pstats), and prints the
median wall time of a prefill and of a decode step beside the profiled ones. A builtin that waits
on the device (``synchronize``, ``item``, ``tolist``) at the top of the own-time list is a step
that blocks where it should not; under the profiler every Python call costs more, so compare the
lists between two trees, not their totals with the bench's figures.

The engine profiled is the installed ``tscompile``'s, so the same script profiles another tree
installed apart, as ``scripts/gpu_check.sh ab`` installs the tree before a change:
``(cd SITE && PYTHONPATH=SITE python3 /path/to/scripts/host_profile.py ...)``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
from pathlib import Path

import torch

from tscompile.bench.workloads import bench_engine  # the installed tree's: see the module docstring


def _write(profile: cProfile.Profile, path: Path, top: int) -> None:
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    path.with_suffix(".txt").write_text(text.getvalue())
    stats.dump_stats(str(path.with_suffix(".prof")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default=None, help="attention backend (default: triton on cuda, torch elsewhere)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--prefills", type=int, default=20, help="profiled prefills (after 3 unprofiled)")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens of the profiled decode run")
    p.add_argument("--top", type=int, default=40, help="functions per list")
    p.add_argument("--out", default="host_profile", help="output directory")
    a = p.parse_args(argv)
    backend = a.backend or ("triton" if a.device == "cuda" else "torch")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runner = bench_engine(a.model, a.device, backend=backend, max_num_seqs=1)
    vocab = runner.llm.config.vocab_size
    prompt = torch.randint(1, vocab, (a.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()

    for _ in range(3):  # compiles, captures, first-call work
        runner.run_prefill(prompt)
    runner.run_batch([prompt], a.decode_tokens)
    walls, hosts = [], []
    for _ in range(a.prefills):
        walls.append(runner.run_prefill(prompt))
        hosts.append(runner.host_launch_s)
    profile = cProfile.Profile()
    profiled = []
    for _ in range(a.prefills):
        profile.enable()
        profiled.append(runner.run_prefill(prompt))
        profile.disable()
    _write(profile, out / "prefill", a.top)
    print(f"prefill of {a.prompt_len} tokens: median {statistics.median(walls) * 1e3:.3f} ms "
          f"({statistics.median(profiled) * 1e3:.3f} ms profiled), host until launch {statistics.median(hosts) * 1e3:.3f} ms")

    timing = runner.run_batch([prompt], a.decode_tokens)
    profile = cProfile.Profile()
    profile.enable()
    profiled_timing = runner.run_batch([prompt], a.decode_tokens)
    profile.disable()
    _write(profile, out / "decode", a.top)
    per_step = timing.decode_s / max(timing.decode_steps, 1)
    profiled_step = profiled_timing.decode_s / max(profiled_timing.decode_steps, 1)
    print(f"decode: {per_step * 1e3:.3f} ms a step ({profiled_step * 1e3:.3f} ms profiled), "
          f"{timing.decode_steps} steps")
    print(f"profiles in {out}/prefill.txt and {out}/decode.txt")
    runner.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
