"""scripts/verify_host_phases.py: the host phases of a plain decode step and of a verify step."""

import importlib.util
import re
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "verify_host_phases.py"
_spec = importlib.util.spec_from_file_location("verify_host_phases_script", _SCRIPT)
verify_host_phases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(verify_host_phases)


def _section(printed: str, title: str) -> dict[str, tuple[float, float]]:
    """``{phase: (median us, calls per step)}`` of one printed section."""
    block = printed.split(f"\n{title}:", 1)[1].split("\n\n", 1)[0]
    return {m[1]: (float(m[2]), float(m[3]))
            for m in re.finditer(r"^  (.+?)\s+([\d.]+) \(([\d.]+) calls", block, re.M)}


def test_each_step_phase_is_timed_once_per_step_for_plain_and_replay(capsys):
    assert verify_host_phases.main(["--model", "llama-tiny", "--device", "cpu", "--output-len", "9"]) == 0
    printed = capsys.readouterr().out
    plain, replay = _section(printed, "plain decode"), _section(printed, "replay k=3")
    assert "plain decode: 8 decode steps" in printed
    assert plain["staging.fill"][1] == 1.0 and plain["refresh_decode_metadata"][1] == 1.0
    assert "VerifyStep.run" not in plain and "drafter.propose" not in plain
    # every draft accepted: 8 tokens after the first in two windows of 4
    assert "replay k=3: 2 decode steps" in printed
    for phase in ("VerifyStep.run", "drafter.propose", "launch_verify", "staging.fill_verify"):
        assert replay[phase][1] == 1.0, (phase, replay)
    assert 0 < replay["VerifyStep.run less the wait"][0] <= replay["VerifyStep.run"][0] <= replay["step"][0]
