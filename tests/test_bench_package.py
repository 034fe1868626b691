"""``tscompile bench``'s package mode on the CPU: a loaded package's decode and prefill rows beside
the engine's, its load-to-first-token time, the export it asks for, and its refusals.

One llama-tiny package (a real AOTInductor build: slow on a CPU) is shared, with test_export.py too
(``shared_packages.py``: its tight-bounds package with external weights); the mode's own export is
checked by recording its call rather than paying a second build."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch

from tscompile.bench import cli as bench_cli
from tscompile.bench import package_mode
from tscompile.cli import main as tscompile_main
from tscompile.models import PRESETS
from tscompile.package.record import weights_path
from helpers import one_thread_fixture
from shared_packages import TIGHT_BOUNDS, shared_package

# a step budget below the bench's (2048): the mode must run a given package within its own bound,
# chunking bs=2's two 8-token prompts into steps of 4 tokens
PACKAGE_BOUNDS = TIGHT_BOUNDS


one_thread = pytest.fixture(autouse=True)(one_thread_fixture)


@pytest.fixture(scope="module")
def tiny_package(tmp_path_factory):
    """llama-tiny, float32, on the CPU, its weights in a file beside it (read-only: shared)."""
    return shared_package(tmp_path_factory, "llama-tiny", device="cpu", weights="external", bounds=PACKAGE_BOUNDS)


def _bench(tmp_path, *extra: str) -> dict:
    """bs 1 and 2, 8-token prompts, 4 new tokens, an 8-token prefill; the JSON and the markdown."""
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    argv = ["bench", "--model", "llama-tiny", "--device", "cpu", "--batch-size", "1", "2", "--input-len", "8",
            "--output-len", "4", "--prefill-lens", "8", "--num-iters", "1", "--num-iters-warmup", "1",
            "--output-json", str(out_json), "--output-md", str(out_md), "--no-progress", "--bandwidth-mib", "16",
            *extra]
    assert tscompile_main(argv) == 0
    result = json.loads(out_json.read_text())
    result["markdown"] = out_md.read_text()
    return result


def _assert_package_rows(result: dict) -> dict:
    """The package rows ran, decode the eager engine's and the float32 reference's tokens, and the
    mode reports its start-up; returns the mode's info."""
    rows = {(r["mode"], r["batch_size"]): r for r in result["results"]}
    for bs in (1, 2):
        row = rows[("package", bs)]
        assert row["error"] is None, row["error"]
        assert row["tpot_ms"] > 0 and row["decode_steps_per_iter"] == 3 and row["non_decode_steps"] == 0
        assert row["tokens_req0"] == rows[("eager", bs)]["tokens_req0"] and row["match_eager"] == f"{bs}/{bs}"
        assert row["reference_check"] == {"agrees": True, "compared_tokens": 4}
    prefill = {p["mode"]: p for p in result["prefill"]}
    assert prefill["package"]["error"] is None and prefill["package"]["prefill_ms"] > 0
    info = result["modes"]["package"]
    assert info["error"] is None and info["cuda_graphs"] is False
    assert 0 < info["load_s"] < info["load_to_first_token_s"]
    assert info["load_to_first_token_s"] == pytest.approx(info["load_s"] + info["first_token_s"])
    assert "| package | 2 |" in result["markdown"] and "### Package" in result["markdown"]
    assert f"load to first token {info['load_to_first_token_s']:.2f} s" in result["markdown"]
    return info


@pytest.mark.slow
def test_bench_package_mode_with_a_given_package(tmp_path, tiny_package):
    result = _bench(tmp_path, "--modes", "eager", "--package", str(tiny_package))
    assert result["modes_run"] == ["eager", "package"]  # --package adds the mode
    info = _assert_package_rows(result)
    assert info["exported"] is False and info["export_s"] is None and info["package_path"] == str(tiny_package)
    assert info["bounds"] == {k: v for k, v in PACKAGE_BOUNDS.items() if k != "page_size"}
    assert info["max_num_batched_tokens"] == 4  # the package's bound, not the bench's 2048
    assert info["bench_max_num_batched_tokens"] == 2048
    assert "at most 4 tokens (the package's bound; the other modes 2048)" in result["markdown"]
    assert "given by --package" in result["markdown"]


