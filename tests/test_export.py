"""Packages (``tscompile export`` / ``load_package`` / ``run-package``): torch.export + AOTInductor
programs against the eager engine, external weights, and every refusal.

Compiling is slow on a CPU, so each package is built once per test run (small bounds) and shared,
with other test files too (``shared_packages.py``): the package with external weights, built with
tight bounds, is also the one the tight-bounds test runs."""

from __future__ import annotations

import json
import os
import re
import zipfile

import pytest
import torch

import tscompile
import tscompile.version
from tscompile import SamplingParams
from tscompile.counters import counters
from tscompile.forward_context import ForwardMode
from tscompile.runtime.graph_runner import HostGraphs
from tscompile.cli import main as cli_main
from tscompile.export import export_package, read_package_metadata
from tscompile.utils import UPLOAD_ALIGN_BYTES

from helpers import assert_other_releases_refused, ids, record_modes
from shared_packages import BOUNDS, TIGHT_BOUNDS, loadable_cxx, shared_package

DEVICE = torch.device(os.environ.get("TSCOMPILE_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu"))

_AOTI_PROBE = """
import torch
m = torch.nn.Linear(8, 8).to("{d}"); x = torch.randn(3, 8, device="{d}")
ep = torch.export.export(m, (x,))
path = torch._inductor.aoti_compile_and_package(ep, package_path="{p}")
torch.testing.assert_close(torch._inductor.aoti_load_package(path)(x), m(x))
"""


def _aoti_loads_here(tmp: str) -> tuple[bool, str]:
    """Whether this machine can load any AOTInductor package on DEVICE (a subprocess: a package
    that does not load segfaults)."""
    import subprocess
    import sys

    code = _AOTI_PROBE.format(d=DEVICE.type, p=os.path.join(tmp, "probe.pt2"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    return run.returncode == 0, f"rc {run.returncode}: {run.stderr.strip()[-300:]}"


@pytest.fixture(scope="module", autouse=True)
def aoti_usable(tmp_path_factory):
    """This module's packages build with a compiler whose libraries load (the system g++ when
    ``CXX`` names another: in the environment for child processes, and as Inductor's ``cpp.cxx``
    here, since Inductor read ``CXX`` when it was imported); on a GPU, a probe package must load."""
    import torch._inductor.config as inductor_config

    gxx = loadable_cxx()
    with pytest.MonkeyPatch.context() as patch, inductor_config.patch({"cpp.cxx": (gxx,)} if gxx else {}):
        if gxx:
            patch.setenv("CXX", gxx)
        if DEVICE.type != "cpu":  # CI's device, the CPU, loads packages in-process and tests them directly
            ok, why = _aoti_loads_here(str(tmp_path_factory.mktemp("aoti_probe")))
            if not ok:
                pytest.skip(f"AOTInductor cannot load even an nn.Linear package on {DEVICE} here ({why})")
        yield


OTHER_DEVICE = "cpu" if DEVICE.type == "cuda" else "cuda"
PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 250, 11], [300], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
           [77, 66, 55], [400, 401], [9, 9, 9, 9, 9, 9, 9]]
# ragged batches inside the bounds (1 .. max_num_seqs), and one past it that queues and chunks
BATCHES = [PROMPTS[1:2], PROMPTS[0:1], PROMPTS[2:4], PROMPTS[0:3], PROMPTS[0:4], PROMPTS]
EXPECTED_OPS = {
    "llama-tiny": {"prefill": {"attention", "sample"}, "decode": {"attention", "refresh_decode_metadata", "sample"}},
    "narrow-tiny": {"prefill": {"attention", "narrow_rows", "sample"},
                    "decode": {"attention", "refresh_decode_metadata", "sample"}},
}


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """``package(model, weights)`` -> path; built on first use, once per test run. Weights inside:
    ``BOUNDS``; external weights (exported through the CLI): ``TIGHT_BOUNDS``."""

    def get(model: str, weights: str = "inside"):
        bounds = TIGHT_BOUNDS if weights == "external" else BOUNDS
        return shared_package(tmp_path_factory, model, device=DEVICE, weights=weights, bounds=bounds)

    return get


