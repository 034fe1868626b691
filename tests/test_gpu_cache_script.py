"""scripts/gpu_cache.sh: compile caches packed by one process come back as cache hits in another.

Each check runs the script the way the GPU scripts do (``eval "$(bash scripts/gpu_cache.sh restore
DIR)"`` in a shell, ``save`` after the work) with the caches' root in a temporary folder, and wipes
that root between saving and restoring, so a hit can only come from the parts on disk.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_cache.sh"
PART_NAME = re.compile(r"^gpucache-(\d\d)of(\d\d)\.tar\.xz$")

# A fresh process that compiles a small function with Inductor on the CPU, checks it against eager
# on seeded random data and prints the FX graph cache's and AOTAutograd cache's counters.
COMPILE_CHILD = r"""
import json, os, torch
from torch._dynamo.utils import counters

def step(x, w):
    return torch.nn.functional.gelu(x @ w).softmax(-1) * 2 + x.sum()

torch.manual_seed(0)
x, w = torch.randn(16, 32), torch.randn(32, 8)
# float32 sums in Inductor's order: off by ~1e-5 on some draws (x.sum() is ~10), so not the defaults
torch.testing.assert_close(torch.compile(step, backend="inductor")(x, w), step(x, w), rtol=1e-4, atol=1e-4)
print("COUNTERS " + json.dumps({
    "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
    "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
    "autograd_hit": counters["aot_autograd"]["autograd_cache_hit"],
    "inductor_dir": os.environ["TORCHINDUCTOR_CACHE_DIR"],
    "triton_dir": os.environ["TRITON_CACHE_DIR"],
}))
"""


def _env(root: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    return {**env, "GPU_CACHE_ROOT": str(root), **extra}


def _script(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)


def _restore_then_run(carried: Path, code: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    """A shell that evals restore's export lines, then a fresh Python running ``code`` with ``args``."""
    shell = 'eval "$(bash "$0" restore "$1")" && exec "$2" -c "$3" "${@:4}"'
    return subprocess.run(["bash", "-c", shell, str(SCRIPT), str(carried), sys.executable, code, *args], env=env,
                          capture_output=True, text=True, timeout=600)


def _counters(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("COUNTERS "))
    return json.loads(line.removeprefix("COUNTERS "))


def _parts(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if PART_NAME.match(p.name))


@pytest.mark.slow
def test_inductor_caches_saved_in_parts_give_fx_graph_hits_in_a_fresh_process(tmp_path):
    root, out = tmp_path / "root", tmp_path / "out"
    # parts of 16 KiB: the CPU caches (~40 KiB packed) must be cut and put back together
    env = _env(root, GPU_CACHE_PART_BYTES="16384")

    cold = _counters(_restore_then_run(tmp_path / "not_there", COMPILE_CHILD, env))
    assert cold["fxgraph_miss"] >= 1 and cold["fxgraph_hit"] == 0, cold
    assert cold["inductor_dir"] == str(root / "inductor") and cold["triton_dir"] == str(root / "triton")

    saved = _script("save", str(out), "10", env=env)
    assert saved.returncode == 0, saved.stderr
    parts = _parts(out)
    assert len(parts) >= 2, saved.stderr
    assert [PART_NAME.match(p.name).groups() for p in parts] == [
        (f"{i:02d}", f"{len(parts):02d}") for i in range(1, len(parts) + 1)]
    assert all(p.stat().st_size <= 16384 for p in parts)

    shutil.rmtree(root)
    warm_run = _restore_then_run(out, COMPILE_CHILD, env)
    warm = _counters(warm_run)
    assert "restored" in warm_run.stderr, warm_run.stderr
    assert warm["fxgraph_hit"] >= 1 and warm["fxgraph_miss"] == 0, warm
    assert warm["autograd_hit"] >= 1, warm


