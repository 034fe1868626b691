"""``tscompile bench --merge``: one table from bench runs of the same workload, each row from one run,
and a refusal for runs that did not measure the same thing; ``--compare BEFORE.json AFTER.json``: per
row the ratio after / before and whether the first request's tokens changed, exit 1 on a row slower
than the tolerance or changed tokens. Both read finished runs, so they share one real run here."""

from __future__ import annotations

import copy
import json
import os
import subprocess

import pytest

from tscompile.bench import merge as bench_merge
from tscompile.cli import main as tscompile_main
from helpers import one_thread_fixture

one_thread = pytest.fixture(autouse=True)(one_thread_fixture)

WORKLOAD = ["--model", "llama-tiny", "--device", "cpu", "--input-len", "8", "--output-len", "4", "--prefill-lens", "8",
            "--num-iters", "1", "--num-iters-warmup", "1", "--no-progress", "--bandwidth-mib", "16"]


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory) -> dict:
    """A real eager bench run (bs 1 and 2); the only mode cheap enough to run here."""
    path = tmp_path_factory.mktemp("merge") / "eager.json"
    assert tscompile_main(["bench", *WORKLOAD, "--modes", "eager", "--batch-size", "1", "2",
                           "--output-json", str(path)]) == 0
    return json.loads(path.read_text())


def _as_mode(run: dict, mode: str, *, bandwidth: float) -> dict:
    """The same run's rows under another mode's name and another copy bandwidth: a stand-in for a second
    run of another mode (a compiled mode takes minutes on this CPU); merging never looks at what a mode is."""
    other = copy.deepcopy(run)
    for row in other["results"] + other["prefill"]:
        row["mode"] = mode
    other["modes"] = {mode: other["modes"]["eager"]}
    other["modes_run"] = [mode]
    other["copy_bandwidth_gbps"] = bandwidth
    other["complete"] = False  # cut short before a prefill row it set out to measure
    other["args"] = {**other["args"], "prefill_lens": [*other["args"]["prefill_lens"], 4096]}
    return other


def _write(tmp_path, name: str, result: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(result))
    return str(path)


def test_merge_puts_each_runs_modes_in_one_table_and_names_each_run(tmp_path, eager_run):
    second = _as_mode(eager_run, "compile-default", bandwidth=12345.6)
    a, b = _write(tmp_path, "a.json", eager_run), _write(tmp_path, "b.json", second)
    out_json, out_md = tmp_path / "m.json", tmp_path / "m.md"
    assert tscompile_main(["bench", "--merge", a, b, "--output-json", str(out_json), "--output-md", str(out_md)]) == 0
    merged, md = json.loads(out_json.read_text()), out_md.read_text()
    assert merged["modes_run"] == ["eager", "compile-default"]
    rows = {(r["mode"], r["batch_size"]): r for r in merged["results"]}
    assert set(rows) == {(m, bs) for m in ("eager", "compile-default") for bs in (1, 2)}
    assert rows[("eager", 2)]["tpot_ms_median"] == next(r["tpot_ms_median"] for r in eager_run["results"]
                                                         if r["batch_size"] == 2)
    assert {p["mode"] for p in merged["prefill"]} == {"eager", "compile-default"}
    assert [run["modes"] for run in merged["merged_from"]] == [["eager"], ["compile-default"]]
    assert merged["complete"] is False  # one of the runs was cut short
    assert "| compile-default | 2 |" in md and "| eager | 1 |" in md
    assert "### Runs merged" in md and "`b.json`" in md and "12345.6 GB/s" in md and "partial: cut short" in md
    assert "2 runs merged" in md and "**Partial run**" in md


def test_merge_refuses_a_row_from_two_runs(tmp_path, eager_run, capsys):
    a, b = _write(tmp_path, "a.json", eager_run), _write(tmp_path, "b.json", eager_run)
    out_md = tmp_path / "m.md"
    assert tscompile_main(["bench", "--merge", a, b, "--output-md", str(out_md)]) == 2
    assert f"tscompile: --merge: eager bs=1 was measured in both {a!r} and {b!r}" in capsys.readouterr().err
    assert not out_md.exists()


