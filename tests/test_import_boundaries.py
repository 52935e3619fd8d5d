"""Layering: engines talk through typed records and the channel, not each other's modules, and
the package's floors point down: a lower floor never imports a higher one, and no two modules
import each other (directly or round a loop)."""

from __future__ import annotations

import ast
import itertools
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
    "diffrl.tasks.shapes.prompts",
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


# --- floors ---------------------------------------------------------------------------------
# Each top-level module or package of diffrl on its floor, lowest first. An import may point to
# its own floor or below; one to a higher floor is an arrow running back up.
FLOORS = (
    ("diffrl.extras",),  # which pip extra brings a module: imports nothing of diffrl
    (
        "diffrl",
        "diffrl.types",
        "diffrl.errors",
        "diffrl.hostmem",
        "diffrl.placement",
        "diffrl.diskio",
        "diffrl.resources",
    ),
    # the generic TP styles sit below the families, whose records hold plans made of them
    ("diffrl.channel", "diffrl.sync", "diffrl.parallel.tp"),
    ("diffrl.models",),
    (
        "diffrl.rollout",
        "diffrl.reward",
        "diffrl.algorithms",
        "diffrl.actor",
        "diffrl.parallel",
        "diffrl.engines",
    ),
    ("diffrl.tasks",),
    ("diffrl.config", "diffrl.config_help"),
    ("diffrl.build",),
    ("diffrl.backends",),
    ("diffrl.controller",),
    ("diffrl.pretrain", "diffrl.bench"),
    ("diffrl.cli",),
)
# at most this many arrows may run back up (the bound); today none needs to
MAX_UP_ARROWS = 1


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_sources() -> dict[str, tuple[str, list[str]]]:
    """module -> (source, the package it lives in) for every module of diffrl."""
    return {
        module_name(f): (f.read_text(), list(f.relative_to(PKG.parent).parts[:-1]))
        for f in sorted(PKG.rglob("*.py"))
    }


def resolve(name: str, modules: set[str]) -> str | None:
    """The module that ``name`` (a module, or a name inside one) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(sources: dict[str, tuple[str, list[str]]]) -> dict[str, set[str]]:
    """module -> the diffrl modules it imports. ``from pkg import sub`` points at ``pkg.sub``
    when that is a module (Python runs ``pkg/__init__`` for any submodule, which is not an
    arrow of its own); lazy imports inside functions count like top-level ones."""
    modules = set(sources)
    graph: dict[str, set[str]] = {}
    for mod, (source, package) in sources.items():
        out = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = imports_in(ast.unparse(node), package)  # absolute form of the import
                src = min(base, key=len) if base else ""
                targets = [
                    f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src for a in node.names
                ]
            else:
                continue
            out |= {t for t in (resolve(n, modules) for n in targets) if t and t != mod}
        graph[mod] = {t for t in out if t.split(".")[0] == "diffrl"}
    return graph


def floor_of(mod: str) -> int:
    for level, names in enumerate(FLOORS):
        if any(mod == n or (n != "diffrl" and mod.startswith(n + ".")) for n in names):
            return level
    raise AssertionError(f"{mod} sits on no floor: add it to FLOORS in {Path(__file__).name}")


def up_arrows(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, outs in graph.items() for b in outs if floor_of(b) > floor_of(a)}


def circles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The import loops, each as the sorted modules of one strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = set()
    counter = itertools.count()

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = next(counter)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_sits_on_a_floor() -> None:
    for mod in package_sources():
        floor_of(mod)


def test_the_import_graph_has_no_circle() -> None:
    found = circles(import_graph(package_sources()))
    assert found == set()


def test_arrows_point_down() -> None:
    up = up_arrows(import_graph(package_sources()))
    assert len(up) <= MAX_UP_ARROWS, sorted(up)


# the floors the engines stand on never reach up to whoever assembles or runs them
GROUND = ("models", "rollout", "sync", "channel", "types.py")
ASSEMBLY = ("diffrl.controller", "diffrl.backends", "diffrl.tasks", "diffrl.config")


def assembly_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    ground = tuple(f"diffrl.{g.removesuffix('.py')}" for g in GROUND)
    return {
        (a, b)
        for a, outs in graph.items()
        if any(a == g or a.startswith(g + ".") for g in ground)
        for b in outs
        if any(b == f or b.startswith(f + ".") for f in ASSEMBLY)
    }


def test_ground_floors_never_import_the_assembly() -> None:
    found = assembly_imports(import_graph(package_sources()))
    assert found == set()


def test_floor_checks_fail_on_a_forbidden_import() -> None:
    """Feed the checkers a package with one bad import each: they must catch it."""
    sources = package_sources()
    ok = import_graph(sources)
    bad = dict(sources)
    source, package = sources["diffrl.rollout.samplers"]
    bad["diffrl.rollout.samplers"] = (source + "\nfrom diffrl.controller import sync\n", package)
    graph = import_graph(bad)
    assert ("diffrl.rollout.samplers", "diffrl.controller.sync") in up_arrows(graph)
    assert ("diffrl.rollout.samplers", "diffrl.controller.sync") in assembly_imports(graph)
    assert ("diffrl.rollout.samplers", "diffrl.controller.sync") not in up_arrows(ok)
    # a relative, lazy import of config from types.py, and a loop through a new module
    source, package = sources["diffrl.types"]
    bad["diffrl.types"] = (source + "\ndef f():\n    from .config import Config\n", package)
    bad["diffrl.channel.loop"] = ("from diffrl.channel import local\n", ["diffrl", "channel"])
    source, package = sources["diffrl.channel.local"]
    bad["diffrl.channel.local"] = (source + "\nimport diffrl.channel.loop\n", package)
    graph = import_graph(bad)
    assert ("diffrl.types", "diffrl.config") in assembly_imports(graph)
    assert ("diffrl.channel.local", "diffrl.channel.loop") in circles(graph)
    assert len(up_arrows(graph)) > MAX_UP_ARROWS
    # a module outside every floor is an error, not a silent pass
    with pytest.raises(AssertionError, match="sits on no floor"):
        floor_of("diffrl.newpkg.x")
