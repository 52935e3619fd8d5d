"""The scorer registry: importing this package registers the built-in scorers, and
``build_scorer`` makes one by name. A scorer module imports only ``reward/scorer.py`` (the
protocols, the table and ``build_scorer``, which a scorer wrapping another one calls), so no
scorer imports this package back. A task's own scorer
(``shapes``, ``avbench``) lives in its task's package and is registered by ``diffrl.tasks``:
reward/ imports no task.
"""

from __future__ import annotations

from diffrl.reward.http import client as _http_client  # noqa: F401  (registers "http")
from diffrl.reward.scorer import _SCORERS, build_scorer
from diffrl.reward.scorers import clap, clip, compress, imagebind, ocr, pairwise, vlm  # noqa: F401

__all__ = ["build_scorer", "registered_scorers"]


def registered_scorers() -> list[str]:
    return sorted(_SCORERS)