def test_a_selection_takes_only_the_named_modes_of_a_run(tmp_path, eager_run, capsys):
    """``RUN.json:MODE`` keeps that run's other modes out: a newer run of one mode merges with an older
    all-mode run's baselines, which the whole older file would refuse (its row of that mode clashes)."""
    both = _as_mode(eager_run, "compile-default", bandwidth=1.0)
    both["results"] += copy.deepcopy(eager_run["results"])  # an all-mode run: eager and compile-default
    both["prefill"] += copy.deepcopy(eager_run["prefill"])
    both["modes"]["eager"] = eager_run["modes"]["eager"]
    both["modes_run"] = ["compile-default", "eager"]
    newer = _write(tmp_path, "newer.json", eager_run)
    older = _write(tmp_path, "older.json", both)
    assert tscompile_main(["bench", "--merge", newer, older]) == 2  # eager measured in both
    assert "eager bs=1 was measured in both" in capsys.readouterr().err
    out_json = tmp_path / "m.json"
    assert tscompile_main(["bench", "--merge", newer, f"{older}:compile-default", "--output-json", str(out_json)]) == 0
    merged = json.loads(out_json.read_text())
    assert [run["modes"] for run in merged["merged_from"]] == [["eager"], ["compile-default"]]
    assert merged["merged_from"][1]["source"] == f"{older}:compile-default"
    eager_rows = [r for r in merged["results"] if r["mode"] == "eager"]
    assert [r["tpot_ms_median"] for r in eager_rows] == [r["tpot_ms_median"] for r in eager_run["results"]]
    assert tscompile_main(["bench", "--merge", newer, f"{older}:compile-max"]) == 2
    assert f"tscompile: --merge {older!r}: no mode compile-max in that run (it ran compile-default, eager)" in \
        capsys.readouterr().err


@pytest.mark.parametrize("arg, want", [
    ("a.json", ("a.json", None)),
    ("runs/a.json:eager", ("runs/a.json", ["eager"])),
    ("a.json:compile-default, eager", ("a.json", ["compile-default", "eager"])),
    ("c:/runs/a.json", ("c:/runs/a.json", None)),  # a colon inside the path is no selection
])
def test_a_selection_is_parsed_from_the_file_argument(arg, want):
    assert bench_merge.split_selection(arg) == want


def test_a_modes_rows_may_come_from_two_runs_and_the_table_says_which(tmp_path, eager_run):
    """A cut-short run's missing rows measured by a later run of the same mode: each row from the run
    that measured it, and the runs list says which rows each run gave."""
    first, second = copy.deepcopy(eager_run), copy.deepcopy(eager_run)
    first["results"] = [r for r in first["results"] if r["batch_size"] == 1]
    first["prefill"] = []
    second["results"] = [r for r in second["results"] if r["batch_size"] == 2]
    for row in second["results"]:
        row["tpot_ms_median"] = 123.0  # tells the runs' rows apart
    # a row one run failed and the other measured: the measured one stands
    first["results"].append({**second["results"][0], "tpot_ms_median": None, "error": "RuntimeError: cut"})
    merged = bench_merge.merge([first, second], ["first.json", "second.json"])
    assert merged["modes_run"] == ["eager"]
    assert sorted((r["batch_size"], r["tpot_ms_median"], r.get("error")) for r in merged["results"]) == \
        [(1, next(r["tpot_ms_median"] for r in eager_run["results"] if r["batch_size"] == 1), None), (2, 123.0, None)]
    assert [p["prompt_len"] for p in merged["prefill"]] == [8]
    assert [run["rows"] for run in merged["merged_from"]] == [{"eager": "bs 1"}, {"eager": "bs 2; prefill 8"}]
    md = bench_merge.runs_markdown(merged)
    assert "`first.json`" in md and "eager (bs 1)" in md and "eager (bs 2; prefill 8)" in md


@pytest.mark.parametrize("field, value, named", [
    (("args", "input_len"), 16, "--input-len"),
    (("args", "seed"), 1, "--seed"),
    (("env", "torch_version"), "0.0.0", "environment torch_version"),
    (("env", "gpu_name"), "another GPU", "environment gpu_name"),
])
def test_merge_refuses_runs_of_another_workload_or_machine(tmp_path, eager_run, field, value, named):
    other = _as_mode(eager_run, "compile-default", bandwidth=1.0)
    other[field[0]][field[1]] = value
    with pytest.raises(ValueError, match=f"tscompile: --merge needs runs of one workload.*{named}"):
        bench_merge.merge([eager_run, other], ["a.json", "b.json"])


