"""``tscompile bench --model-impl native transformers``: one process measures the engine modes with both
model implementations on the same weights, labels the transformers rows ``<mode>+transformers``
everywhere, checks both against the float32 reference, and reports their time ratio; one value keeps
the modes' own names; several values are refused where nothing would run them.

No timing is asserted: the ratio table is checked against the times the JSON holds.
"""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

from tscompile.bench import cli as bench_cli
from tscompile.bench import impls, workloads
from tscompile.cli import main as tscompile_main
from tscompile.models import Transformer
from tscompile.models.hf_transformers import TransformersModel
from helpers import one_thread_fixture, record_built_models

pytest.importorskip("transformers")
one_thread = pytest.fixture(autouse=True)(one_thread_fixture)

WORKLOAD = ["--model", "llama-tiny", "--device", "cpu", "--input-len", "8", "--output-len", "4", "--num-iters", "1",
            "--num-iters-warmup", "1", "--no-progress", "--bandwidth-mib", "16"]
RATIO_HEADING = "### transformers backend vs native"


class UncompiledStaticRunner(workloads.StaticCacheRunner):
    """The static-cache baseline without its torch.compile (seconds of Inductor on this CPU): these
    tests are about which rows run and how they are labelled, not about the baseline's compile."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, compiled=False, **kwargs)


def _section(md: str, heading: str) -> str:
    """The markdown under ``heading`` up to the next heading."""
    return md.split(heading, 1)[1].split("\n### ", 1)[0]


@pytest.fixture(scope="module")
def both_run(tmp_path_factory) -> tuple[dict, str, list, str]:
    """One bench run of eager and a static-cache baseline with both implementations (given in the
    other order than they run): its JSON, markdown, the engines it built, and the JSON's path."""
    mp = pytest.MonkeyPatch()
    try:
        built = record_built_models(mp)
        mp.setattr(workloads, "StaticCacheRunner", UncompiledStaticRunner)
        folder = tmp_path_factory.mktemp("impls")
        out_json, out_md = folder / "both.json", folder / "both.md"
        argv = ["bench", *WORKLOAD, "--batch-size", "1", "2", "--prefill-lens", "8", "16",
                "--modes", "eager", "compile-default", "--model-impl", "transformers", "native",
                "--output-json", str(out_json), "--output-md", str(out_md)]
        assert tscompile_main(argv) == 0
    finally:
        mp.undo()
    return json.loads(out_json.read_text()), out_md.read_text(), built, str(out_json)


def test_both_implementations_run_in_one_process_with_their_own_labels(both_run):
    result, md, built, _ = both_run
    # native first, whatever order --model-impl named them in; the baseline once, with the native model
    assert result["args"]["model_impl"] == ["native", "transformers"]
    assert result["modes_run"] == ["eager", "eager+transformers", "compile-default"]
    assert [type(m) for m in built] == [Transformer, TransformersModel]
    assert result["modes"]["eager"]["model_impl"] == "native"
    assert result["modes"]["eager+transformers"]["model_impl"] == "transformers"
    assert "model_impl" not in result["modes"]["compile-default"]
    # one set of weights: the transformers checkpoint is written from the same seeded model
    prints = {m: info["weights_fingerprint"] for m, info in result["modes"].items()}
    assert len(set(prints.values())) == 1, prints
    assert sorted((r["mode"], r["batch_size"]) for r in result["results"]) == sorted(
        (m, bs) for m in result["modes_run"] for bs in (1, 2))
    assert sorted((p["mode"], p["prompt_len"]) for p in result["prefill"]) == sorted(
        (m, n) for m in result["modes_run"] for n in (8, 16))
    assert all(r["error"] is None for r in result["results"] + result["prefill"])
    # eager of either implementation compiles nothing: its compile time is 0, not unknown
    assert [r["compile_s"] for r in result["results"] if r["mode"].startswith("eager")] == [0.0] * 4
    # every table names the transformers rows by their label
    assert "| eager+transformers | 2 | " in _section(md, "### Decode")
    assert "| eager+transformers | 16 | " in _section(md, "### Prefill")
    assert "| eager+transformers | " in _section(md, "### Compiles per mode")


