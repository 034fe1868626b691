"""What every rank does to join an engine: build its shard, then learn whether every rank did."""

from __future__ import annotations

import traceback

from tscompile.distributed.group import RankGroup
from tscompile.runtime.build import EngineParts, build_model_engine


def build_rank(model, build_kwargs: dict, group: RankGroup) -> tuple[EngineParts | None, Exception | None]:
    """This rank's parts, or the error that stopped it (for ``exchange_build_errors``)."""
    try:
        return build_model_engine(model, **{**build_kwargs, "device": group.device}, tensor_parallel=group.tp), None
    except Exception as exc:  # noqa: BLE001 - every rank learns of it (exchange_build_errors); rank 0 raises it
        return None, exc


def exchange_build_errors(group: RankGroup, error: Exception | None) -> list[str]:
    """Every rank's build error, as ``"rank r: traceback"`` (empty when all built): no rank serves a
    group one of whose ranks has no engine."""
    text = None if error is None else f"rank {group.rank}: {format_exception(error)}"
    return [e for e in group.exchange(text) if e is not None]


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).strip()