def test_merge_refuses_runs_whose_float32_references_disagree(tmp_path, eager_run):
    other = _as_mode(eager_run, "compile-default", bandwidth=1.0)
    tokens = other["reference"]["runs"]["2"]["tokens"]
    tokens[-1] = tokens[-1] + 1
    with pytest.raises(ValueError, match="float32 reference of bs=2 gives other tokens"):
        bench_merge.merge([eager_run, other], ["a.json", "b.json"])


def test_merge_refuses_a_single_file_and_a_json_that_is_no_bench_run(tmp_path, eager_run, capsys):
    a = _write(tmp_path, "a.json", eager_run)
    assert tscompile_main(["bench", "--merge", a]) == 2
    assert "tscompile: --merge takes at least two bench JSON files" in capsys.readouterr().err
    hf = _write(tmp_path, "hf.json", {"rows": [], "args": {}})
    assert tscompile_main(["bench", "--merge", a, hf]) == 2
    assert "is not a `tscompile bench` JSON" in capsys.readouterr().err


def test_merge_refuses_a_merged_file_other_weights_and_other_reference_settings(tmp_path, eager_run):
    other = _as_mode(eager_run, "compile-default", bandwidth=1.0)
    merged = bench_merge.merge([eager_run, other], ["a.json", "b.json"])
    with pytest.raises(ValueError, match="is itself a merge"):
        bench_merge.load(_write(tmp_path, "m.json", merged))
    assert eager_run["reference"]["weights_fingerprint"] is not None
    other_weights = copy.deepcopy(other)
    other_weights["reference"]["weights_fingerprint"] = "not these weights"
    with pytest.raises(ValueError, match="the weights of 'a.json' and 'b.json' differ"):
        bench_merge.merge([eager_run, other_weights], ["a.json", "b.json"])
    other_margin = copy.deepcopy(other)
    other_margin["args"]["margin_threshold"] = 2.0
    with pytest.raises(ValueError, match="--margin-threshold"):
        bench_merge.merge([eager_run, other_margin], ["a.json", "b.json"])


def test_a_refused_mode_leaves_the_mode_to_the_run_that_measured_it(eager_run):
    refused = copy.deepcopy(eager_run)
    for row in refused["results"] + refused["prefill"]:
        row["error"] = "ValueError: tscompile: refused"
    merged = bench_merge.merge([refused, _as_mode(eager_run, "compile-default", bandwidth=1.0),
                                copy.deepcopy(eager_run)], ["refused.json", "b.json", "good.json"])
    assert merged["modes_run"] == ["compile-default", "eager"]
    assert all(not r.get("error") for r in merged["results"])  # the refused run's rows are left out
    assert [run["modes"] for run in merged["merged_from"]] == [[], ["compile-default"], ["eager"]]


def test_each_run_names_its_source_tree_in_the_merged_table(eager_run):
    from tscompile.bench import environment

    assert eager_run["env"]["source_tree"] == environment.source_tree()
    other = _as_mode(eager_run, "compile-default", bandwidth=1.0)
    other["env"]["source_tree"] = "0123456789ab+dirty"
    md = bench_merge.runs_markdown(bench_merge.merge([eager_run, other], ["a.json", "b.json"]))
    assert "tscompile tree 0123456789ab+dirty" in md
    assert (f"tscompile tree {environment.source_tree()}" if environment.source_tree() else "tscompile tree unknown") in md


def test_each_run_records_its_attention_kernel_switches_and_the_merged_table_names_them(eager_run):
    """A run's env says which kernel choices its engine ran with as they apply on its machine, and a
    merged table names each run's; a run written before the record says nothing."""
    from tscompile import piece_compiler
    from tscompile.kernel_policy import KernelPolicy

    paths = eager_run["env"]["kernel_paths"]
    applied = piece_compiler.applied_kernel_policy(KernelPolicy(), piece_compiler.cuda_device_name())
    assert {k: paths[k] for k in applied} == applied
    other = _as_mode(eager_run, "compile-default", bandwidth=1.0)
    # a run of other code: it recorded a switch this code does not have
    other["env"]["kernel_paths"] = {"decode_write_in_split": False, "fused_decode": False,
                                    "extend_config_overrides": {"128": [128, 64, 8, 3]}}
    older = _as_mode(eager_run, "compile-reduce-overhead", bandwidth=1.0)
    del older["env"]["kernel_paths"]
    md = bench_merge.runs_markdown(bench_merge.merge([eager_run, other, older], ["a.json", "b.json", "c.json"]))
    line_b = next(line for line in md.splitlines() if line.startswith("- `b.json`"))
    assert ('kernel switches `{"decode_write_in_split": false, "extend_config_overrides": {"128": '
            '[128, 64, 8, 3]}, "fused_decode": false}`') in line_b
    assert "kernel switches `{\"batch_gemv\": false, \"chunked_gated_delta\": false, \"decode_gemv\": false, " in \
        next(line for line in md.splitlines() if line.startswith("- `a.json`"))
    assert "kernel switches" not in next(line for line in md.splitlines() if line.startswith("- `c.json`"))


