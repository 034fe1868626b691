"""``tscompile bench --kernel-variants``: each compiled engine mode again per KernelPolicy variant in
the same process, its rows labelled ``<mode>@<name>``, its options the run's with the variant's
kernel fields laid over them, and a markdown table of each variant's time over its mode's."""

from __future__ import annotations

import json
import re

import pytest

import tscompile
from tscompile.bench import runner as bench_runner
from tscompile.bench import variants
from tscompile.cli import main as tscompile_main

RUN = ["bench", "--model", "llama-tiny", "--device", "cpu", "--batch-size", "1", "--input-len", "6",
       "--output-len", "3", "--prefill-lens", "6", "--num-iters", "1", "--num-iters-warmup", "0", "--no-progress",
       "--bandwidth-mib", "16", "--no-reference"]


def test_each_variant_runs_its_mode_again_with_its_kernels_over_the_runs_options(tmp_path, monkeypatch):
    """Engines are recorded, then stopped (an error row), so nothing compiles: the eager mode runs
    once with no options, the compiled mode once with the run's options and once per variant with
    the variant's fields laid over the run's kernels, each right after the mode."""
    seen = []

    def recording_llm(model, **kw):
        seen.append(kw.get("compile_options"))
        raise RuntimeError("recorded")

    monkeypatch.setattr(tscompile, "LLM", recording_llm)
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    argv = [*RUN, "--modes", "eager", "tscompile-torch",
            "--tscompile-options", '{"decode_ladder": [2, 4], "kernels": {"decode_pdl": false}}',
            "--kernel-variants", 'pdl={"decode_pdl": true}', 'state={"state_pdl": true, "chunked_gated_delta": true}',
            "--output-json", str(out_json), "--output-md", str(out_md)]
    assert tscompile_main(argv) == 1  # every row an error row
    assert seen == [None, {"decode_ladder": [2, 4], "kernels": {"decode_pdl": False}},
                    {"decode_ladder": [2, 4], "kernels": {"decode_pdl": True}},
                    {"decode_ladder": [2, 4], "kernels": {"decode_pdl": False, "state_pdl": True,
                                                          "chunked_gated_delta": True}}]
    result = json.loads(out_json.read_text())
    assert result["modes_run"] == ["eager", "tscompile-torch", "tscompile-torch@pdl", "tscompile-torch@state"]
    modes = result["modes"]
    assert modes["tscompile-torch@state"]["kernel_variant"] == {"state_pdl": True, "chunked_gated_delta": True}
    assert "kernel_variant" not in modes["tscompile-torch"] and "kernel_paths" not in modes["eager"]
    # each engine's kernel choices as they applied (the run's, not the defaults')
    assert modes["tscompile-torch@state"]["kernel_paths"]["chunked_gated_delta"] is True
    assert modes["tscompile-torch"]["kernel_paths"]["chunked_gated_delta"] is False


def test_a_variant_row_measures_on_the_cpu_and_gets_its_ratio(tmp_path, capsys):
    """A real run of llama-tiny: the variant's decode and prefill rows measure like the mode's, and
    the markdown's variant table gives their ratio."""
    out_json = tmp_path / "bench.json"
    argv = [*RUN, "--modes", "tscompile-torch", "--kernel-variants", 'nogemv={"decode_gemv": false}',
            "--output-json", str(out_json), "--output-md", str(tmp_path / "bench.md")]
    assert tscompile_main(argv) == 0
    result = json.loads(out_json.read_text())
    rows = {r["mode"]: r for r in result["results"]}
    assert set(rows) == {"tscompile-torch", "tscompile-torch@nogemv"}
    assert all(r["error"] is None and r["tpot_ms_median"] > 0 for r in rows.values())
    assert {r["mode"] for r in result["prefill"] if r["error"] is None} == set(rows)
    stdout = capsys.readouterr().out
    assert "### Kernel variants" in stdout
    ratios = re.findall(r"^\| tscompile-torch@nogemv \| `\{\"decode_gemv\": false\}` \| (decode bs 1|prefill 6) \| "
                        r"[0-9.]+ \| [0-9.]+ \| ([0-9.]+) \|$", stdout, re.MULTILINE)
    assert [row for row, _ in ratios] == ["decode bs 1", "prefill 6"] and all(float(r) > 0 for _, r in ratios)