def test_both_implementations_pass_the_float32_reference_check(both_run):
    result, md, _, _ = both_run
    for row in result["results"]:
        check = row["reference_check"]
        assert check["agrees"] is True and check["compared_tokens"] == 4, (row["mode"], check)
        assert row["tokens_req0"] == result["reference"]["runs"][str(row["batch_size"])]["tokens"]
        if row["mode"] != "compile-default":  # engine rows: their float32 log-probabilities too
            assert check["max_logprob_diff"] < 1e-4, (row["mode"], check)
        # the transformers rows are compared with their own implementation's eager rows
        assert row["match_eager"] == f"{row['batch_size']}/{row['batch_size']}"
    assert "| eager+transformers | 2 | " in md and "FAIL" not in _section(md, "### Decode")


def _expected_ratios(result: dict) -> list[float]:
    tpot = {(r["mode"], r["batch_size"]): r["tpot_ms_median"] for r in result["results"]}
    prefill = {(p["mode"], p["prompt_len"]): p["prefill_ms"] for p in result["prefill"]}
    return ([tpot[("eager+transformers", bs)] / tpot[("eager", bs)] for bs in (1, 2)]
            + [prefill[("eager+transformers", n)] / prefill[("eager", n)] for n in (8, 16)])


def _ratio_rows(md: str) -> dict[str, list[str]]:
    section = _section(md, RATIO_HEADING)
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| mode |")]
    return {cells[0]: cells[1:] for cells in rows}


def test_the_report_gives_transformers_time_over_native_time(both_run):
    result, md, _, _ = both_run
    assert RATIO_HEADING in md
    assert "| mode | decode bs=1 | decode bs=2 | prefill 8 | prefill 16 |" in _section(md, RATIO_HEADING)
    ratios = _expected_ratios(result)
    # one row per engine mode run both ways; the baseline ran once and has none
    assert _ratio_rows(md) == {"eager": [f"{r:.3f}" for r in ratios]}
    worst = max(ratios)
    names = ["decode bs=1", "decode bs=2", "prefill 8", "prefill 16"]
    assert f"Largest ratio: {worst:.3f} (eager {names[ratios.index(worst)]})" in md


def test_merge_and_plot_keep_the_labels_and_the_ratio(both_run, tmp_path, monkeypatch):
    """The run's two implementations taken from it as two selections of a merge: the merged report has
    the same ratios, and the plot a line per label."""
    import matplotlib.figure

    result, md, _, path = both_run
    legends = []
    real_savefig = matplotlib.figure.Figure.savefig

    def recording_savefig(fig, *args, **kwargs):
        legends.append(fig.axes[0].get_legend_handles_labels()[1])
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording_savefig)
    out_json, out_md = tmp_path / "merged.json", tmp_path / "merged.md"
    assert tscompile_main(["bench", "--merge", f"{path}:eager", f"{path}:eager+transformers,compile-default",
                           "--output-json", str(out_json), "--output-md", str(out_md),
                           "--plot", str(tmp_path / "decode.png")]) == 0
    merged = json.loads(out_json.read_text())
    assert merged["modes_run"] == result["modes_run"]
    assert _ratio_rows(out_md.read_text()) == _ratio_rows(md)
    assert legends == [["eager", "eager+transformers", "compile-default", "roofline"]]


def test_one_implementation_keeps_the_modes_names(tmp_path, monkeypatch):
    built = record_built_models(monkeypatch)
    out_json, out_md = tmp_path / "one.json", tmp_path / "one.md"
    argv = ["bench", *WORKLOAD, "--batch-size", "1", "--prefill-lens", "8", "--modes", "eager", "--model-impl",
            "transformers", "--output-json", str(out_json), "--output-md", str(out_md)]
    assert tscompile_main(argv) == 0
    result, md = json.loads(out_json.read_text()), out_md.read_text()
    assert result["args"]["model_impl"] == "transformers"  # recorded as a one-value run always was
    assert result["modes_run"] == ["eager"] and [type(m) for m in built] == [TransformersModel]
    assert [r["mode"] for r in result["results"] + result["prefill"]] == ["eager", "eager"]
    assert "model_impl" not in result["modes"]["eager"]
    assert RATIO_HEADING not in md and "+transformers" not in md