def _git(root, *args):
    out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                         env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                              "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})
    return out.stdout.strip()


def test_content_tree_names_the_files_as_they_are_whatever_the_head(tmp_path):
    """A GPU machine's copy of a checkout can carry an older .git than its files: the content tree is
    the tree of the commit holding exactly the files there, untracked ones included, ignored ones not,
    and the checkout's own index is left as it was."""
    from tscompile.bench import environment

    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    (root / ".gitignore").write_text("*.log\n")
    (root / "a.py").write_text("a = 1\n")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "one")
    assert environment.content_tree(root) == _git(root, "rev-parse", "HEAD^{tree}")[:12]
    assert environment.source_tree(root) == _git(root, "rev-parse", "--short=12", "HEAD")  # clean: the commit alone
    head = _git(root, "rev-parse", "--short=12", "HEAD")
    # a copy that lost a file's execute bit still names the commit; one that only gained a file does not
    os.chmod(root / "a.py", 0o755)
    assert environment.source_tree(root) == head
    (root / "new.py").write_text("n = 1\n")
    assert environment.source_tree(root) == f"{head}+dirty, content tree {environment.content_tree(root)}"
    (root / "new.py").unlink()
    os.chmod(root / "a.py", 0o644)
    # the files move on without the .git: changed and new files, an ignored one
    (root / "a.py").write_text("a = 2\n")
    (root / "b.py").write_text("b = 1\n")
    (root / "run.log").write_text("ignored\n")
    seen = environment.content_tree(root)
    stale_head = _git(root, "rev-parse", "--short=12", "HEAD")
    assert environment.source_tree(root) == f"{stale_head}+dirty, content tree {seen}"
    assert _git(root, "diff", "--cached", "--name-only") == ""  # the checkout's index untouched
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "two")  # the commit that holds these files: the same tree
    assert seen == _git(root, "rev-parse", "HEAD^{tree}")[:12] != _git(root, "rev-parse", "HEAD~1^{tree}")[:12]


def test_content_tree_rehashes_a_same_second_same_size_rewrite(tmp_path):
    """A file rewritten in the second its index entry was written, at the same size, has a stat that
    matches the entry: only git's racy-entry rule (entries not older than the index file are hashed
    again) tells it apart, so the content tree must see the new text, not the cached hash."""
    from tscompile.bench import environment

    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    _git(root, "config", "core.trustctime", "false")  # the rewrite's ctime is the one thing that moved
    old = 1_000_000_000
    (root / "a.py").write_text("a = 1\n")
    os.utime(root / "a.py", (old, old))
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "one")
    index = _git(root, "rev-parse", "--path-format=absolute", "--git-path", "index")
    os.utime(index, (old, old))  # the index written in the same second as the entry
    (root / "a.py").write_text("a = 2\n")
    os.utime(root / "a.py", (old, old))
    seen = environment.content_tree(root)
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "two")
    assert seen == _git(root, "rev-parse", "HEAD^{tree}")[:12] != _git(root, "rev-parse", "HEAD~1^{tree}")[:12]


def test_merged_runs_list_names_each_runs_tscompile_options(eager_run):
    """A run made with --tscompile-options says so in the merged table's list of runs; one without
    does not."""
    from tscompile.bench import merge as bench_merge

    variant = _as_mode(eager_run, "tscompile-torch", bandwidth=eager_run["copy_bandwidth_gbps"])
    variant["args"]["tscompile_options"] = {"decode_ladder": [2, 4]}
    md = bench_merge.runs_markdown(bench_merge.merge([eager_run, variant], ["plain.json", "variant.json"]))
    lines = {line.split("`")[1]: line for line in md.splitlines() if line.startswith("- `")}
    assert 'tscompile options `{"decode_ladder": [2, 4]}`' in lines["variant.json"]
    assert "tscompile options" not in lines["plain.json"]