def test_the_ratio_table_divides_each_variant_row_by_its_modes():
    result = {"args": {"kernel_variants": ['f={"fused_gated_delta": true}']},
              "modes": {"tscompile-triton": {}, "tscompile-triton@f": {"kernel_variant": {"fused_gated_delta": True}}},
              "results": [{"mode": "tscompile-triton", "batch_size": 1, "tpot_ms_median": 2.0},
                          {"mode": "tscompile-triton@f", "batch_size": 1, "tpot_ms_median": 1.5},
                          {"mode": "tscompile-triton@f", "batch_size": 8, "tpot_ms_median": 3.0,
                           "error": "failed"}],
              "prefill": [{"mode": "tscompile-triton", "prompt_len": 32, "prefill_ms": 4.0},
                          {"mode": "tscompile-triton@f", "prompt_len": 32, "prefill_ms": 5.0}]}
    lines = variants.ratio_markdown(result)
    assert '| tscompile-triton@f | `{"fused_gated_delta": true}` | decode bs 1 | 2.000 | 1.500 | 0.750 |' in lines
    assert '| tscompile-triton@f | `{"fused_gated_delta": true}` | prefill 32 | 4.000 | 5.000 | 1.250 |' in lines
    assert not any("decode bs 8" in line for line in lines)  # an error row has no time
    assert variants.ratio_markdown({"args": {}, "modes": {}, "results": [], "prefill": []}) == []


@pytest.mark.parametrize("extra, match", [
    (["--kernel-variants", "fused"], r"'fused' is not NAME=JSON"),
    (["--kernel-variants", 'a b={"state_pdl": true}'], r"is not NAME=JSON"),
    (["--kernel-variants", 'a={"state_pdl": true}', 'a={"decode_pdl": true}'], r"names 'a' twice"),
    (["--kernel-variants", 'a={"state_pd": true}'], r"unknown kernels option\(s\) \['state_pd'\]"),
    (["--kernel-variants", 'a={"state_pdl": 1}'], r"kernels.state_pdl must be True or False"),
    (["--kernel-variants", "a=[1]"], r"must be a JSON object of KernelPolicy fields"),
    (["--kernel-variants", "a={x}"], r"is not JSON"),
    (["--modes", "eager", "--kernel-variants", 'a={"state_pdl": true}'], r"measures none of them"),
    (["--merge", "x.json", "--kernel-variants", 'a={"state_pdl": true}'], r"--merge runs none of them"),
])
def test_bad_variants_are_refused_before_any_model_is_built(extra, match, monkeypatch, capsys):
    monkeypatch.setattr(bench_runner.Bench, "__init__", lambda *a, **k: pytest.fail("a model was built"))
    assert tscompile_main(["bench", "--device", "cpu", "--no-progress", *extra]) == 2
    assert re.search(r"^tscompile: .*" + match, capsys.readouterr().err, re.MULTILINE)


def test_variant_options_lay_the_kernels_over_a_policy_given_as_an_object():
    policy = tscompile.KernelPolicy(decode_pdl=False)
    merged = variants.compile_options({"kernels": policy, "decode_ladder": (1, 2)}, {"state_pdl": True})
    assert merged["decode_ladder"] == (1, 2)
    assert merged["kernels"] == {**policy.as_dict(), "state_pdl": True}
    assert variants.compile_options(None, {"state_pdl": True}) == {"kernels": {"state_pdl": True}}
    assert variants.split("tscompile-triton+transformers@f") == ("tscompile-triton+transformers", "f")
    assert variants.labelled(["eager", "tscompile-triton", "package"], {"a": {}, "b": {}}) == \
        ["eager", "tscompile-triton", "tscompile-triton@a", "tscompile-triton@b", "package"]


def test_a_variants_transformers_rows_pair_with_its_native_rows():
    """--model-impl native transformers with a variant: the impl ratio table pairs
    ``tscompile-triton@f`` with ``tscompile-triton+transformers@f``, as it pairs the modes'."""
    from tscompile.bench import report

    labels = ["tscompile-triton", "tscompile-triton+transformers", "tscompile-triton@f",
              "tscompile-triton+transformers@f"]
    assert variants.labelled(labels[:2], {"f": {}}) == [labels[0], labels[2], labels[1], labels[3]]
    result = {"modes_run": labels, "prefill": [],
              "results": [{"mode": m, "batch_size": 1, "tpot_ms_median": t} for m, t in zip(labels, [1.0, 1.1, 2.0, 2.4])]}
    lines = "\n".join(report.impl_ratio_markdown(result))
    assert "| tscompile-triton | 1.100 |" in lines and "| tscompile-triton@f | 1.200 |" in lines
