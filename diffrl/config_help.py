"""``diffrl train --help``'s list of config keys, read off the config dataclasses themselves (so
it cannot fall behind them), with where each section's keys are documented."""

from __future__ import annotations

import dataclasses
import textwrap


def config_keys_help(width: int = 100) -> str:
    """Every section of the root ``Config`` with its keys and the module whose dataclass
    documents them (one comment per field)."""
    from diffrl.algorithms.registry import registered_algorithms
    from diffrl.config import Config

    root = Config()
    lines = [
        "config keys (override any as section.key=value; a recipe is YAML of the same):",
    ]
    for f in dataclasses.fields(root):
        section = getattr(root, f.name)
        cls = type(section)
        keys = " ".join(k.name for k in dataclasses.fields(section))
        where = f"{cls.__module__.replace('.', '/')}.py {cls.__name__}"
        lines.append(f"  {f.name}: documented in {where}")
        if f.name == "algorithm":  # each registered algorithm has a config of its own
            names = ", ".join(registered_algorithms())
            lines.append(
                f"    (algorithm.name picks one of {names}; these are {root.algorithm.name}'s)"
            )
        lines += textwrap.wrap(keys, width, initial_indent="    ", subsequent_indent="    ")
    lines += [
        "",
        "A run's config.yaml holds every key with its value; docs/algorithms.md explains the",
        "algorithm and rollout options, and an unknown key's error lists the keys of its section.",
    ]
    return "\n".join(lines)