def test_match_eager_compares_a_row_with_its_own_implementations_eager():
    """In a lower dtype the two implementations may decode differently: a transformers row's match_eager
    counts agreement with eager+transformers, a native row's (and a baseline's) with eager."""
    bench = bench_cli.Bench.__new__(bench_cli.Bench)
    bench.args = argparse.Namespace(margin_threshold=0.5, model_impl=["native", "transformers"])
    bench.impls, bench.dtype = ["native", "transformers"], torch.bfloat16
    bench.references, bench.logprobs, bench.reference_info = {}, {}, {}
    native, transformers = [[1, 2], [3, 4], [5, 6]], [[1, 2], [3, 9], [5, 9]]
    bench.tokens = {("eager", 3): native, ("eager+transformers", 3): transformers,
                    ("tscompile-torch", 3): native, ("tscompile-torch+transformers", 3): [[1, 2], [3, 9], [5, 6]],
                    ("compile-default", 3): [[1, 2], [3, 4], [0, 0]]}
    bench.results = [{"mode": mode, "batch_size": bs} for mode, bs in bench.tokens]
    bench.mark_agreement()
    assert {r["mode"]: r["match_eager"] for r in bench.results} == {
        "eager": "3/3", "eager+transformers": "3/3", "tscompile-torch": "3/3",
        "tscompile-torch+transformers": "2/3", "compile-default": "2/3"}


def test_labels_of_one_and_of_several_implementations():
    modes = ["eager", "compile-default", "tscompile-triton", "package"]
    for value in ("auto", ["native"], ["transformers"]):
        args = argparse.Namespace(model_impl=value)
        assert impls.labelled_modes(modes, impls.check_model_impls(args)) == modes
        assert isinstance(args.model_impl, str)
    args = argparse.Namespace(model_impl=["transformers", "native"])
    several = impls.check_model_impls(args)
    assert several == args.model_impl == ["native", "transformers"]
    labels = impls.labelled_modes(modes, several)
    assert labels == ["eager", "eager+transformers", "compile-default", "tscompile-triton",
                      "tscompile-triton+transformers", "package"]
    assert [impls.split_label(m, several) for m in labels] == [
        ("eager", "native"), ("eager", "transformers"), ("compile-default", "native"),
        ("tscompile-triton", "native"), ("tscompile-triton", "transformers"), ("package", "native")]
    assert impls.split_label("tscompile-triton", ["transformers"]) == ("tscompile-triton", "transformers")
    assert impls.same_impl("tscompile-triton+transformers", "eager") == "eager+transformers"
    assert impls.same_impl("compile-default", "eager") == "eager"


@pytest.mark.parametrize("extra, match", [
    (["--model-impl", "native", "native"], "--model-impl native native names native more than once"),
    (["--model-impl", "auto", "transformers"], "--model-impl auto transformers: auto stands for one"),
    (["--model-impl", "native", "transformers", "--modes", "compile-default"],
     "this run measures none of them (modes ['compile-default']); add one to --modes"),
    (["--model-impl", "native", "transformers", "--hf-model", "llama-tiny"],
     "--model-impl native transformers picks the engine modes' model code; the --hf-model bench runs no engine"),
    (["--model-impl", "native", "transformers", "--merge", "a.json", "b.json"], "; --merge runs nothing"),
    (["--model-impl", "native", "transformers", "--speculative", "ngram"], "; --speculative runs the native model"),
    (["--model-impl", "native", "transformers", "--prefix-workload", "shared"], "; --prefix-workload runs the native"),
])
def test_several_implementations_are_refused_where_nothing_runs_them(extra, match, monkeypatch, capsys):
    """Refused up front (the CLI prints the refusal and exits 2), before a model, an engine or another
    bench part exists."""
    from tscompile.bench import hf_model, merge, prefix_workload, spec_workload

    monkeypatch.setattr(bench_cli.Bench, "__init__", lambda *a, **k: pytest.fail("a model was built"))
    for module in (hf_model, merge, prefix_workload, spec_workload):
        monkeypatch.setattr(module, "run", lambda *a, **k: pytest.fail("another bench part ran"))
    assert tscompile_main(["bench", "--device", "cpu", "--no-progress", *extra]) == 2
    assert re.search(r"^tscompile: .*" + re.escape(match), capsys.readouterr().err, re.MULTILINE)
