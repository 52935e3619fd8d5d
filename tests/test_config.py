"""load_config: recipe + key=value overrides -> validated, frozen Config; every mistake is a
ConfigError that names the key."""

from __future__ import annotations

import dataclasses

import pytest

from diffrl.algorithms.diffusion_nft import NFTConfig
from diffrl.config import Config, load_config, to_yaml
from diffrl.errors import ConfigError

RECIPE = "recipes/shapes_nft.yaml"


def test_default_recipe_loads_with_its_values() -> None:
    cfg = load_config(RECIPE)
    assert isinstance(cfg, Config)
    assert isinstance(cfg.algorithm, NFTConfig)
    # values the recipe sets (differ from the dataclass defaults where noted)
    assert cfg.run.name == "shapes_nft"
    assert cfg.run.steps == 120 and cfg.run.max_minutes == pytest.approx(14.0)
    assert cfg.rollout.compile and cfg.actor.compile  # dataclass defaults are False
    assert cfg.run.save_every == 5  # dataclass default is 10
    assert cfg.model.checkpoint == "builtin:shapes_dit_v2"  # small token-embedding init
    assert cfg.data.prompts_per_step == 16
    assert cfg.rollout.group_size == 8 and cfg.rollout.num_steps == 10
    assert cfg.rollout.sampler == "ode"
    assert cfg.actor.lr == pytest.approx(1e-3)
    assert cfg.actor.lora.rank == 32 and cfg.actor.lora.alpha == 32
    assert [s.name for s in cfg.reward.scorers] == ["shapes"]
    assert cfg.reward.scorers[0].params == {"mode": "overall"}
    assert cfg.algorithm.name == "diffusion_nft"
    assert cfg.algorithm.beta == 1.0 and cfg.algorithm.timesteps_per_sample == 4
    assert cfg.algorithm.old_update == "ema" and cfg.algorithm.sigma_min == pytest.approx(0.3)
    # keys the recipe leaves out keep the dataclass defaults
    assert cfg.run.out_dir == "runs"
    assert cfg.algorithm.weighting == "adaptive"


def test_no_recipe_gives_dataclass_defaults() -> None:
    cfg = load_config(None)
    assert cfg.run.save_every == 10
    assert cfg.algorithm == NFTConfig()


def test_overrides_apply() -> None:
    cfg = load_config(
        RECIPE, ["algorithm.beta=0.1", "rollout.sampler=sde", "run.steps=7", "actor.lora.rank=4"]
    )
    assert cfg.algorithm.beta == pytest.approx(0.1)
    assert cfg.rollout.sampler == "sde"
    assert cfg.run.steps == 7
    assert cfg.actor.lora.rank == 4
    # untouched keys keep the recipe's values
    assert cfg.rollout.group_size == 8 and cfg.algorithm.old_every == 2


def test_list_override_in_flow_syntax() -> None:
    cfg = load_config(RECIPE, ["reward.scorers=[{name: shapes, weight: 2.5}]"])
    assert len(cfg.reward.scorers) == 1
    assert cfg.reward.scorers[0].weight == 2.5
    assert cfg.reward.scorers[0].required is True


def test_unknown_key_names_the_key_and_allowed_keys() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, ["algorithm.betta=1"])
    msg = str(e.value)
    assert "algorithm.betta" in msg
    assert "beta" in msg.replace("betta", "")  # the allowed keys are listed


def test_unknown_top_level_section() -> None:
    with pytest.raises(ConfigError, match="'foo'"):
        load_config(RECIPE, ["foo.bar=1"])


@pytest.mark.parametrize(
    ("override", "key"), [("actor.lr=abc", "actor.lr"), ("run.steps=1.5", "run.steps")]
)
def test_bad_type_names_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, [override])
    assert key in str(e.value)


def test_bad_value_names_key_and_constraint() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, ["algorithm.beta=-1"])
    assert "algorithm.beta" in str(e.value) and "> 0" in str(e.value)


def test_bad_choice_lists_allowed_values() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, ["rollout.sampler=foo"])
    msg = str(e.value)
    assert "rollout.sampler" in msg and "'foo'" in msg
    assert "ode" in msg and "sde" in msg


def test_nested_list_item_error_has_indexed_key() -> None:
    with pytest.raises(ConfigError, match=r"reward\.scorers\[1\]\.name"):
        load_config(RECIPE, ["reward.scorers=[{name: shapes}, {name: ''}]"])


def test_all_linear_lora_target_rejected() -> None:
    with pytest.raises(ConfigError, match=r"actor\.lora\.targets"):
        load_config(RECIPE, ["actor.lora.targets=[all-linear]"])


def test_unknown_algorithm_name() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, ["algorithm.name=ppo"])
    assert "algorithm.name" in str(e.value) and "diffusion_nft" in str(e.value)


def test_override_without_equals() -> None:
    with pytest.raises(ConfigError, match="key=value"):
        load_config(RECIPE, ["algorithm.beta"])


def test_missing_recipe() -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config("recipes/no_such_recipe.yaml")


def test_config_is_frozen() -> None:
    cfg = load_config(RECIPE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.algorithm.beta = 2.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run = cfg.run  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor.lora.rank = 1  # type: ignore[misc]


def test_to_yaml_round_trips(tmp_path) -> None:
    cfg = load_config(RECIPE, ["algorithm.beta=0.25", "run.steps=3"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config(path)
    assert again == cfg


def test_schema_nodes_accept_a_merge_on_every_omegaconf_version() -> None:
    """OmegaConf 2.3 makes a frozen dataclass's nodes read-only; the schema must not be."""
    from omegaconf import OmegaConf

    from diffrl.config import Config, mergeable_schema

    schema = mergeable_schema(Config())
    assert not OmegaConf.is_readonly(schema)
    assert not OmegaConf.is_readonly(schema.run) and not OmegaConf.is_readonly(schema.rollout)
    merged = OmegaConf.merge(schema, OmegaConf.create({"run": {"steps": 3}}))
    assert OmegaConf.to_object(merged).run.steps == 3
