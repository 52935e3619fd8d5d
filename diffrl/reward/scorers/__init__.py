"""The scorer registry: importing this package registers the built-in scorers, and
``build_scorer`` makes one by name. A scorer module imports only ``reward/scorer.py`` (the
protocol and the table), so no scorer imports this package back. A task's own scorer
(``shapes``, ``avbench``) lives in its task's package and is registered by ``diffrl.tasks``:
reward/ imports no task.
"""

from __future__ import annotations

from typing import Any

from diffrl.reward.http import client as _http_client  # noqa: F401  (registers "http")
from diffrl.reward.scorer import _SCORERS, Scorer
from diffrl.reward.scorers import clap, clip, compress, imagebind, ocr, vlm  # noqa: F401


def build_scorer(name: str, params: dict[str, Any] | None = None) -> Scorer:
    if name not in _SCORERS:
        raise KeyError(
            f"unknown scorer {name!r}; registered: {sorted(_SCORERS)} (a task's own scorer, "
            "e.g. shapes or avbench, is registered by importing diffrl.tasks)"
        )
    try:
        return _SCORERS[name](**(params or {}))
    except TypeError as e:
        raise ValueError(f"bad params for scorer {name!r}: {e}") from None


def registered_scorers() -> list[str]:
    return sorted(_SCORERS)
