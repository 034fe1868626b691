"""``tscompile bench --model-impl native transformers``: the engine modes measured once per model
implementation in one process, their rows told apart by label, and the report's ratio of the two.

With one ``--model-impl`` value a mode's label is the mode (``tscompile-triton``), as it always was.
With several, the native implementation keeps that label and the transformers one gets
``+transformers`` (``tscompile-triton+transformers``): every table, the JSON, ``--merge`` and the
plot key rows by label, so the two stay apart everywhere without a column of their own. The
static-cache baselines and the package mode have no implementation to choose and run once. The
markdown's ratio of the two is ``report.impl_ratio_markdown``.
"""

from __future__ import annotations

import argparse

CHOICES = ("auto", "native", "transformers")
RUN_ORDER = ("native", "transformers")  # several implementations: each engine mode runs in this order
SEPARATOR = "+"  # no mode name holds it


def model_impls(args: argparse.Namespace) -> list[str]:
    """The implementations this run measures: ``args.model_impl`` as one value (a string, as a run
    with one value records it) or several (a list)."""
    value = getattr(args, "model_impl", "auto")
    return [value] if isinstance(value, str) else list(value)


def check_model_impls(args: argparse.Namespace) -> list[str]:
    """Validate ``--model-impl`` and record it as the run will use it: one value as a string (the
    JSON of a one-implementation run is what it always was), several as a list in ``RUN_ORDER``."""
    given = model_impls(args)
    duplicates = sorted({v for v in given if given.count(v) > 1})
    if duplicates:
        raise ValueError(f"tscompile: --model-impl {' '.join(given)} names {', '.join(duplicates)} more than once; "
                         f"name each implementation once, e.g. --model-impl native transformers")
    if len(given) > 1 and "auto" in given:
        raise ValueError(f"tscompile: --model-impl {' '.join(given)}: auto stands for one implementation per model, "
                         f"so it cannot be measured beside another; name them: --model-impl native transformers")
    args.model_impl = given[0] if len(given) == 1 else sorted(given, key=RUN_ORDER.index)
    return model_impls(args)


def refuse_several(args: argparse.Namespace, option: str, why: str) -> None:
    """A bench part that runs no engine mode per implementation refuses several (``why``: what it
    runs instead), rather than measure one of them under a flag that asked for both."""
    given = model_impls(args)
    if len(given) > 1:
        raise ValueError(f"tscompile: --model-impl {' '.join(given)} measures the engine modes once per "
                         f"implementation; {option} {why}: leave --model-impl out")


def is_engine_mode(mode: str) -> bool:
    """The modes whose model code ``--model-impl`` picks: the engine's, eager and compiled."""
    return mode == "eager" or mode.startswith("tscompile-")


def labelled_modes(modes: list[str], impls: list[str]) -> list[str]:
    """The run's modes as labelled rows: each engine mode once per implementation (its runs adjacent,
    so the two compare under the same machine state), every other mode once."""
    if len(impls) == 1:
        return list(modes)
    labels: list[str] = []
    for mode in modes:
        labels += [label(mode, impl) for impl in impls] if is_engine_mode(mode) else [mode]
    return labels


def check_some_engine_mode(modes: list[str], impls: list[str]) -> None:
    """Several implementations and no engine mode to run them: the flag would do nothing."""
    if len(impls) > 1 and not any(is_engine_mode(m) for m in modes):
        raise ValueError(f"tscompile: --model-impl {' '.join(impls)} runs the engine modes (eager, tscompile-*) once "
                         f"per implementation, and this run measures none of them (modes {modes}); add one to --modes")


def label(mode: str, impl: str) -> str:
    """A row's label in a run of several implementations: the native model's is the mode's name."""
    return mode if impl == "native" else f"{mode}{SEPARATOR}{impl}"


def split_label(mode_label: str, impls: list[str]) -> tuple[str, str]:
    """(mode, implementation) of a row label of a run that measures ``impls``."""
    mode, sep, impl = mode_label.partition(SEPARATOR)
    if sep:
        return mode, impl
    return mode, impls[0] if len(impls) == 1 else "native"


def same_impl(mode_label: str, mode: str) -> str:
    """The label of ``mode`` run with ``mode_label``'s implementation (say its eager row)."""
    _, sep, impl = mode_label.partition(SEPARATOR)
    return f"{mode}{sep}{impl}"
