"""``tscompile bench --kernel-variants NAME=JSON ...``: the compiled engine modes measured once more
per kernel-policy variant, in the same process, each variant's rows right after the mode's own
(with ``--speculative``: every plain and speculative row again per variant, ``spec_workload.py``;
with ``--hf-model``: ``tscompile-split`` again per variant, its ``options["kernels"]`` laid over).

A variant is a name and a dict of ``KernelPolicy`` fields (``'fused={"fused_gated_delta": true}'``)
laid over the run's kernels (its ``--tscompile-options`` ``kernels``, else the defaults). Its rows
carry the label ``<mode>@<name>`` (``tscompile-triton@fused``), so every table, the JSON, ``--merge``
and the plot keep them apart; the markdown gives each variant's time against its mode's. Two
processes of the same code differ by a few percent at some rows (clocks, the allocator, what
Inductor's autotuning picks), so a choice measured against the defaults is measured here, in one
process, where only the policy differs.
"""

from __future__ import annotations

import copy
import json
import re

SEPARATOR = "@"  # no mode name or implementation holds it
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def parse(values: list[str] | None) -> dict[str, dict]:
    """``{name: kernels}`` from ``NAME=JSON`` values, each JSON a dict of ``KernelPolicy`` fields (a
    misspelt field or a non-boolean value is refused here, before any model is built)."""
    from tscompile.kernel_policy import KernelPolicy

    variants: dict[str, dict] = {}
    for value in values or ():
        name, sep, text = value.partition("=")
        if not sep or not _NAME.match(name):
            raise ValueError(f"tscompile: --kernel-variants {value!r} is not NAME=JSON with a NAME of letters, "
                             "digits, '-' or '_'; e.g. 'fused={\"fused_gated_delta\": true}'")
        if name in variants:
            raise ValueError(f"tscompile: --kernel-variants names {name!r} twice; give each variant its own name")
        try:
            kernels = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"tscompile: --kernel-variants {name}: {text!r} is not JSON ({e})") from None
        if not isinstance(kernels, dict) or not kernels:
            raise ValueError(f"tscompile: --kernel-variants {name}: {text!r} must be a JSON object of KernelPolicy "
                             "fields, e.g. {\"state_pdl\": true}")
        KernelPolicy.from_options(kernels)
        variants[name] = kernels
    return variants


def from_args(args) -> dict[str, dict]:
    """``--kernel-variants`` parsed, refused beside a bench part that runs no engine rows."""
    kernel_variants = parse(getattr(args, "kernel_variants", None))
    other = [flag for flag, on in (("--gemv-sweep", args.gemv_sweep), ("--merge", args.merge),
                                   ("--compare", args.compare), ("--prefix-workload", args.prefix_workload)) if on]
    if kernel_variants and other:
        raise ValueError(f"tscompile: --kernel-variants measures the engine's rows (decode and prefill, "
                         f"--speculative's or --hf-model's) once per variant; {other[0]} runs none of them: leave "
                         "one of the two out")
    return kernel_variants


def is_variant_mode(mode: str) -> bool:
    """The modes a variant applies to: the compiled engine's (an eager engine compiles nothing), and
    ``--hf-model``'s split graph (``tscompile-split``)."""
    return mode.startswith("tscompile-")


def labelled(labels: list[str], variants: dict[str, dict]) -> list[str]:
    """The run's row labels with each compiled engine mode's variants right after it (refused where
    none of them is a compiled engine mode)."""
    if variants and not any(is_variant_mode(m) for m in labels):
        raise ValueError(f"tscompile: --kernel-variants runs the compiled tscompile modes once per variant, and "
                         f"this run measures none of them (modes {labels}); add one to --modes (--hf-modes: "
                         "tscompile-split)")
    out: list[str] = []
    for label in labels:
        out.append(label)
        if is_variant_mode(label):
            out += [f"{label}{SEPARATOR}{name}" for name in variants]
    return out


def split(label: str) -> tuple[str, str | None]:
    """(the label without its variant, the variant's name or None)."""
    base, sep, name = label.partition(SEPARATOR)
    return base, (name if sep else None)


def compile_options(options: dict | None, kernels: dict) -> dict:
    """The run's compile options with ``kernels`` laid over their kernel fields."""
    merged = copy.deepcopy(options) if options else {}
    base = merged.get("kernels") or {}
    if not isinstance(base, dict):  # a KernelPolicy given through the Python API
        from dataclasses import asdict

        base = asdict(base)
    merged["kernels"] = {**base, **kernels}
    return merged


def ratio_markdown(result: dict) -> list[str]:
    """Each variant's decode TPOT and prefill time over its mode's, row by row (below 1: faster)."""
    variants = (result.get("args") or {}).get("kernel_variants") or []
    if not variants:
        return []
    lines = ["### Kernel variants", "",
             "Each variant's median against its mode's (the defaults, or --tscompile-options' kernels), "
             "measured in this process: below 1.00 the variant is faster.", "",
             "| variant | kernels | row | mode ms | variant ms | ratio |", "|---|---|---|---|---|---|"]
    decode = {(r["mode"], r["batch_size"]): r.get("tpot_ms_median") for r in result.get("results", [])
              if not r.get("error")}
    prefill = {(r["mode"], r["prompt_len"]): r.get("prefill_ms") for r in result.get("prefill", [])
               if not r.get("error")}
    modes = result.get("modes", {})
    for label, info in modes.items():
        base, name = split(label)
        if name is None:
            continue
        kernels = f"`{json.dumps(info.get('kernel_variant', {}), sort_keys=True)}`"
        for what, times in (("decode bs", decode), ("prefill", prefill)):
            for (mode, n), theirs in sorted((k, v) for k, v in times.items() if k[0] == label):
                ours = times.get((base, n))
                ratio = f"{theirs / ours:.3f}" if theirs and ours else "-"
                lines.append(f"| {label} | {kernels} | {what} {n} | {_ms(ours)} | {_ms(theirs)} | {ratio} |")
    return lines + [""]


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"
