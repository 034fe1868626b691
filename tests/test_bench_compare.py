"""``tscompile bench --compare BEFORE.json AFTER.json``: per row the ratio after / before and whether
the first request's tokens changed; exit 1 on a row slower than the tolerance or changed tokens."""

from __future__ import annotations

import copy
import json

import pytest

from tscompile.bench import compare as bench_compare
from tscompile.cli import main as tscompile_main
from helpers import one_thread_fixture

one_thread = pytest.fixture(autouse=True)(one_thread_fixture)

WORKLOAD = ["--model", "llama-tiny", "--device", "cpu", "--input-len", "8", "--output-len", "4", "--prefill-lens", "8",
            "--num-iters", "1", "--num-iters-warmup", "1", "--no-progress", "--bandwidth-mib", "16"]


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("compare") / "eager.json"
    assert tscompile_main(["bench", *WORKLOAD, "--modes", "eager", "--batch-size", "1", "2",
                           "--output-json", str(path)]) == 0
    return json.loads(path.read_text())


def _scaled(run: dict, decode: float, prefill: float) -> dict:
    """The run with every decode row's TPOT median times ``decode`` and every prefill time times ``prefill``."""
    other = copy.deepcopy(run)
    for row in other["results"]:
        row["tpot_ms_median"] *= decode
    for row in other["prefill"]:
        row["prefill_ms"] *= prefill
    return other


def _cli(tmp_path, before: dict, after: dict, *extra: str) -> tuple[int, str, dict]:
    a, b = tmp_path / "before.json", tmp_path / "after.json"
    a.write_text(json.dumps(before))
    b.write_text(json.dumps(after))
    out_json, out_md = tmp_path / "c.json", tmp_path / "c.md"
    rc = tscompile_main(["bench", "--compare", str(a), str(b), *extra, "--output-json", str(out_json),
                         "--output-md", str(out_md)])
    return rc, out_md.read_text(), json.loads(out_json.read_text())


def test_rows_within_the_tolerance_pass_and_every_row_is_listed(tmp_path, eager_run):
    rc, md, result = _cli(tmp_path, eager_run, _scaled(eager_run, 1.02, 0.99))
    assert rc == 0
    rows = {tuple(r["key"]): r for r in result["compare"]["rows"]}
    assert set(rows) == {("decode", "eager", 1), ("decode", "eager", 2), ("prefill", "eager", 8)}
    assert rows[("decode", "eager", 2)]["ratio"] == pytest.approx(1.02)
    assert all(r["verdict"] == "within" for r in rows.values())
    assert rows[("decode", "eager", 1)]["tokens_equal"] is True and rows[("prefill", "eager", 8)]["tokens_equal"] is None
    assert "| eager decode bs 2 |" in md and "| 1.020 | within | same |" in md and "| eager prefill 8 tokens |" in md


def test_a_slower_row_fails_and_a_faster_one_is_marked(tmp_path, eager_run):
    rc, md, result = _cli(tmp_path, eager_run, _scaled(eager_run, 1.05, 0.9))
    assert rc == 1
    verdicts = {tuple(r["key"])[0]: r["verdict"] for r in result["compare"]["rows"]}
    assert verdicts == {"decode": "slower", "prefill": "faster"}
    assert "**slower**" in md
    rc, _, _ = _cli(tmp_path, eager_run, _scaled(eager_run, 1.05, 1.0), "--compare-tolerance", "0.1")
    assert rc == 0


def test_changed_tokens_fail(tmp_path, eager_run):
    after = copy.deepcopy(eager_run)
    after["results"][0]["tokens_req0"] = [t + 1 for t in after["results"][0]["tokens_req0"]]
    rc, md, _ = _cli(tmp_path, eager_run, after)
    assert rc == 1 and "**changed**" in md


def test_runs_of_another_workload_and_bad_tolerances_are_refused(eager_run):
    other = copy.deepcopy(eager_run)
    other["args"]["seed"] = 1
    with pytest.raises(ValueError, match="^tscompile: --compare needs runs of one workload.*--seed"):
        bench_compare.merge.check_same(eager_run, other, "a.json", "b.json", flag="--compare")
    with pytest.raises(ValueError, match=r"^tscompile: --compare-tolerance 1.5 is not a fraction in \(0, 1\)"):
        bench_compare.compare(eager_run, eager_run, 1.5)