@pytest.fixture(scope="module")
def eager():
    """``eager(model, bounds=BOUNDS)``: the eager engine a package of those bounds is checked against."""
    made = {}

    def get(model: str, bounds: dict = BOUNDS):
        key = (model, tuple(sorted(bounds.items())))
        if key not in made:
            made[key] = tscompile.LLM(model, device=DEVICE, dtype=torch.float32, enforce_eager=True, **bounds)
        return made[key]

    return get


@pytest.mark.parametrize("model", ["llama-tiny", "narrow-tiny"])
def test_package_greedy_equals_eager_across_batch_sizes(model, package, eager):
    llm = tscompile.load_package(package(model))
    assert llm.device.type == DEVICE.type
    modes = record_modes(llm)
    params = SamplingParams(max_new_tokens=6)
    for batch in BATCHES:
        got = ids(llm.generate(batch, params))
        assert got == ids(eager(model).generate(batch, params)), f"batch of {len(batch)}"
        assert all(len(o) == 6 for o in got)
    assert ForwardMode.MIXED not in modes
    # more requests than max_num_seqs, finishing at different steps: late prompts are admitted while
    # others decode (mixed steps) and chunked by the token budget
    params = [SamplingParams(max_new_tokens=n) for n in (3, 8, 5, 2, 7, 4)]
    got = ids(llm.generate(PROMPTS[::-1], params))
    assert got == ids(eager(model).generate(PROMPTS[::-1], params))
    assert [len(o) for o in got] == [3, 8, 5, 2, 7, 4]
    assert {ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE} <= set(modes)
    assert not llm.has_unfinished()


def test_tight_bounds_batch_of_one_and_four_token_steps(package, eager):
    """Bounds of 2 requests and 4 tokens a step: batch and token sizes of 1 and 2 are ordinary sizes
    (no 0/1 specialization), prompts run in 4-token chunks, the third request waits for a slot.
    (The package with these bounds is the one with external weights.)"""
    llm = tscompile.load_package(package("llama-tiny", "external"))
    assert llm.package.record["bounds"] == {k: v for k, v in TIGHT_BOUNDS.items() if k != "page_size"}
    ref = eager("llama-tiny", TIGHT_BOUNDS)
    params = SamplingParams(max_new_tokens=5)
    for batch in ([[300]], [PROMPTS[0]], [[1, 2], [3]], [PROMPTS[0], [300], PROMPTS[3]]):
        assert ids(llm.generate(batch, params)) == ids(ref.generate(batch, params))


def test_package_sampling_equals_eager(package, eager):
    llm = tscompile.load_package(package("llama-tiny"))
    params = [SamplingParams(max_new_tokens=5, temperature=0.9, top_k=20, top_p=0.9, seed=s) for s in range(4)]
    assert ids(llm.generate(PROMPTS[:4], params)) == ids(eager("llama-tiny").generate(PROMPTS[:4], params))


def _compiled_ops(path, program: str) -> set[str]:
    """The tscompile ops the AOTInductor program calls (its extern kernel calls)."""
    with zipfile.ZipFile(path) as zf:
        names = [n for n in zf.namelist() if f"/aotinductor/{program}/" in n and n.endswith(".wrapper.json")]
        assert names, zf.namelist()
        return set(re.findall(r"tscompile::(\w+)", zf.read(names[0]).decode()))


@pytest.mark.parametrize("model", ["llama-tiny", "narrow-tiny"])
def test_package_holds_both_programs_custom_ops_and_metadata(model, package):
    path = package(model)
    record = read_package_metadata(path)
    assert record["programs"] == ["prefill", "decode"]
    assert record["model"] == model and record["config"] == tscompile.models.build_config(model).to_dict()
    assert record["tscompile_version"] == tscompile.__version__ and record["torch_version"] == torch.__version__
    assert record["device"] == DEVICE.type and record["dtype"] == "float32" and record["page_size"] == 4
    assert record["bounds"] == {k: v for k, v in BOUNDS.items() if k != "page_size"}
    assert record["attention_backend"] in ("torch", "triton") and record["weights"] == "inside"
    for program, ops in EXPECTED_OPS[model].items():
        assert set(record["ops"][program]) == {f"tscompile::{op}" for op in ops}
        assert _compiled_ops(path, program) == ops
    # weights inside are stored once and shared by both programs
    with zipfile.ZipFile(path) as zf:
        stored = [n for n in zf.namelist() if "/data/weights/" in n]
    # + RoPE's cos / sin tables (inv_freq, which no program reads, is not stored inside the package)
    assert len(stored) == len(list(tscompile.models.build_model(model).parameters())) + 2


