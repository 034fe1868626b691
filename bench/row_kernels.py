"""The kernel tables of a bench's measured rows (``--kernel-table``): one more run of a decode row's
batch, or more bs=1 prefills of a prefill row's prompt, under ``torch.profiler``
(``kernel_table.py`` turns the profile into the table). A profiling failure leaves the row's timed
figures standing: the table carries the error."""

from __future__ import annotations

import argparse
import traceback
from typing import Callable

import torch

from . import kernel_table, report


def guarded_table(build: Callable[[], dict], verbose: bool) -> dict:
    """``build()``'s table, or ``{"error": ...}`` where it raised (the traceback too with ``verbose``)."""
    try:
        return build()
    except Exception as e:  # noqa: BLE001
        if verbose:
            traceback.print_exc()
        return {"error": report.error_text(e)}


def decode_kernel_table(runner, prompts: list[list[int]], row: dict, args: argparse.Namespace,
                        device: torch.device, dtype: torch.dtype) -> dict:
    """One more run of the row's batch, profiling ``--kernel-table-steps`` decode steps from the
    middle of its decode (the mean context the roofline's bytes assume)."""
    steps = row["decode_steps_per_iter"]
    if steps < 1:
        return {"error": "no decode step to profile"}
    count = min(args.kernel_table_steps, steps)
    window = kernel_table.StepWindow(device.type, (steps - count) // 2, count)
    try:
        runner.run_batch(prompts, args.output_len, window=window)
    finally:
        window.finish()
    if window.steps < 1:
        return {"error": "the profiled run had no decode step in its window"}
    stats = kernel_table.stats_of(window.prof, device.type, dtype.itemsize)
    return kernel_table.table(stats, window.steps, device.type, args.kernel_table_top, row["step_bytes"],
                              kernel_table.timeline_of(window.prof, device.type))


def prefill_kernel_table(runner, prompt: list[int], args: argparse.Namespace, device: torch.device,
                         dtype: torch.dtype) -> dict:
    """``--kernel-table-steps`` bs=1 prefills of ``prompt``, profiled whole."""
    prof = kernel_table.profile_calls(lambda: runner.run_prefill(prompt), args.kernel_table_steps, device.type)
    stats = kernel_table.stats_of(prof, device.type, dtype.itemsize)
    # a prefill is bound by its FLOPs, not its bytes: no step bandwidth (its TFLOP/s is in the row)
    return kernel_table.table(stats, args.kernel_table_steps, device.type, args.kernel_table_top,
                              timeline=kernel_table.timeline_of(prof, device.type))
