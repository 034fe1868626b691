"""scripts/apply_gemv_sweep.py: a sweep's one-row picks become decode launch table entries."""

import importlib.util
import json
import shutil
from pathlib import Path

from tscompile.custom_ops import triton_gemv as tg

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "apply_gemv_sweep.py"
_spec = importlib.util.spec_from_file_location("apply_gemv_sweep_script", _SCRIPT)
apply_gemv_sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(apply_gemv_sweep)


def _shape(label, n, k, best, us, cublas_us):
    return label, {"n": n, "k": k, "best_m1": best, "best_m1_us": us, "cublas_m1_us": cublas_us,
                   "speedup_m1": cublas_us / us}


def test_new_picks_are_added_to_a_copy_of_the_table_and_read_back_as_its_entries(tmp_path, capsys):
    listed = next(iter(tg.DECODE_GEMV_CONFIGS))
    summary = dict([
        _shape("m/layers.a.in_proj", 12352, 2048, [1, 2048, 1, 8, 1, "acc"], 7.0, 8.0),   # new, faster: added
        _shape("m/layers.a.out_proj+layers.b.w2", 2048, 4096, [2, 2048, 2, 8, 1, "acc_sum"], 5.0, 6.5),  # added
        _shape("m/output", 151936, 2048, [1, 2048, 1, 8, 1, "acc"], 200.0, 201.0),         # within 2%: not
        _shape("m/listed", *listed, [4, 1024, 1, 8, 1, "acc"], 1.0, 9.0),                   # listed: kept
    ])
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"summary": summary}))
    source = tmp_path / "triton_gemv.py"
    shutil.copy(tg.__file__, source)

    assert apply_gemv_sweep.main([str(sweep), "--source", str(source)]) == 0
    printed = capsys.readouterr().out
    assert f"{listed}: the table keeps {tg.DECODE_GEMV_CONFIGS[listed]}" in printed
    # the edited module's table: the old entries, then the two new ones with their timings
    spec = importlib.util.spec_from_file_location("edited_triton_gemv", source)
    edited = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(edited)
    assert edited.DECODE_GEMV_CONFIGS == {**tg.DECODE_GEMV_CONFIGS, (12352, 2048): (1, 2048, 1, 8, 1, "acc"),
                                          (2048, 4096): (2, 2048, 2, 8, 1, "acc_sum")}
    text = source.read_text()
    assert "# m layers.a.in_proj: 7.0 / 8.0" in text and "# m layers.a.out_proj+layers.b.w2: 5.0 / 6.5" in text
    assert text.replace(printed.split("\n", 1)[1], "") == Path(tg.__file__).read_text()


def test_a_sweep_with_nothing_new_leaves_the_module_as_it_was(tmp_path, capsys):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"summary": dict([_shape("m/output", 151936, 2048, [1, 2048, 1, 8, 1, "acc"],
                                                         10.0, 10.1)])}))
    source = tmp_path / "triton_gemv.py"
    shutil.copy(tg.__file__, source)
    assert apply_gemv_sweep.main([str(sweep), "--source", str(source)]) == 0
    assert "no shape to add" in capsys.readouterr().out
    assert source.read_text() == Path(tg.__file__).read_text()
