"""The ``prewarm:`` job of scripts/gpu_lanes.sh, run with stand-ins for ``tscompile``, ``nvidia-smi``
and ``python3`` on PATH: which modes run when, and which are marked done for a resumed call.

The order matters on the GPU: the engine takes 0.9 of the device's memory, so beside three 8B
stock processes it found no room for its KV pool (H200, 2026-12-03); the engine modes go first,
one at a time, then the stock modes together."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

STUB_BENCH = """#!/bin/bash
# stand-in for `tscompile bench`: logs its mode's start and end; a mode named *bad* writes an error row
mode=$(echo "$@" | sed 's/.*--modes \\([^ ]*\\).*/\\1/')
js=$(echo "$@" | sed 's/.*--output-json \\([^ ]*\\).*/\\1/')
echo "start $mode $(date +%s.%N)" >> "$STUB_LOG"
sleep 0.6
case $mode in
  *bad*) echo '{"results": [{"mode": "x", "error": "ValueError: tscompile: no room"}]}' > "$js" ;;
  *) echo '{"results": [{"mode": "x", "error": null}]}' > "$js" ;;
esac
echo "end $mode $(date +%s.%N)" >> "$STUB_LOG"
"""


def _run(tmp_path: Path, modes: str, **env) -> tuple[str, list[tuple[str, str, float]]]:
    work, stubs = tmp_path / "work", tmp_path / "stubs"
    (work / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "scripts" / "gpu_lanes.sh", work / "scripts" / "gpu_lanes.sh")
    stubs.mkdir(exist_ok=True)
    for name, text in (("tscompile", STUB_BENCH), ("nvidia-smi", "#!/bin/bash\necho stub-gpu\n"),
                       ("python3", "#!/bin/bash\nexit 0\n")):  # python3: the script's pip install
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    full_env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
                "STUB_LOG": str(log), "LANE0": f"prewarm:m:{modes}", "LANE1": "", "LANES_SECONDS": "120",
                "BENCH_RESUME": "1", **env}
    for key in ("GPU_CACHE_IN", "GPU_CACHE_OUT", "PREWARM_SERIAL"):
        if key not in env:
            full_env.pop(key, None)
    out = subprocess.run(["bash", "scripts/gpu_lanes.sh"], cwd=work, env=full_env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    calls = []
    if log.exists():
        for line in log.read_text().splitlines():
            what, mode, t = line.split()
            calls.append((what, mode, float(t)))
    return out.stdout, calls


def _span(calls, mode):
    return (next(t for w, m, t in calls if m == mode and w == "start"),
            next(t for w, m, t in calls if m == mode and w == "end"))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_prewarm_runs_engine_modes_alone_first_then_stock_modes_together(tmp_path):
    _, calls = _run(tmp_path, "compile-a,tscompile-triton,compile-b,tscompile-flashinfer")
    tri, fi = _span(calls, "tscompile-triton"), _span(calls, "tscompile-flashinfer")
    a, b = _span(calls, "compile-a"), _span(calls, "compile-b")
    assert tri[1] <= fi[0]  # the engine modes one after the other
    assert max(tri[1], fi[1]) <= min(a[0], b[0])  # and both before any stock mode starts
    assert a[0] < b[1] and b[0] < a[1]  # the stock modes overlap


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_prewarm_serial_runs_every_mode_alone(tmp_path):
    _, calls = _run(tmp_path, "compile-a,tscompile-triton,compile-b", PREWARM_SERIAL="1")
    spans = sorted(_span(calls, m) for m in ("compile-a", "tscompile-triton", "compile-b"))
    assert all(first[1] <= second[0] for first, second in zip(spans, spans[1:]))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_prewarm_resume_repeats_only_modes_that_failed(tmp_path):
    stdout, calls = _run(tmp_path, "compile-a,tscompile-triton,compile-bad")
    assert "compile-bad: rc=1, an error row" in stdout
    done = sorted(p.name for p in (tmp_path / "work" / ".bench_live").iterdir())
    assert done == ["prewarm_m_compile-a.done", "prewarm_m_tscompile-triton.done"]
    stdout, calls = _run(tmp_path, "compile-a,tscompile-triton,compile-bad")
    assert sorted({m for _, m, _ in calls}) == ["compile-bad"]  # the second call ran only the failed one
    assert "tscompile-triton: done in an earlier call" in stdout