def test_external_weights_load_agree_and_are_borrowed(package, eager):
    inside, external = package("llama-tiny"), package("llama-tiny", "external")
    weights_file = external.with_suffix(".safetensors")
    assert weights_file.is_file()
    assert read_package_metadata(external)["weights"] == "external"
    weight_bytes = sum(p.numel() * 4 for p in tscompile.models.build_model("llama-tiny").parameters())
    assert os.path.getsize(external) < os.path.getsize(inside) - weight_bytes // 2  # no weights inside
    from safetensors import safe_open

    with safe_open(weights_file, framework="pt") as f:  # RoPE rows for the package's positions only
        head_dim = tscompile.models.build_config("llama-tiny").head_dim
        assert f.get_slice("rope_cos").get_shape() == [TIGHT_BOUNDS["max_model_len"], head_dim // 2]
    llm = tscompile.load_package(external)
    params = SamplingParams(max_new_tokens=6)
    assert ids(llm.generate(PROMPTS, params)) == ids(eager("llama-tiny", TIGHT_BOUNDS).generate(PROMPTS, params))
    # the programs read the very tensors loaded from the file (no second copy): zeroing the output
    # projection in place zeroes every logit, so greedy (stable sort) picks token 0 everywhere
    llm.package.weights["output.weight"].zero_()
    assert ids(llm.generate(PROMPTS[:2], params)) == [[0] * 6, [0] * 6]


def test_real_package_records_hash_and_refuses_damage(package, tmp_path):
    """A real external-weights package (a copy of the shared one): the record carries the weights'
    size and hash, an intact package loads, and damage to tensor data (caught by verify) or to a
    program member (caught on load) is refused."""
    import shutil

    from tscompile.package.integrity import file_sha256
    from tscompile.package.record import FORMAT_VERSION
    from helpers import flip_byte, member_offset

    shared = package("llama-tiny", "external")
    path = tmp_path / shared.name
    shutil.copy(shared, path)
    wpath = shutil.copy(shared.with_suffix(".safetensors"), path.with_suffix(".safetensors"))
    record = read_package_metadata(path)
    assert record["format"] == FORMAT_VERSION
    assert record["weights_sha256"] == file_sha256(wpath) and record["weights_bytes"] == wpath.stat().st_size
    assert read_package_metadata(path, verify=True) == record
    assert len(ids(tscompile.load_package(path).generate([[1, 2, 3]]))[0]) == 16

    flip_byte(wpath, wpath.stat().st_size - 1)  # the last byte of tensor data
    read_package_metadata(path)
    with pytest.raises(ValueError, match=r"is damaged: its SHA-256"):
        read_package_metadata(path, verify=True)

    with zipfile.ZipFile(path) as zf:
        so = next(i for i in zf.infolist() if i.filename.endswith(".so"))
    flip_byte(path, member_offset(path, so.filename) + so.file_size // 2)
    with pytest.raises(ValueError, match=rf"^tscompile: package .* is damaged: member '{so.filename}' fails"):
        tscompile.load_package(path)


def test_loading_spawns_no_process_and_probes_no_cpu_isa(package, monkeypatch):
    """torch's ``load_pt2`` compares each program's host with this one through
    ``get_device_information``, whose ``pick_vec_isa()`` on torch 2.11 compiles and loads a probe in
    a fresh ``python -c "import torch"`` per vector ISA: 27 to 47 s on an AVX-512/AMX host, most
    of a 50 s package start on the H200. ``load_package`` must run none of it, for either weights."""
    import subprocess

    import torch._inductor.codecache as codecache
    import torch._inductor.cpu_vec_isa as cpu_vec_isa

    called = []

    def forbidden(what):
        def call(*args, **kwargs):
            called.append(what)
            raise AssertionError(f"load_package called {what}")
        return call

    paths = [package("llama-tiny"), package("llama-tiny", "external")]  # exported before the patches
    monkeypatch.setattr(codecache, "get_device_information", forbidden("get_device_information"))
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", forbidden("pick_vec_isa"))
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", forbidden("valid_vec_isa_list"))
    monkeypatch.setattr(subprocess, "Popen", forbidden("a child process"))
    for path in paths:
        llm = tscompile.load_package(path)
        assert len(ids(llm.generate([[5, 17, 3]], SamplingParams(max_new_tokens=3)))[0]) == 3
    assert called == []


def test_a_package_runs_without_importing_dynamo_and_gives_the_engines_tokens(package, eager):
    """torch's custom-op wrapper imports ``torch._dynamo`` on a kernel's first call (2.7 s of a
    llama-tiny package's 2.7 s first token on the CPU); a loaded package needs no Dynamo, so
    ``load_package`` defers that import (``tscompile/package/lazy_dynamo.py``). Checked in a fresh
    process (this one imported Dynamo long ago); tokens as the eager engine's."""
    import json
    import subprocess
    import sys

    prompt, params = [5, 17, 3, 99], SamplingParams(max_new_tokens=4)
    expected = ids(eager("llama-tiny").generate([prompt], params))[0]
    code = (
        "import json, sys, tscompile\n"
        f"llm = tscompile.load_package({str(package('llama-tiny'))!r})\n"
        f"out = llm.generate([{prompt!r}], tscompile.SamplingParams(max_new_tokens=4))\n"
        "print(json.dumps({'dynamo': 'torch._dynamo' in sys.modules, 'tokens': out[0].outputs[0].token_ids}))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"dynamo": False, "tokens": expected}


def test_deferred_kernels_skip_dynamo_until_it_is_imported_then_go_through_its_disable(monkeypatch):
    """Without ``torch._dynamo`` in the process a deferred kernel is called directly; once Dynamo is
    imported, through ``torch._dynamo.disable`` as torch itself would (the stand-in replaces itself).
    ``defer_dynamo_import`` reaches every tscompile kernel once."""
    import sys

    from torch._library.custom_ops import OPDEFS

    from tscompile.package.lazy_dynamo import NAMESPACE, _deferring, defer_dynamo_import

    seen = []

    def kernel(x):
        seen.append(x)
        return x + 1

    stand_in = _deferring(kernel)
    with monkeypatch.context() as m:
        m.delitem(sys.modules, "torch._dynamo")  # a process that never imported Dynamo
        assert stand_in(1) == 2 and "__dynamo_disable" not in kernel.__dict__
    assert stand_in(2) == 3 and seen == [1, 2]
    assert kernel.__dict__["__dynamo_disable"]._torchdynamo_disable  # torch._dynamo.disable's wrapper

    fns = [w.__wrapped__ for name, op in OPDEFS.items() if name.startswith(NAMESPACE) for w in op._backend_fns.values()]
    assert fns, "no tscompile kernel found behind torch's custom-op wrappers"
    for fn in fns:
        monkeypatch.delitem(fn.__dict__, "__dynamo_disable", raising=False)
    assert defer_dynamo_import() == len(fns)
    assert defer_dynamo_import() == 0  # each once


def test_host_mismatches_name_what_differs_and_accept_this_host(package, monkeypatch):
    from tscompile.package.aoti_load import host_mismatches

    llm = tscompile.load_package(package("llama-tiny"))
    for program in llm.runner.programs.values():
        assert program.get_metadata()["AOTI_DEVICE_KEY"] == DEVICE.type
        assert host_mismatches(program.get_metadata(), DEVICE) == []
    other = {"AOTI_PLATFORM": "win32", "AOTI_MACHINE": "riscv64", "AOTI_CPU_ISA": "AVX512 AVX512_VNNI AMX_TILE"}
    for feature in ("_is_avx512_supported", "_is_vnni_supported"):
        monkeypatch.setattr(torch.cpu, feature, lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    found = host_mismatches(other, torch.device("cpu"))
    assert [f.split()[0] for f in found] == ["AOTI_PLATFORM", "AOTI_MACHINE", "AOTI_CPU_ISA"]
    assert "needs ['AMX_TILE']" in found[2]
    assert host_mismatches({"AOTI_CPU_ISA": "AVX512 AVX512_VNNI"}, torch.device("cpu")) == []


def test_tied_weights_are_written_once_with_an_alias():
    from tscompile.package.build import _unique_weights

    model = tscompile.models.build_model(tscompile.models.build_config("llama-tiny", tie_embeddings=True))
    tensors, aliases = _unique_weights(model)
    assert aliases == {"output.weight": "tok_embeddings.weight"}
    assert "output.weight" not in tensors and "inv_freq" in tensors
    assert not any(k.endswith(("k_cache", "v_cache")) for k in tensors)


def test_external_weights_missing_file_refused(package, tmp_path):
    src = package("llama-tiny", "external")
    lonely = tmp_path / "lonely.pt2"
    lonely.write_bytes(src.read_bytes())
    with pytest.raises(ValueError, match=r"^tscompile: .*--weights external.*lonely\.safetensors"):
        tscompile.load_package(lonely)


def test_refuses_other_torch_and_tscompile_releases(package, monkeypatch):
    path = package("llama-tiny")
    assert_other_releases_refused(path, monkeypatch)
    with monkeypatch.context() as m:  # a patch release of either is compatible
        m.setattr(tscompile.version, "__version__", tscompile.__version__ + ".post1")
        tscompile.load_package(path, max_num_seqs=1)


def test_export_refuses_a_non_positive_bound_before_loading_the_model(tmp_path, monkeypatch):
    """A bound of 0 is refused with the bounds message, before the load (which sizes RoPE by
    max_model_len and would refuse 0 positions with its own)."""
    import tscompile.package.build as package_build

    monkeypatch.setattr(package_build, "load_model", lambda *a, **k: pytest.fail("loaded before the bounds check"))
    with pytest.raises(ValueError, match=r"^tscompile: bounds must be positive, got max_num_seqs 1, max_model_len 0"):
        export_package("llama-tiny", tmp_path / "m.pt2", max_num_seqs=1, max_model_len=0)


def test_refuses_another_device(package):
    with pytest.raises(ValueError, match=rf"^tscompile: package was built for device '{DEVICE.type}', "
                                         rf"cannot load it on '{OTHER_DEVICE}'"):
        tscompile.load_package(package("llama-tiny"), device=OTHER_DEVICE)


@pytest.mark.parametrize("name,value,limit", [("max_num_seqs", 5, 4), ("max_model_len", 65, 64),
                                              ("max_num_batched_tokens", 33, 32), ("max_num_seqs", 0, 4)])
def test_refuses_runtime_limits_beyond_package_bounds(package, name, value, limit):
    # a value below 1 is refused by the argument check, a value above the bound by the bound check
    below = rf"{name} must be None or an int >= 1, got {value}"
    above = rf"{name} {value} is outside the package's bound \[1, {limit}\]"
    with pytest.raises(ValueError, match=rf"^tscompile: ({below}|{above})"):
        tscompile.load_package(package("llama-tiny"), **{name: value})


def test_refuses_requests_beyond_package_bounds_and_queues_nothing(package):
    llm = tscompile.load_package(package("llama-tiny"))
    with pytest.raises(ValueError, match=r"^tscompile: .* = 66 exceeds max_model_len 64 \(package bound 64\)"):
        ids(llm.generate([[1, 2, 3], list(range(60))], SamplingParams(max_new_tokens=6)))
    assert not llm.has_unfinished()
    with pytest.raises(ValueError, match=r"^tscompile: token id 512 outside the vocabulary"):
        ids(llm.generate([[512]]))
    small = tscompile.load_package(package("llama-tiny"), max_model_len=16)
    with pytest.raises(ValueError, match=r"^tscompile: .* = 20 exceeds max_model_len 16 \(package bound 64\)"):
        ids(small.generate([list(range(10))], SamplingParams(max_new_tokens=10)))
    assert len(ids(small.generate([list(range(10))], SamplingParams(max_new_tokens=6)))[0]) == 6


def test_refuses_what_is_not_a_package(tmp_path):
    bogus = tmp_path / "bogus.pt2"
    bogus.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"^tscompile: .*bogus\.pt2.* is not a \.pt2 package"):
        tscompile.load_package(bogus)
    with pytest.raises(ValueError, match=r"^tscompile: no package at"):
        tscompile.load_package(tmp_path / "absent.pt2")


def test_export_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"^tscompile: --weights must be"):
        export_package("llama-tiny", tmp_path / "m.pt2", device="cpu", weights="elsewhere")
    with pytest.raises(ValueError, match=r"^tscompile: a package path must end in \.pt2"):
        export_package("llama-tiny", tmp_path / "m.zip", device="cpu")
    with pytest.raises(ValueError, match=r"^tscompile: unknown model preset"):
        export_package("llama-huge", tmp_path / "m.pt2", device="cpu")


def test_run_package_cli_prints_ids_size_and_load_time(package, eager, capsys):
    path = package("narrow-tiny")
    assert cli_main(["run-package", str(path), "--prompt-ids", "5,17,3,99", "--prompt-ids", "300",
                     "--max-new-tokens", "5", "--verbose"]) == 0
    out = capsys.readouterr().out
    want = ids(eager("narrow-tiny").generate([[5, 17, 3, 99], [300]], SamplingParams(max_new_tokens=5)))
    assert f"[0] {' '.join(map(str, want[0]))}" in out and f"[1] {' '.join(map(str, want[1]))}" in out
    assert re.search(r"package .*: \d+\.\d+ MiB \(weights inside\), loaded in \d+\.\d+ s", out)
    assert cli_main(["run-package", str(path), "--prompt-ids", "7,8,9", "--max-new-tokens", "3", "--json", "-v"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["outputs"][0]) == 3 and data["package_bytes"] == os.path.getsize(path) and data["load_seconds"] > 0
    # refusals come back as exit code 2 with the tscompile message on stderr
    assert cli_main(["run-package", str(path), "--max-num-seqs", "9"]) == 2
    assert "tscompile: max_num_seqs 9 is outside the package's bound [1, 4]" in capsys.readouterr().err


# -- decode CUDA graphs of a package, through HostGraphs (package/decode_graphs.py) -------------------

def _decode_sizes(llm) -> list[int]:
    """Spy on an engine: the batch size of every decode step it runs, in order."""
    seen = []
    original = llm.runner.launch

    def spy(plan, prev_rows=None):
        if plan.mode is ForwardMode.DECODE:
            seen.append(plan.num_requests)
        return original(plan, prev_rows)

    llm.runner.launch = spy
    return seen


def _host_replayed(path, ladder):
    llm = tscompile.load_package(path)
    llm.runner.enable_decode_graphs(ladder, backend=HostGraphs())
    return llm


def _fill_caches_randomly(llm) -> list[torch.Tensor]:
    """Every K/V cache page random (seed 0, so two engines of one package get the same contents);
    returns copies of them."""
    gen = torch.Generator().manual_seed(0)
    caches = llm.runner.k_caches + llm.runner.v_caches
    for t in caches:
        t.copy_(torch.randn(t.shape, generator=gen))
    return [t.clone() for t in caches]


def _assert_padding_wrote_only_the_null_slot(padded, plain, initial: list[torch.Tensor]) -> None:
    """The padded engine's caches differ from the unpadded one's only by page 0's slot 0 (the null
    block) and float32 rounding: the same slots written, the same values there up to 1e-5."""
    ppb = padded.package.record["pages_per_block"]
    for got, want, start in zip(padded.runner.k_caches + padded.runner.v_caches,
                                plain.runner.k_caches + plain.runner.v_caches, initial):
        written = {tuple(s) for s in (want != start).flatten(2).any(-1).nonzero().tolist()}
        assert written and not any(page < ppb for page, _ in written)  # the unpadded run never writes the null block
        assert {tuple(s) for s in (got != start).flatten(2).any(-1).nonzero().tolist()} == written | {(0, 0)}
        torch.testing.assert_close(got[ppb:], want[ppb:], rtol=1e-5, atol=1e-5)


def test_padded_decode_gives_the_unpadded_programs_tokens_and_writes_only_the_null_page(package):
    """Three requests padded to a ladder size of 4, greedy then seeded: the same tokens as the
    program called on the three rows, step after step. Over caches filled with random values, the
    padded run writes exactly the slots the unpadded run writes plus page 0's slot 0 (the null
    block, where padding rows and the idle capture run write), and the same values there up to
    float32 rounding (a GEMM of 4 rows rounds apart from one of 3, by about 4e-7 here): a padding
    row writing a live slot would leave a slot of its own or a value of order 1 apart."""
    path = package("llama-tiny")
    plain, padded = tscompile.load_package(path), _host_replayed(path, (4,))
    initial = _fill_caches_randomly(padded)
    assert [torch.equal(a, b) for a, b in zip(_fill_caches_randomly(plain), initial)] == [True] * len(initial)
    sizes = _decode_sizes(padded)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    seeded = [SamplingParams(max_new_tokens=6, temperature=0.9, top_k=20, top_p=0.9, seed=s) for s in range(3)]
    for params in (SamplingParams(max_new_tokens=6), seeded):
        assert ids(padded.generate(prompts, params)) == ids(plain.generate(prompts, params))
    graphs = padded.runner.decode_graphs
    # every input view 16-byte aligned (what compiled kernels may assume), at UPLOAD_ALIGN_BYTES
    # steps from its arena's start as utils.upload places the unpadded path's
    views = [t for x in graphs.inputs(4)[:-2] for t in (x if isinstance(x, list) else [x])]
    assert len(views) == 10 and all(t.data_ptr() % 16 == 0 for t in views)
    arenas = {t.dtype: t.untyped_storage().data_ptr() for t in views}
    assert all((t.data_ptr() - arenas[t.dtype]) % UPLOAD_ALIGN_BYTES == 0 for t in views)
    assert sizes == [3] * 10  # five decode steps per generate, all of three rows
    assert (graphs.replays, graphs.padded_rows, graphs.captures) == (10, 10, 1)
    _assert_padding_wrote_only_the_null_slot(padded, plain, initial)


def test_decode_above_the_ladder_runs_the_program_and_smaller_batches_pad(package):
    """Ladder (2,), requests finishing at different steps: the three-row steps run the program
    directly, the two-row steps replay exactly, the one-row steps pad to two over a row the step
    before used (a stale row must not write its old slot); tokens and caches as unpadded."""
    path = package("llama-tiny")
    plain, padded = tscompile.load_package(path), _host_replayed(path, (2,))
    initial = _fill_caches_randomly(padded)
    _fill_caches_randomly(plain)
    sizes = _decode_sizes(padded)
    params = [SamplingParams(max_new_tokens=n) for n in (2, 4, 6)]
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[4]]
    assert ids(padded.generate(prompts, params)) == ids(plain.generate(prompts, params))
    graphs = padded.runner.decode_graphs
    assert sizes == [3, 2, 2, 1, 1]
    assert (graphs.replays, graphs.padded_rows, graphs.captures) == (4, 2, 1)
    _assert_padding_wrote_only_the_null_slot(padded, plain, initial)


def test_the_package_replay_switch_runs_the_same_padded_steps_without_graphs(package):
    """``runner.graphs.replay = False``: the same ladder padding and buffers, the program called
    directly; nothing is captured or replayed, and the tokens equal the replayed run's."""
    path = package("llama-tiny")
    padded = _host_replayed(path, (4,))
    assert padded.runner.graphs is padded.runner.decode_graphs.graphs
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    params = SamplingParams(max_new_tokens=4, temperature=0.9, top_k=20, seed=3)
    counters.clear()
    replayed = ids(padded.generate(prompts, params))
    assert (counters["decode_captures"], counters["decode_replays"]) == (1, 3)  # captured 1, replayed 3
    padded.runner.graphs.replay = False
    counters.clear()
    assert ids(padded.generate(prompts, params)) == replayed
    assert counters["decode_captures"] == counters["decode_replays"] == 0
    graphs = padded.runner.decode_graphs
    assert (graphs.replays, graphs.padded_rows) == (6, 6)  # both runs padded 3 rows to 4, every step


def test_cuda_graphs_refusals_load_no_program(package, monkeypatch):
    path = package("llama-tiny")
    llm = tscompile.load_package(path)
    with pytest.raises(ValueError, match=r"^tscompile: decode graph ladder \(2, 8\) must hold ints in "
                                         r"\[1, max_num_seqs=4\]"):
        llm.runner.enable_decode_graphs((8, 2), backend=HostGraphs())
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match=r"^tscompile: decode CUDA graphs need a CUDA device, got 'cpu'"):
            llm.runner.enable_decode_graphs()

    def forbidden(*args, **kwargs):
        raise AssertionError("a refused load_package loaded its programs")

    monkeypatch.setattr("tscompile.package.runtime._load_programs", forbidden)
    with pytest.raises(ValueError, match=r"^tscompile: cuda_graphs='yes' must be True or False"):
        tscompile.load_package(path, cuda_graphs="yes")
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match=r"^tscompile: cuda_graphs=True needs a CUDA device; this package "
                                             r"loads on 'cpu'"):
            tscompile.load_package(path, cuda_graphs=True)