def test_a_resumed_run_measures_only_the_rows_not_skipped_and_merges_in_size_order(tmp_path, eager_run):
    """A run cut by a time limit, resumed with --skip-decode/--skip-prefill for the rows it finished:
    the resumed run measures only the others (no float32 reference for a skipped batch size), and the
    merge lists each mode's rows in size order although the resumed rows come second."""
    resumed_path = tmp_path / "resumed.json"
    assert tscompile_main(["bench", *WORKLOAD, "--modes", "eager", "--batch-size", "1", "2", "--skip-decode", "2",
                           "--skip-prefill", "8", "--output-json", str(resumed_path)]) == 0
    resumed = json.loads(resumed_path.read_text())
    assert [r["batch_size"] for r in resumed["results"]] == [1] and resumed["prefill"] == []
    assert sorted(resumed["reference"]["runs"]) == ["1"]
    first = copy.deepcopy(eager_run)
    first["results"] = [r for r in first["results"] if r["batch_size"] == 2]  # the first run lost bs=1
    merged = bench_merge.merge([first, resumed], ["first.json", "resumed.json"])
    assert [r["batch_size"] for r in merged["results"]] == [1, 2]
    assert merged["results"][0]["tpot_ms_median"] == resumed["results"][0]["tpot_ms_median"]
    assert [run["rows"] for run in merged["merged_from"]] == [{"eager": "bs 2; prefill 8"}, {"eager": "bs 1"}]
    # two processes compiled the mode: its counters are their sums, its compile time its rows' sum
    first["modes"]["eager"]["compile_stats"]["graphs_compiled"] = 2
    resumed["modes"]["eager"]["compile_stats"]["graphs_compiled"] = 3
    first["results"][0]["compile_s"], resumed["results"][0]["compile_s"] = 10.0, 2.5
    info = bench_merge.merge([first, resumed], ["first.json", "resumed.json"])["modes"]["eager"]
    assert (info["runs"], info["compile_stats"]["graphs_compiled"], info["compile_s"]) == (2, 5, 12.5)
    # and each process's recorded kernel configurations are listed, each naming its run, the first run's
    # first, with a run's error and truncation kept
    first["modes"]["eager"]["autotuned_kernels"] = {"kernels": [{"kernel": "a"}], "graphs": 1, "truncated": 7}
    resumed["modes"]["eager"]["autotuned_kernels"] = {"kernels": [{"kernel": "b"}, {"kernel": "c"}], "graphs": 2,
                                                      "error": "KeyError: 'x'"}
    info = bench_merge.merge([first, resumed], ["runs/first.json", "runs/resumed.json"])["modes"]["eager"]
    assert info["autotuned_kernels"] == {
        "kernels": [{"kernel": "a", "run": "first.json"}, {"kernel": "b", "run": "resumed.json"},
                    {"kernel": "c", "run": "resumed.json"}],
        "graphs": 3, "error": "KeyError: 'x'", "truncated": 9}
    assert "run" not in first["modes"]["eager"]["autotuned_kernels"]["kernels"][0]  # the inputs are not changed
    # the first run was cut short, but the resumed run measured what it lost: the table is whole
    first["complete"] = False
    assert bench_merge.merge([first, resumed], ["first.json", "resumed.json"])["complete"] is True
    # without the resumed run's row it is not
    assert bench_merge.merge([first, {**resumed, "results": [], "args": {**resumed["args"], "batch_size": [2]}}],
                             ["first.json", "other.json"])["complete"] is False


def test_skipping_a_row_the_run_would_not_have_is_refused(tmp_path, capsys):
    assert tscompile_main(["bench", *WORKLOAD, "--modes", "eager", "--batch-size", "1", "--skip-decode", "4",
                           "--output-json", str(tmp_path / "x.json")]) == 2
    assert "tscompile: --skip-decode [4] names rows this run would not have ([1])" in capsys.readouterr().err


# -- --compare ----------------------------------------------------------------------------------------

