"""The README's configuration reference against the code: every argument of ``tscompile.LLM``, every
field of ``SamplingParams`` and every backend option of ``TscompileConfig`` has a row, and a row's
default is the code's default wherever the README writes it out in full. The README and docs stay a
users' guide: short, and free of commit hashes and of an account of how the code was built."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

from tscompile.config import TscompileConfig
from tscompile.runtime.engine import LLM
from tscompile.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_README_LINES = 300


def _section(heading: str) -> str:
    """The README text under ``heading`` (a ``###`` line) up to the next heading."""
    match = re.search(rf"^### {re.escape(heading)}\n(.*?)(?=^#)", README, flags=re.M | re.S)
    assert match, f"the README has no section '### {heading}'"
    return match.group(1)


def _rows(heading: str) -> dict[str, tuple[str, str]]:
    """name -> (default cell, meaning cell) of the section's table rows ``| `name` | default | meaning |``."""
    rows = {}
    for line in _section(heading).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = (cells[1], " | ".join(cells[2:]))
    return rows


def _same_default(cell: str, value) -> bool:
    """Whether a README default cell states ``value``: checked for scalars and tuples written out in
    full (a cell with "..." abbreviates, a class default such as ``KernelPolicy()`` names a type)."""
    written = cell.strip("`").replace('"', "'")
    if isinstance(value, (bool, int, float, str, type(None))):
        return written == repr(value)
    if isinstance(value, tuple) and "..." not in written:
        return written == repr(value)
    return True


def _check(heading: str, defaults: dict[str, object]) -> None:
    rows = _rows(heading)
    missing = sorted(set(defaults) - set(rows))
    assert not missing, f"README section '{heading}' lacks rows for {missing}"
    for name, value in defaults.items():
        cell, meaning = rows[name]
        assert meaning, f"README row {name} under '{heading}' says nothing"
        assert _same_default(cell, value), f"README says {name} defaults to {cell}; the code says {value!r}"


def test_every_llm_argument_is_in_the_readme_with_its_default():
    params = [p for p in inspect.signature(LLM.__init__).parameters.values() if p.name != "self"]
    assert len(params) >= 10  # the introspection found the real signature
    _check("`tscompile.LLM(...)`", {p.name: p.default for p in params})


def test_every_sampling_params_field_is_in_the_readme_with_its_default():
    made = SamplingParams()  # the effective defaults (max_new_tokens None means 16)
    defaults = {p.name: p.default for p in inspect.signature(SamplingParams).parameters.values()}
    defaults.update({f.name: getattr(made, f.name) for f in dataclasses.fields(SamplingParams)})
    assert "max_tokens" in defaults and "max_new_tokens" in defaults
    _check("`tscompile.SamplingParams(...)`", defaults)


def test_every_backend_option_is_in_the_readme_with_its_default(monkeypatch):
    monkeypatch.delenv("TSCOMPILE_DEBUG_DIR", raising=False)  # debug_dir's default reads it
    made = TscompileConfig()
    _check("Backend options (`TscompileConfig`)", {f.name: getattr(made, f.name) for f in dataclasses.fields(made)})


@pytest.mark.skipif(importlib.util.find_spec("tscompile.kernel_policy") is None,
                    reason="this tree has no KernelPolicy")
def test_every_kernel_choice_is_in_the_readme_with_its_default():
    from tscompile.kernel_policy import KernelPolicy

    cell = _rows("Backend options (`TscompileConfig`)")["kernels"][1]
    for f in dataclasses.fields(KernelPolicy):
        assert f"`{f.name}` (`{f.default!r}`)" in cell, f"README's kernels row lacks {f.name} (default {f.default!r})"


def test_the_readme_is_a_short_guide_with_the_two_commands():
    assert len(README.splitlines()) <= MAX_README_LINES
    assert 'python3 -m pip install torch==2.13.0 && python3 -m pip install -e ".[dev,demo]" && tscompile generate ' \
           'smollm2-135m-instruct --chat' in README
    assert "python3 -m pytest -q -n 2 --dist loadfile tests" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m pytest -q -n 2 --dist loadfile tests" in ci  # CI runs the README's test command
    for heading in ("## Set up", "## Configuration reference", "## Limits", "## Performance"):
        assert re.search(rf"^{re.escape(heading)}", README, flags=re.M), heading


# a commit hash as the repository's tools print them: 7 to 40 hex digits, letters and digits both
_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
_HISTORY = re.compile(r"\bsessions?\b|\bwas (?:added|removed|fixed) (?:in|at|since)\b", re.I)


def _guides() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "results" / "README.md"]


@pytest.mark.parametrize("path", _guides(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_guides_quote_no_commit_hash_and_tell_no_history(path):
    text = path.read_text()
    assert not _HASH.findall(text), f"{path.name} quotes what looks like a commit hash: {_HASH.findall(text)[:5]}"
    assert not _HISTORY.findall(text), f"{path.name} tells history: {_HISTORY.findall(text)[:5]}"


def test_the_docs_exist():
    for name in ("architecture.md", "performance.md", "torch_compile_users.md"):
        assert (ROOT / "docs" / name).is_file(), name
