"""Layering: engines talk through typed records and the channel, not each other's modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import diffrl

PKG = Path(diffrl.__file__).resolve().parent


def imports_in(source: str, package: list[str]) -> set[str]:
    """Every diffrl module a source imports (absolute or relative, at any nesting level);
    ``package`` is the dotted package the file lives in, as a list."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "diffrl"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "diffrl":
                found.add(mod)
                found |= {f"{mod}.{a.name}" for a in node.names}  # `from diffrl import actor`
    return found


def diffrl_imports(path: Path) -> set[str]:
    package = list(path.relative_to(PKG.parent).parts[:-1])  # e.g. ["diffrl", "rollout"]
    return imports_in(path.read_text(), package)


def files(sub: str) -> list[Path]:
    out = sorted((PKG / sub).rglob("*.py"))
    assert out, sub
    return out


def violations(sub: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for f in files(sub):
        for mod in diffrl_imports(f):
            if any(mod == p or mod.startswith(p + ".") for p in forbidden):
                bad.append(f"{f.relative_to(PKG.parent)} imports {mod}")
    return bad


def test_parser_sees_every_import_form() -> None:
    """The checker must catch each form, else the boundary tests prove nothing."""
    found = diffrl_imports(PKG / "rollout" / "engine.py")
    assert {"diffrl.sync.weights", "diffrl.channel", "diffrl.types"} <= found
    src = (
        "import diffrl.actor.engine\nfrom diffrl import rollout\n"
        "def f():\n    from ..actor import checkpoint\n    from . import pool\n"
    )
    found = imports_in(src, ["diffrl", "reward"])
    assert {
        "diffrl.actor.engine",
        "diffrl.rollout",
        "diffrl.actor.checkpoint",
        "diffrl.reward.pool",
    } <= found
    assert imports_in("import os\nfrom torch import nn\n", ["diffrl", "x"]) == set()


@pytest.mark.parametrize(
    ("sub", "forbidden"),
    [
        ("rollout", ("diffrl.actor",)),
        ("reward", ("diffrl.actor", "diffrl.rollout")),
        ("algorithms", ("diffrl.actor",)),
    ],
)
def test_forbidden_imports(sub: str, forbidden: tuple[str, ...]) -> None:
    assert violations(sub, forbidden) == []


# the loop and its factory build tasks and model families through their registries only
TASKS_AND_FAMILIES = (
    "diffrl.tasks.shapes",
    "diffrl.tasks.prompts",
    "diffrl.data.shapes",
    "diffrl.models.families",
    "diffrl.models.tiny_dit",
)


def test_controller_names_no_task_or_family() -> None:
    assert violations("controller", TASKS_AND_FAMILIES) == []
    # nor by a module-name string (importlib.import_module("diffrl.tasks.shapes"))
    named = [
        f"{f.relative_to(PKG.parent)} names {node.value!r}"
        for f in files("controller")
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and any(node.value == m or node.value.startswith(m + ".") for m in TASKS_AND_FAMILIES)
    ]
    assert named == []


def test_boundary_checker_catches_a_family_import() -> None:
    src = "from diffrl.models.families import tiny_dit\nfrom diffrl.tasks import shapes\n"
    found = imports_in(src, ["diffrl", "controller"])
    assert {"diffrl.models.families.tiny_dit", "diffrl.tasks.shapes"} <= found


def test_channel_imports_only_itself() -> None:
    for f in files("channel"):
        others = {m for m in diffrl_imports(f) if not m.startswith("diffrl.channel")}
        assert others == set(), f"{f.name} imports {others}"
