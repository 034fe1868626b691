"""``tscompile bench --speculative all``: every method and k against plain decode in one process, on
a tiny eager engine: the same greedy tokens, full acceptance for replay and a self-drafting model,
the verify-step and tokens/s ratios in the report."""

from __future__ import annotations

import argparse
import functools
import json

import torch

import tscompile
from tscompile.bench import spec_workload


def test_methods_of_expands_all_in_bench_order():
    assert spec_workload.methods_of(["all"]) == ["replay", "ngram", "draft_model"]
    assert spec_workload.methods_of(["draft_model", "ngram"]) == ["ngram", "draft_model"]


def test_every_method_equals_plain_decode_and_reports_ratios(tmp_path, monkeypatch, capsys):
    torch.set_num_threads(1)
    monkeypatch.setattr(tscompile, "LLM", functools.partial(tscompile.LLM, enforce_eager=True))
    args = argparse.Namespace(
        device="cpu", dtype="float32", speculative=["all"], num_speculative_tokens="2", spec_requests="2",
        output_len=6, draft_model=None, model="llama-tiny", seed=0, page_size=4, spec_block=4, spec_repeats=3,
        attention_backends=["torch"], tscompile_options=None, output_json=str(tmp_path / "r.json"),
        output_md=str(tmp_path / "r.md"))
    assert spec_workload.run(args) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    rows = result["rows"]
    assert result["env"]["torch_version"] == torch.__version__ and result["date"]
    assert f"torch {torch.__version__}" in (tmp_path / "r.md").read_text()  # where it was measured
    assert [(r["method"], r["k"]) for r in rows] == [("plain", 0), ("replay", 2), ("ngram", 2), ("draft_model", 2)]
    assert all(r["outputs_equal"] for r in rows)
    by = {r["method"]: r for r in rows}
    assert by["replay"]["acceptance_rate"] == by["draft_model"]["acceptance_rate"] == 1.0
    assert by["replay"]["warmup_runs"] == 1  # float32: plain decode's output is already the fixed point
    assert by["replay"]["tokens_per_step"] > 2 and by["plain"]["step_ratio"] == 1.0
    assert all(r["step_ratio"] > 0 and r["ratio_to_plain"] > 0 for r in rows)
    # the verify step's host share: measured for every drafter, within its step; none for plain decode
    assert by["plain"]["verify_host_ms"] is None
    assert all(0 < by[m]["verify_host_ms"] < by[m]["decode_step_ms"] for m in ("replay", "ngram", "draft_model"))
    # of it, the drafter's: a draft model's own steps cost far more than replaying a table
    assert by["plain"]["verify_draft_ms"] is None
    assert all(0 < by[m]["verify_draft_ms"] < by[m]["verify_host_ms"] for m in ("replay", "ngram", "draft_model"))
    assert by["draft_model"]["verify_draft_ms"] > 10 * by["replay"]["verify_draft_ms"]
    md = (tmp_path / "r.md").read_text()
    assert "| 2 | replay | 2 | 3 |" in md and "| host ms of a verify step | of it drafting |" in md
    assert f"| {by['plain']['decode_step_ms']:.3f} | - | - |" in md


def test_the_cli_writes_its_results_into_the_output_dir_by_default(tmp_path, monkeypatch):
    from tscompile.bench import cli

    torch.set_num_threads(1)
    monkeypatch.setattr(tscompile, "LLM", functools.partial(tscompile.LLM, enforce_eager=True))
    assert cli.main(["--model", "llama-tiny", "--device", "cpu", "--speculative", "ngram",
                     "--num-speculative-tokens", "2", "--spec-requests", "1", "--output-len", "4",
                     "--attention-backends", "torch", "--output-dir", str(tmp_path)]) == 0
    written = sorted(p.suffix for p in tmp_path.iterdir())
    assert written == [".json", ".md"]
    rows = json.loads(next(tmp_path.glob("*.json")).read_text())["rows"]
    assert [r["method"] for r in rows] == ["plain", "ngram"]


def _tiny_engine(bs: int, spec=None):
    return tscompile.LLM("llama-tiny", attention_backend="torch", device="cpu", dtype="float32", max_num_seqs=bs,
                         max_model_len=32, page_size=4, seed=0, enforce_eager=True, speculative_config=spec)