@pytest.mark.slow
def test_bench_package_mode_exports_the_bench_model_with_its_limits(tmp_path, tiny_package, monkeypatch):
    """Without --package the mode exports the bench model: the seed, dtype, page size and the
    bench's limits as bounds, verified (a package that crashes would kill the bench). The build is
    the shared package, copied in place of a second one."""
    calls = []

    def export(model, out, **kw):
        calls.append((model, kw))
        shutil.copy(tiny_package, out)
        shutil.copy(weights_path(tiny_package), weights_path(out))  # its weights file, named after it

    monkeypatch.setattr("tscompile.export.export_package", export)
    result = _bench(tmp_path, "--modes", "eager", "package")
    (model, kw), = calls
    assert model == "llama-tiny" and kw["dtype"] == torch.float32 and kw["seed"] == 0 and kw["page_size"] == 16
    assert "verify" not in kw  # export_package's default: verified
    # the bench's limits: its largest batch, a page-rounded prompt + output, its token budget
    assert (kw["max_num_seqs"], kw["max_model_len"], kw["max_num_batched_tokens"]) == (2, 16, 2048)
    info = _assert_package_rows(result)
    assert info["exported"] is True and info["export_s"] >= 0 and info["package_path"] is None
    assert "exported in" in result["markdown"]


def test_package_mode_is_chosen_only_when_asked():
    cpu = torch.device("cpu")
    plain = argparse.Namespace(modes=None, attention_backends=["torch"], package=None)
    assert "package" not in bench_cli.resolve_modes(plain, cpu)
    given = argparse.Namespace(modes=None, attention_backends=["torch"], package="m.pt2")
    assert bench_cli.resolve_modes(given, cpu)[-1] == "package"
    named = argparse.Namespace(modes=["package", "eager"], attention_backends=None, package=None)
    assert bench_cli.resolve_modes(named, cpu) == ["package", "eager"]


def test_a_package_of_another_model_dtype_or_device_is_refused():
    cfg = PRESETS["llama-tiny"]
    record = {"config": cfg.to_dict(), "model": "llama-tiny", "dtype": "float32", "device": "cpu"}
    package_mode._check_matches(record, "m.pt2", cfg, torch.float32, torch.device("cpu"))
    other = {**record, "config": PRESETS["narrow-tiny"].to_dict(), "model": "narrow-tiny"}
    with pytest.raises(ValueError, match=r"^tscompile: --package 'm\.pt2' was exported from another model "
                                         r"\('narrow-tiny'"):
        package_mode._check_matches(other, "m.pt2", cfg, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^tscompile: --package 'm\.pt2' holds float32 programs, the bench runs "
                                         r"--dtype bfloat16"):
        package_mode._check_matches(record, "m.pt2", cfg, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^tscompile: --package 'm\.pt2' was built for 'cpu', the bench runs on "
                                         r"'cuda'"):
        package_mode._check_matches(record, "m.pt2", cfg, torch.float32, torch.device("cuda"))


def test_a_missing_package_file_is_refused(tmp_path, capsys):
    missing = tmp_path / "absent.pt2"
    assert tscompile_main(["bench", "--model", "llama-tiny", "--device", "cpu", "--package", str(missing)]) == 2
    assert f"tscompile: --package {str(missing)!r} is not a file" in capsys.readouterr().err


def test_package_cuda_graphs_flag_is_refused_off_cuda(tmp_path, capsys):
    argv = ["bench", "--model", "llama-tiny", "--device", "cpu", "--modes", "package", "--package-cuda-graphs"]
    assert tscompile_main(argv) == 2
    assert "tscompile: --package-cuda-graphs needs a CUDA device (the decode graphs are CUDA graphs); --device is " \
           "'cpu'" in capsys.readouterr().err


def test_package_section_says_whether_the_decode_program_replayed_graphs():
    info = {"load_to_first_token_s": 1.5, "load_s": 1.0, "first_token_s": 0.5, "export_s": None, "package_bytes": 2**20,
            "package_weights": "inside", "attention_backend": "triton", "compiler": None}
    plain = package_mode.markdown_section({"package": {**info, "cuda_graphs": False}})
    graphed = package_mode.markdown_section({"package": {**info, "cuda_graphs": True}})
    assert "run without CUDA graphs" in plain and "replays CUDA graphs" not in plain
    assert "Its decode program replays CUDA graphs (--package-cuda-graphs" in graphed
    assert "run without CUDA graphs: its decode rows" not in graphed


def test_package_cuda_graphs_flag_is_refused_without_the_package_mode(capsys):
    argv = ["bench", "--model", "llama-tiny", "--device", "cpu", "--modes", "eager", "--package-cuda-graphs"]
    assert tscompile_main(argv) == 2
    assert "tscompile: --package-cuda-graphs changes the package mode, which this run does not measure" \
        in capsys.readouterr().err
