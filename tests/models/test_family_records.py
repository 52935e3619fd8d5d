"""Each family module exports one ``FAMILY`` record, the registry is the dict of them, and the
records agree with the classes their ``load`` builds."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import diffrl
from diffrl.errors import ConfigError, FieldError
from diffrl.models.convention import CONVENTIONS
from diffrl.models.family import (
    EncodesClips,
    FamilySpec,
    HasMediaGeometry,
    ResolutionFree,
    TakesConditions,
)
from diffrl.models.registry import (
    BUILTINS,
    FAMILIES,
    PRESET_FAMILY,
    ModelConfig,
    builtin_path,
    family,
    load_weights,
)

PKG = Path(diffrl.__file__).resolve().parent
MODULES = sorted(p.stem for p in (PKG / "models" / "families").glob("*.py") if p.stem[0] != "_")


def test_every_family_module_is_one_record_in_the_registry() -> None:
    # shared helpers are named _*; every other module is a family
    assert sorted(FAMILIES) == MODULES
    for name in MODULES:
        spec = importlib.import_module(f"diffrl.models.families.{name}").FAMILY
        assert isinstance(spec, FamilySpec) and FAMILIES[name] is spec and spec.name == name


def test_discovery_refuses_a_module_without_a_record(tmp_path, monkeypatch) -> None:
    """A new public module under models/families/ must export FAMILY: discovery says so."""
    from diffrl.models import families, registry

    (tmp_path / "not_a_family.py").write_text("X = 1\n")
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    with pytest.raises(TypeError, match="exports no FAMILY record"):
        registry._discover()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_record_agrees_with_its_class(name: str) -> None:
    spec = FAMILIES[name]
    # an autoregressive family (models/family.py ARFamily) has no time convention to declare
    autoregressive = hasattr(spec.family_class, "decode_text")
    assert spec.native_convention in CONVENTIONS or (autoregressive and not spec.native_convention)
    assert spec.lora_targets and "all-linear" not in spec.lora_targets
    assert callable(spec.serving_layout) and callable(spec.flops)
    assert spec.load.__module__ == f"diffrl.models.families.{name}"
    for preset in spec.presets:
        assert PRESET_FAMILY[preset] == name
        assert ModelConfig(preset=preset).resolved_family == name
    for key, b in spec.builtins.items():
        assert key.startswith("builtin:") and BUILTINS[key] is b and b.command.startswith("diffrl")
        assert not b.preset or b.preset in spec.presets


def test_optional_capabilities_are_declared_protocols() -> None:
    declared = {
        name: {
            p.__name__
            for p in (ResolutionFree, HasMediaGeometry, TakesConditions, EncodesClips)
            if issubclass(f.family_class, p)
        }
        for name, f in FAMILIES.items()
    }
    assert declared["sd3"] == {"ResolutionFree"}
    assert declared["minimax_h3"] == {"HasMediaGeometry", "TakesConditions", "EncodesClips"}
    assert declared["tiny_dit"] == {"ResolutionFree"}  # smaller sizes: mixed-shape rollouts
    for f in FAMILIES.values():  # and each declared one is really there
        assert all(hasattr(f.family_class, m) for m in ("tokenize", "decode", "latent_shape"))


def test_unknown_names_say_what_is_allowed() -> None:
    with pytest.raises(FieldError, match=r"family.*'nope'.*tiny_dit"):
        ModelConfig(family="nope").validate()
    with pytest.raises(FieldError, match=r"preset.*'nope'.*sd35-tiny"):
        ModelConfig(preset="nope").validate()
    with pytest.raises(ConfigError, match="unknown model family 'nope'"):
        family("nope")
    with pytest.raises(ConfigError, match=r"'builtin:nope'.*builtin:shapes_sd3"):
        builtin_path("builtin:nope")


def test_a_missing_builtin_names_the_command_that_writes_it(tmp_path, monkeypatch) -> None:
    from diffrl.models import family as family_mod

    monkeypatch.setattr(family_mod, "ASSETS", tmp_path)  # nothing shipped
    with pytest.raises(ConfigError, match="diffrl pretrain preset=sd3-shapes"):
        load_weights(None, "builtin:shapes_sd3")


# --- floors: models/ points down only ----------------------------------------------------------

UPPER = ("diffrl.tasks", "diffrl.data", "diffrl.controller", "diffrl.backends", "diffrl.config")
# the pretraining recipes move to diffrl/pretrain/ (issue 36); they drive the controller
MOVING = {"pretrain.py", "pretrain_av.py"}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out |= {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_models_and_the_planner_import_no_upper_floor() -> None:
    files = [p for p in (PKG / "models").rglob("*.py") if p.name not in MOVING]
    files.append(PKG / "parallel" / "plan.py")
    bad = [
        f"{p.relative_to(PKG)} imports {m}"
        for p in files
        for m in _imports(p)
        if any(m == u or m.startswith(u + ".") for u in UPPER) or m == "unittest.mock"
    ]
    assert not bad, bad


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - {"tiny_dit"}))
def test_a_diffusers_family_without_path_or_preset_names_both_keys(name: str) -> None:
    from diffrl.models.registry import load_model

    preset = sorted(FAMILIES[name].presets)[0]
    with pytest.raises(ConfigError, match=rf"model.path .* model.preset .*'{preset}'"):
        load_model(ModelConfig(family=name))


def test_the_registry_imports_no_diffusers() -> None:
    """Every family module is imported to build the registry: each imports diffusers and
    transformers only inside its functions, so the tiny DiT's runs never pay for them."""
    import subprocess
    import sys

    code = (
        "import sys, diffrl.models.registry; "
        "print(sorted(m for m in ('diffusers', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