def test_replay_settles_on_the_engines_own_output_when_plain_decodes_differs():
    """Plain decode's continuation stands in for a bf16 run whose greedy choice flipped: a reference
    wrong from its third token on. The first warm-up run gives the engine's own tokens, the second
    gives them back, and the measured run accepts every draft."""
    torch.set_num_threads(1)
    prompts = spec_workload.repetitive_prompts(0, 256, 2, 4, 3)
    plain = spec_workload.greedy_run(_tiny_engine(2), prompts, 6, torch.device("cpu"))["outputs"]
    wrong = {tuple(p): o[:2] + [(o[2] + 1) % 256] + o[3:] for p, o in zip(prompts, plain)}
    row = spec_workload._measure(lambda: _tiny_engine(2, {"method": "replay", "num_speculative_tokens": 2}),
                                 prompts, 6, torch.device("cpu"), wrong)
    assert row["warmup_runs"] == 2
    assert row["acceptance_rate"] == 1.0 and row["outputs"] == plain


def test_settle_replay_stops_at_its_run_limit_and_keeps_the_last_output(monkeypatch):
    """An engine whose output never repeats (each run's token moves on): the last run's output is what
    the measured run is handed."""
    handed = []

    class Engine:
        def set_replay_references(self, references):
            handed.append(dict(references))

    def run(llm, prompts, output_len, device):
        return {"outputs": [[len(handed)] * output_len for _ in prompts]}

    monkeypatch.setattr(spec_workload, "greedy_run", run)
    prompts = [[1, 2], [3, 4]]
    assert spec_workload.settle_replay(Engine(), prompts, 3, None, {(1, 2): [0] * 3, (3, 4): [0] * 3},
                                       max_runs=3) == 3
    assert len(handed) == 4 and handed[-1] == {(1, 2): [3] * 3, (3, 4): [3] * 3}


def test_kernel_tables_profile_the_plain_and_the_verify_steps(tmp_path, monkeypatch):
    from tscompile.bench import cli

    torch.set_num_threads(1)
    monkeypatch.setattr(tscompile, "LLM", functools.partial(tscompile.LLM, enforce_eager=True))
    assert cli.main(["--model", "llama-tiny", "--device", "cpu", "--speculative", "replay",
                     "--num-speculative-tokens", "2", "--spec-requests", "1", "--output-len", "8",
                     "--attention-backends", "torch", "--kernel-table", "--kernel-table-steps", "2",
                     "--kernel-table-top", "40", "--output-json", str(tmp_path / "r.json"),
                     "--output-md", str(tmp_path / "r.md")]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["plain", "replay"]
    for r in rows:
        kt = r["kernel_table"]
        assert "error" not in kt, kt
        assert kt["steps"] == 2 and kt["activity"] == "cpu ops (self time)"
        assert kt["kernel_ms_per_step"] > 0 and any(k["name"] == "aten::mm" for k in kt["top"])
    # the verify step runs the acceptance op and no sampling; plain decode the other way round
    plain, verify = ({k["name"] for k in r["kernel_table"]["top"]} for r in rows)
    assert "tscompile::sample" in plain and "tscompile::accept_greedy" not in plain
    assert "tscompile::accept_greedy" in verify and "tscompile::sample" not in verify
    md = (tmp_path / "r.md").read_text()
    assert "### Kernels" in md and "**bs=1 plain N=1**" in md and "**bs=1 replay N=3**" in md


def test_kernel_variants_repeat_every_row_with_their_kernels(tmp_path, monkeypatch):
    """--kernel-variants with --speculative: plain decode and each method run again per variant, the
    engines built with the variant's kernels over the run's options, each row's ratios against its
    own variant's plain decode; the markdown gains a kernels column."""
    torch.set_num_threads(1)
    seen, real = [], tscompile.LLM

    def recording(*a, **kw):
        seen.append(kw.get("compile_options"))
        return real(*a, enforce_eager=True, **kw)

    monkeypatch.setattr(tscompile, "LLM", recording)
    args = argparse.Namespace(
        device="cpu", dtype="float32", speculative=["replay"], num_speculative_tokens="2", spec_requests="1",
        output_len=4, draft_model=None, model="llama-tiny", seed=0, page_size=4, spec_block=4, spec_repeats=2,
        attention_backends=["torch"], tscompile_options={"decode_ladder": [1]},
        kernel_variants=['fv={"fused_verify_attention": true}'], output_json=str(tmp_path / "r.json"),
        output_md=str(tmp_path / "r.md"))
    assert spec_workload.run(args) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [(r["variant"], r["method"]) for r in rows] == [(None, "plain"), (None, "replay"), ("fv", "plain"),
                                                           ("fv", "replay")]
    assert all(r["outputs_equal"] for r in rows) and rows[2]["step_ratio"] == 1.0
    assert seen == [{"decode_ladder": [1]}] * 2 + [{"decode_ladder": [1], "kernels": {"fused_verify_attention": True}}] * 2
    md = (tmp_path / "r.md").read_text()
    assert '| fv `{"fused_verify_attention": true}` | 1 | replay | 2 | 3 |' in md and "| the run's | 1 | plain |" in md