def _scaled(run: dict, decode: float, prefill: float) -> dict:
    """The run with every decode row's TPOT median times ``decode`` and every prefill time times ``prefill``."""
    other = copy.deepcopy(run)
    for row in other["results"]:
        row["tpot_ms_median"] *= decode
    for row in other["prefill"]:
        row["prefill_ms"] *= prefill
    return other


def _compare(tmp_path, before: dict, after: dict, *extra: str) -> tuple[int, str, dict]:
    a, b = _write(tmp_path, "before.json", before), _write(tmp_path, "after.json", after)
    out_json, out_md = tmp_path / "c.json", tmp_path / "c.md"
    rc = tscompile_main(["bench", "--compare", a, b, *extra, "--output-json", str(out_json),
                         "--output-md", str(out_md)])
    return rc, out_md.read_text(), json.loads(out_json.read_text())


def test_rows_within_the_tolerance_pass_and_every_row_is_listed(tmp_path, eager_run):
    rc, md, result = _compare(tmp_path, eager_run, _scaled(eager_run, 1.02, 0.99))
    assert rc == 0
    rows = {tuple(r["key"]): r for r in result["compare"]["rows"]}
    assert set(rows) == {("decode", "eager", 1), ("decode", "eager", 2), ("prefill", "eager", 8)}
    assert rows[("decode", "eager", 2)]["ratio"] == pytest.approx(1.02)
    assert all(r["verdict"] == "within" for r in rows.values())
    assert rows[("decode", "eager", 1)]["tokens_equal"] is True and rows[("prefill", "eager", 8)]["tokens_equal"] is None
    assert "| eager decode bs 2 |" in md and "| 1.020 | within | same |" in md and "| eager prefill 8 tokens |" in md


def test_each_runs_float32_reference_verdict_is_beside_its_tokens(tmp_path, eager_run):
    """A decode row says where each run's first request leaves the float32 reference; a run without
    the check says nothing."""
    before, after = copy.deepcopy(eager_run), copy.deepcopy(eager_run)
    before["results"][0]["reference_check"] = {"agrees": True, "compared_tokens": 8}
    after["results"][0]["reference_check"] = {"agrees": False, "compared_tokens": 8, "first_divergence": 5,
                                              "margin": 0.0123}
    after["results"][1].pop("reference_check", None)
    before["results"][1].pop("reference_check", None)
    _, md, result = _compare(tmp_path, before, after)
    rows = {tuple(r["key"]): r for r in result["compare"]["rows"]}
    assert rows[("decode", "eager", 1)]["reference_before"] == "agrees"
    assert rows[("decode", "eager", 1)]["reference_after"] == "token 5 (margin 0.0123)"
    assert rows[("decode", "eager", 2)]["reference_before"] is None
    assert "| same | agrees | token 5 (margin 0.0123) |" in md


def test_a_slower_row_fails_and_a_faster_one_is_marked(tmp_path, eager_run):
    rc, md, result = _compare(tmp_path, eager_run, _scaled(eager_run, 1.05, 0.9))
    assert rc == 1
    verdicts = {tuple(r["key"])[0]: r["verdict"] for r in result["compare"]["rows"]}
    assert verdicts == {"decode": "slower", "prefill": "faster"}
    assert "**slower**" in md
    rc, _, _ = _compare(tmp_path, eager_run, _scaled(eager_run, 1.05, 1.0), "--compare-tolerance", "0.1")
    assert rc == 0


def test_changed_tokens_fail(tmp_path, eager_run):
    after = copy.deepcopy(eager_run)
    after["results"][0]["tokens_req0"] = [t + 1 for t in after["results"][0]["tokens_req0"]]
    rc, md, _ = _compare(tmp_path, eager_run, after)
    assert rc == 1 and "**changed**" in md


def test_compare_refuses_runs_of_another_workload_and_a_tolerance_that_is_no_fraction(tmp_path, eager_run, capsys):
    other = copy.deepcopy(eager_run)
    other["args"]["seed"] = 1
    a, b = _write(tmp_path, "a.json", eager_run), _write(tmp_path, "b.json", other)
    assert tscompile_main(["bench", "--compare", a, b]) == 2
    assert "tscompile: --compare needs runs of one workload on one kind of machine: --seed" in capsys.readouterr().err
    assert tscompile_main(["bench", "--compare", a, a, "--compare-tolerance", "1.5"]) == 2
    assert "tscompile: --compare-tolerance 1.5 is not a fraction in (0, 1)" in capsys.readouterr().err
