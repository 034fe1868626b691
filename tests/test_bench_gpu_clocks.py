"""The bench's GPU clock record (bench/gpu_clocks.py): parsing nvidia-smi's samples, the sampler's
subprocess (a fake nvidia-smi on PATH), and the column the decode and prefill tables show."""

from __future__ import annotations

import os
import stat
import time

import torch

from tscompile.bench import gpu_clocks, report


def test_summary_counts_power_capped_samples_and_skips_unreadable_lines():
    lines = ["1980, 140.5, 0x0000000000000000", "1575, 503.2, 0x0000000000000004", "[N/A], [N/A], [N/A]",
             "1545, 498.0, 0x0000000000000004", "", "1600, 480.0", "1700, 450.0, 0x0000000000000008"]
    s = gpu_clocks.summarize(lines)
    assert s["samples"] == 4
    assert s["sm_mhz_median"] == 1637.5  # of 1980, 1575, 1545, 1700
    assert s["sm_mhz_min"] == 1545 and s["power_w_max"] == 503.2
    assert s["power_capped_share"] == 0.5 and s["hw_slowdown_share"] == 0.25
    assert gpu_clocks.summarize(["garbage", "[N/A], 1, 0x0"]) is None


def test_sampler_reads_a_running_nvidia_smi_and_stops_it(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    args_file = tmp_path / "args"
    fake.write_text("#!/bin/sh\n"
                    f"echo \"$@\" > {args_file}\n"
                    "echo '1980, 150.0, 0x0000000000000000'\n"
                    "echo '1560, 500.0, 0x0000000000000004'\n"
                    "exec sleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with gpu_clocks.ClockSampler(torch.device("cuda:1")) as sampler:
        deadline = time.monotonic() + 10
        while os.fstat(sampler._file.fileno()).st_size < 60 and time.monotonic() < deadline:
            time.sleep(0.01)  # until the fake has printed both samples
    assert sampler._proc.poll() is not None, "the sampler left nvidia-smi running"
    assert sampler.summary["samples"] == 2 and sampler.summary["sm_mhz_min"] == 1560
    assert sampler.summary["power_capped_share"] == 0.5
    assert "-i 5" in args_file.read_text()  # torch's cuda:1 is the second visible GPU


def test_sampler_is_a_no_op_off_cuda():
    with gpu_clocks.ClockSampler(torch.device("cpu")) as sampler:
        pass
    assert sampler.summary is None and sampler._proc is None


def test_tables_show_the_clocks_column():
    capped = {"gpu_clocks": {"sm_mhz_median": 1575.0, "sm_mhz_min": 1545.0, "power_capped_share": 0.98}}
    free = {"gpu_clocks": {"sm_mhz_median": 1980.0, "sm_mhz_min": 1980.0, "power_capped_share": 0.0}}
    assert report.clocks_cell(capped) == "1575 (1545), 98%"
    assert report.clocks_cell(free) == "1980 (1980)"
    assert report.clocks_cell({}) == "-" and report.clocks_cell({"gpu_clocks": None}) == "-"
    row = {"mode": "tscompile-triton", "prompt_len": 2048, "prefill_ms": 48.3, "prefill_ms_min": 48.0,
           "prefill_ms_max": 49.0, **capped}
    md = report.prefill_table([row])
    assert "| SM MHz (min), power-capped |" in md and "| 1575 (1545), 98% |" in md
    assert "SM MHz (min), power-capped" in report.DECODE_HEADER
