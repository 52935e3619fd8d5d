"""Errors that name what was wrong and what is allowed, so bad input fails loudly and early."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class DiffrlError(RuntimeError):
    """Base class for diffrl's own, user-facing errors."""


class ConfigError(DiffrlError, ValueError):
    """A config key or value is wrong; raised before any work starts."""


class ContractError(DiffrlError):
    """One of the design contracts (time convention, weight sync, token drift) was violated."""


class CheckpointError(DiffrlError):
    """A checkpoint cannot be used (a file missing, truncated or corrupted), or none of a run's
    can; the message names each checkpoint and what is wrong with it."""


class FieldError(ValueError):
    """Raised by a config dataclass's ``validate``; the loader prefixes the dotted path."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        super().__init__(f"{field}={value!r}: {allowed}")
        self.field, self.value, self.allowed = field, value, allowed


def check(ok: bool, field: str, value: Any, allowed: str) -> None:
    """Raise ``FieldError`` unless ``ok``; ``allowed`` says what a good value looks like."""
    if not ok:
        raise FieldError(field, value, allowed)


def check_choice(field: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    check(value in choices, field, value, f"must be one of {list(choices)}")


# the logger the start-up contract checks report through (probes, bound modules); the CLI shows
# its INFO lines
CONTRACTS_LOG = "diffrl.contracts"
