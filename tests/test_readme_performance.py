"""The README's performance table against the results file it cites: every figure is that file's,
rounded as the table writes it, a "-" is a row the run has no figure for, and the bold figure of a
row is its best. A table edited by hand, or a rerun copied into the README without its file, fails.
``scripts/readme_performance_table.py`` writes the table from the file."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _performance_section() -> str:
    match = re.search(r"^## Performance\n(.*?)(?=^## )", README, flags=re.M | re.S)
    assert match, "the README has no '## Performance' section"
    return match.group(1)


def _cited_path() -> Path:
    cited = re.findall(r"`(bench/results/[\w.-]+)/results\.md`", _performance_section())
    assert len(cited) == 1, f"the performance section should cite one results file, it cites {cited}"
    return ROOT / cited[0] / "results.json"


def _cited_results() -> dict:
    return json.loads(_cited_path().read_text())


def _table() -> tuple[list[str], list[tuple[str, list[str]]]]:
    lines = [line for line in _performance_section().splitlines() if line.startswith("|")]
    modes = [c.strip() for c in lines[0].strip("|").split("|")][1:]
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells[0], cells[1:]))
    return modes, rows


def _figure(results: dict, label: str, mode: str) -> float | None:
    """The results file's figure for a table row ``label`` and ``mode``, or None without one."""
    if m := re.fullmatch(r"decode bs (\d+)(?:, ms/step)?", label):
        found = [r["tpot_ms_median"] for r in results["results"]
                 if r["mode"] == mode and r["batch_size"] == int(m.group(1)) and r["error"] is None]
    elif m := re.fullmatch(r"prefill (\d+) tokens(?:, ms)?", label):
        found = [r["prefill_ms"] for r in results["prefill"]
                 if r["mode"] == mode and r["prompt_len"] == int(m.group(1)) and r["error"] is None]
    elif label.startswith("compile s"):
        compile_s = results["modes"].get(mode, {}).get("compile_s")  # eager compiles nothing
        found = [] if compile_s is None else [compile_s]
    else:
        raise AssertionError(f"the README's performance table has a row {label!r} this test cannot read")
    assert len(found) <= 1, f"{len(found)} results for {label!r} / {mode}"
    return found[0] if found else None


def test_every_figure_of_the_readme_performance_table_is_its_results_file():
    results = _cited_results()
    modes, rows = _table()
    assert modes and rows
    assert set(modes) <= set(results["modes_run"]), f"table modes {modes}, run modes {results['modes_run']}"
    for label, cells in rows:
        assert len(cells) == len(modes), f"row {label!r} has {len(cells)} cells for {len(modes)} modes"
        for mode, cell in zip(modes, cells):
            value = _figure(results, label, mode)
            written = cell.strip("*")
            if written == "-":
                assert value is None, f"{label} / {mode}: the README says '-', the results file {value}"
                continue
            assert value is not None, f"{label} / {mode}: the README says {written}, the results file has none"
            decimals = len(written.split(".")[1]) if "." in written else 0
            assert f"{value:.{decimals}f}" == written, f"{label} / {mode}: README {written}, results {value:.4f}"


def test_the_bold_figure_of_each_timed_row_is_its_fastest():
    modes, rows = _table()
    for label, cells in rows:
        if label.startswith("compile"):
            continue
        figures = {mode: float(c.strip("*")) for mode, c in zip(modes, cells) if c != "-"}
        bold = [mode for mode, c in zip(modes, cells) if c.startswith("**")]
        assert bold == [min(figures, key=figures.get)], f"row {label!r}: bold {bold}, figures {figures}"


def test_the_table_script_writes_the_readme_table_from_its_results_file(capsys):
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "scripts" / "readme_performance_table.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    _, rows = _table()
    lens = [int(m.group(1)) for label, _ in rows if (m := re.fullmatch(r"prefill (\d+) tokens, ms", label))]
    sizes = [int(m.group(1)) for label, _ in rows if (m := re.fullmatch(r"decode bs (\d+).*", label))]
    assert script.main([str(_cited_path()), "--batch-sizes", *map(str, sizes), "--prefill-lens", *map(str, lens)]) == 0
    readme_lines = [line for line in _performance_section().splitlines() if line.startswith("|")]
    assert capsys.readouterr().out.strip().splitlines() == readme_lines
