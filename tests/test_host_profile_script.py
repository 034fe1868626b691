"""scripts/host_profile.py: the cProfile lists of a prefill and a decode run of the bench engine."""

import importlib.util
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "host_profile.py"
_spec = importlib.util.spec_from_file_location("host_profile_script", _SCRIPT)
host_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_profile)


def test_profiles_cover_the_engine_step_of_each_phase(tmp_path, capsys):
    assert host_profile.main(["--model", "llama-tiny", "--device", "cpu", "--prefills", "2", "--decode-tokens", "4",
                              "--top", "300", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "prefill of 32 tokens: median" in printed and "decode:" in printed
    for phase in ("prefill", "decode"):
        text = (tmp_path / f"{phase}.txt").read_text()
        assert "runtime/engine.py" in text and "(step)" in text, text[:2000]
        assert (tmp_path / f"{phase}.prof").stat().st_size > 0
    # the CPU engine's prefill runs its compiled pieces
    assert "_run_pieces" in (tmp_path / "prefill.txt").read_text()