# Writes two kernels' files the way Triton's compiler does (FileCacheManager.put and put_group): a
# hand-written one with big incompressible IR and a small binary, and one named like Inductor's with a
# big binary. The "read" mode looks both up as a cache hit would and prints the members Triton returns.
TRITON_CHILD = r"""
import json, os, sys
from triton.runtime.cache import FileCacheManager
kernels = {"kern": ("userhash", 5000), "triton_poi_fused_add_0": ("inductorhash", 60000)}
for name, (key, binary_size) in kernels.items():
    manager = FileCacheManager(key)
    if sys.argv[1] == "write":
        group = {}
        for ext, size in (("ttir", 60000), ("ttgir", 60000), ("llir", 60000), ("ptx", 60000), ("cubin", binary_size)):
            group[f"{name}.{ext}"] = manager.put(os.urandom(size), f"{name}.{ext}")
        group[f"{name}.json"] = manager.put(json.dumps({"name": name}), f"{name}.json", binary=False)
        manager.put_group(f"{name}.json", group)
    else:
        group = manager.get_group(f"{name}.json")
        found = None if group is None else {k: [v, os.path.exists(v)] for k, v in group.items()}
        print("GROUP " + json.dumps({"kernel": name, "members": found}))
"""


def test_pruned_triton_cache_keeps_hand_written_kernels_with_valid_indexes_under_another_root(tmp_path):
    saving_root, restoring_root, out = tmp_path / "saving", tmp_path / "restoring", tmp_path / "out"
    # one part of 40 KiB: neither the IR (480 KB of random bytes) nor the Inductor-named kernel's 60 KB
    # binary fits; the hand-written kernel's binary and metadata do
    env = _env(saving_root, GPU_CACHE_PART_BYTES=str(40 * 1024), TRITON_CACHE_DIR=str(saving_root / "triton"))
    written = subprocess.run([sys.executable, "-c", TRITON_CHILD, "write"], env=env, capture_output=True, text=True)
    assert written.returncode == 0, written.stderr

    saved = _script("save", str(out), "1", env=env)
    assert saved.returncode == 0, saved.stderr
    assert "saved level 2" in saved.stderr, saved.stderr
    assert len(_parts(out)) == 1
    # only the staging copy was pruned, never the live cache
    assert (saving_root / "triton" / "userhash" / "kern.ptx").exists()
    assert (saving_root / "triton" / "inductorhash" / "triton_poi_fused_add_0.cubin").exists()

    shutil.rmtree(saving_root)
    proc = _restore_then_run(out, TRITON_CHILD, _env(restoring_root), "read")
    assert proc.returncode == 0, proc.stderr
    found = {g["kernel"]: g["members"] for g in
             (json.loads(ln.removeprefix("GROUP ")) for ln in proc.stdout.splitlines() if ln.startswith("GROUP "))}
    assert found["triton_poi_fused_add_0"] is None  # dropped: the FX graph cache bundles its own copy
    group = found["kern"]
    assert group is not None, "Triton found no cache entry for the hand-written kernel after the restore"
    assert sorted(group) == ["kern.cubin", "kern.json"], group
    for member, (path, exists) in group.items():
        assert exists and path.startswith(str(restoring_root / "triton")), (member, path)


def test_restore_of_an_incomplete_part_set_starts_cold_and_still_exports(tmp_path):
    root, carried = tmp_path / "root", tmp_path / "carried"
    carried.mkdir()
    (carried / "gpucache-01of02.tar.xz").write_bytes(b"not the whole archive")
    proc = _script("restore", str(carried), env=_env(root))
    assert proc.returncode == 0, proc.stderr
    assert "1 of 02 parts" in proc.stderr, proc.stderr
    assert proc.stdout.splitlines() == [f"export TORCHINDUCTOR_CACHE_DIR={root}/inductor",
                                        f"export TRITON_CACHE_DIR={root}/triton"]
    assert not any(p.is_file() for p in root.rglob("*"))


@pytest.mark.parametrize("parts", ["0", "100", "three"])
def test_save_refuses_a_part_count_outside_1_to_99(tmp_path, parts):
    proc = _script("save", str(tmp_path / "out"), parts, env=_env(tmp_path / "root"))
    assert proc.returncode == 2
    assert f"N (the most parts) must be a whole number from 1 to 99, got '{parts}'" in proc.stderr
