"""The README's performance table against the results file it cites: ``scripts/readme_performance_table.py``
writes the same table from that file (every figure rounded as written, "-" where the run has none,
the bold figure the row's best). A table edited by hand, or a rerun copied into the README without
its file, fails."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

_spec = importlib.util.spec_from_file_location("readme_performance_table",
                                               ROOT / "scripts" / "readme_performance_table.py")
readme_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_table)


def _performance_section() -> str:
    match = re.search(r"^## Performance\n(.*?)(?=^## )", README, flags=re.M | re.S)
    assert match, "the README has no '## Performance' section"
    return match.group(1)


def test_the_readme_performance_table_is_the_one_its_results_file_gives():
    section = _performance_section()
    cited = re.findall(r"`(bench/results/[\w.-]+)/results\.md`", section)
    assert len(cited) == 1, f"the performance section should cite one results file, it cites {cited}"
    result = json.loads((ROOT / cited[0] / "results.json").read_text())
    readme_lines = [line for line in section.splitlines() if line.startswith("|")]
    labels = [line.split("|")[1].strip() for line in readme_lines[2:]]
    sizes = [int(m.group(1)) for label in labels if (m := re.fullmatch(r"decode bs (\d+)(?:, ms/step)?", label))]
    lens = [int(m.group(1)) for label in labels if (m := re.fullmatch(r"prefill (\d+) tokens, ms", label))]
    assert sizes and lens, labels
    assert readme_table.table(result, sizes, lens).splitlines() == readme_lines


def test_the_table_script_marks_the_best_and_the_missing():
    result = {"modes_run": ["a", "b"], "modes": {"a": {"compile_s": 12.34}, "b": {}},
              "results": [{"mode": "a", "batch_size": 1, "tpot_ms_median": 2.0, "error": None},
                          {"mode": "b", "batch_size": 1, "tpot_ms_median": 1.5, "error": None},
                          {"mode": "b", "batch_size": 8, "tpot_ms_median": 9.0, "error": "oom"}],
              "prefill": [{"mode": "a", "prompt_len": 32, "prefill_ms": 1.234, "error": None}]}
    assert readme_table.table(result, [1, 8], [32]).splitlines() == [
        "| | a | b |", "|---|---|---|",
        "| decode bs 1, ms/step | 2.000 | **1.500** |",
        "| decode bs 8 | - | - |",
        "| prefill 32 tokens, ms | **1.23** | - |",
        "| compile s (warm caches) | 12.3 | - |"]
