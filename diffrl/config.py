"""The root config: typed, frozen dataclasses per component, loaded from a YAML recipe plus
``key=value`` overrides (OmegaConf dotlist syntax). Each component's config lives next to the
component; this module only assembles them and turns every mistake into a ``ConfigError`` that
names the key, the value and what is allowed, before any work starts.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from diffrl.actor.engine import ActorConfig
from diffrl.algorithms.registry import (
    AlgorithmConfig,
    default_config,
    get_algorithm,
    registered_algorithms,
)
from diffrl.errors import ConfigError, FieldError, check, check_choice
from diffrl.models.probe import ProbeConfig
from diffrl.models.registry import ModelConfig, preset_takes_over
from diffrl.parallel.launch import ParallelConfig
from diffrl.placement import PlacementConfig, RayConfig
from diffrl.reward.pool import RewardConfig
from diffrl.rollout.engine import RolloutConfig
from diffrl.tasks.base import TaskConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = "recipes/shapes_nft.yaml"
MAX_SEED = 2**32 - 1  # np.random.seed refuses larger (build.seed_everything seeds it)


@dataclass(frozen=True)
class RunConfig:
    name: str = "shapes_nft"  # run directory is <out_dir>/<name>
    out_dir: str = "runs"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    steps: int = 60  # RL steps (one rollout + one update each)
    eval_every: int = 10  # held-out eval (and sample grid) every N steps; also at start and end
    save_every: int = 10  # checkpoint every N steps; also at the end
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    # continue from the run directory's latest checkpoint if there is one; false moves an
    # earlier run aside to <out_dir>/<name>.<timestamp> and starts over
    resume: bool = True
    # a resume may change only keys that leave the training math alone (run.steps, logging,
    # engines' placement: controller/run_start.py ALLOWED_CHANGES); true lets it change any,
    # each change recorded in the run's config_changes.jsonl
    allow_changes: bool = False
    max_minutes: float = 0.0  # stop (after a checkpoint) when the wall budget is spent; 0 = off
    # stop (exit status 2, naming why) after this many updates running that could not move the
    # weights: skipped (no row to train on, NaN/inf) or with a gradient norm of exactly 0 (every
    # advantage 0). A run that trains nothing must not "succeed". 0 = off (controller/dead_steps.py)
    max_dead_steps: int = 5
    tensorboard: bool = True
    # start step k+1's rollout while step k's update runs, when the algorithm says the update
    # cannot change the rollout's weights (e.g. NFT between old-policy refreshes): same results
    prefetch: bool = True
    # with actor.ema_decay > 0: also evaluate the live (non-EMA) weights, as eval_live/*
    # (doubles the eval time; for comparing the two)
    eval_live: bool = False
    # sync: roll out with the current weights, then train (on-policy). async: step k+1..'s
    # rollout runs while update k trains, at most max_staleness policy versions behind the
    # actor (controller/async_.py); max_staleness=0 gives sync's results exactly
    mode: str = "sync"  # sync | async
    max_staleness: int = 1  # async: a trained batch is at most this many updates old
    # async: a record past max_staleness is dropped, kept (and counted), or corrected: kept, and
    # trained with the loss's importance ratio against its recorded rollout log-probs (FlowGRPO's
    # clipped ratio, which keep uses too; refused for an algorithm without one, such as NFT)
    stale: str = "drop"  # drop | keep | correct
    # async: the weights rollout iteration i samples with. latest: whatever update the actor
    # has published when the iteration starts (timing decides). fixed: exactly those of update
    # i - max_staleness (deterministic: what a torchrun launch's ranks must agree on). auto:
    # fixed under torchrun, latest in one process
    async_weights: str = "auto"  # auto | latest | fixed
    # async: when an update reaches a rollout that is sampling. batch: before its next batch
    # (the batch in flight finishes under the old weights). step: at the next denoising-step
    # boundary, the batch in flight keeping its partly denoised latents and per-step records;
    # each step records its version, and FlowGRPO weighs older steps by truncated importance
    # sampling (algorithm.tis_cap). Needs async_weights=latest (fixed ties weights to iterations)
    async_sync: str = "batch"  # batch | step
    # where the engines run: this process (local), or Ray actors on their own resource pools
    # (ray; settings in the `ray` section). Same loop, same results at the same seed
    backend: str = "local"  # local | ray
    # sync: the actor trains each scored micro-batch (whole prompt groups) while the next one rolls
    # out, and takes the step's one optimizer step at the end: the same on-policy update, its
    # rows in arrival order (so the loss's draws differ from the batched update's)
    stream_train: bool = False

    def validate(self) -> None:
        check(
            self.name not in ("", ".", "..") and not any(c in self.name for c in "/\\\0"),
            "name",
            self.name,
            "a plain directory name (not '.' or '..', no path separators): the run's "
            "directory is <out_dir>/<name>",
        )
        check(
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
            "device",
            self.device,
            "auto, cpu, cuda or cuda:N",
        )
        check(self.steps >= 0, "steps", self.steps, "must be >= 0")
        check(self.eval_every > 0, "eval_every", self.eval_every, "must be > 0")
        check(self.save_every > 0, "save_every", self.save_every, "must be > 0")
        cores = os.cpu_count() or 1
        check(
            0 <= self.threads <= cores,
            "threads",
            self.threads,
            f"must be in [0, {cores}] (this machine's logical cores; 0 = torch's default)",
        )
        check(
            0 <= self.seed <= MAX_SEED,
            "seed",
            self.seed,
            f"must be in [0, {MAX_SEED}] (2**32 - 1: what numpy's global seeding accepts)",
        )
        check(self.max_minutes >= 0, "max_minutes", self.max_minutes, "must be >= 0")
        check(
            self.max_dead_steps >= 0,
            "max_dead_steps",
            self.max_dead_steps,
            "must be >= 0 (0 = off)",
        )
        check_choice("mode", self.mode, ("sync", "async"))
        check(
            self.max_staleness >= 0,
            "max_staleness",
            self.max_staleness,
            "must be >= 0 (policy versions a trained batch may lag the actor; 0 = on-policy)",
        )
        check_choice("stale", self.stale, ("drop", "keep", "correct"))
        check_choice("async_weights", self.async_weights, ("auto", "latest", "fixed"))
        check_choice("async_sync", self.async_sync, ("batch", "step"))
        if self.async_sync == "step":
            check(
                self.async_weights != "fixed",
                "async_weights",
                self.async_weights,
                "must be latest (or auto, in one process) with run.async_sync=step: fixed "
                "makes iteration i's weights update i - max_staleness's, which a sync mid-rollout "
                "would change; use run.async_sync=batch with fixed",
            )
        check_choice("backend", self.backend, ("local", "ray"))

    def check_streaming(self, minibatches: int) -> None:
        """``stream_train`` trains each scored micro-batch as it comes: one optimizer step per
        RL step, in sync mode (what the algorithm's ``prepare`` needs: ``Algorithm.validate``)."""
        if not self.stream_train:
            return
        if self.mode != "sync":
            raise ConfigError(
                f"config key 'run.mode' = {self.mode!r}: run.stream_train streams the sync "
                "loop's update; use run.mode=sync"
            )
        if minibatches != 1:
            raise ConfigError(
                f"config key 'actor.minibatches' = {minibatches!r}: run.stream_train takes one "
                "optimizer step per RL step; set actor.minibatches=1"
            )


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ray: RayConfig = field(default_factory=RayConfig)  # run.backend=ray only
    # where each engine runs, and how weights reach the rollout (run.backend=ray only)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # torchrun (launch.py)
    probe: ProbeConfig = field(default_factory=ProbeConfig)  # contract 1 at start-up
    # the registered algorithm's own frozen config (a subclass; ``algorithm.name`` picks it)
    algorithm: AlgorithmConfig = field(default_factory=default_config)

    def check_across(self) -> None:
        """The rules that span sections, each kept beside the component it protects: the run's
        streaming, the data's prompt draw, and what the algorithm needs of the rest. Run after
        every section's own ``validate`` (``load_config``), so each sees valid sections."""
        self.run.check_streaming(self.actor.minibatches)
        self.check_midsync()
        reason = self.algorithm.one_step_reason()
        if reason is not None and self.actor.minibatches != 1:
            raise ConfigError(
                f"config key 'actor.minibatches' = {self.actor.minibatches}: {reason}"
            )
        self.data.check_loop(self.run.mode)
        get_algorithm(self.algorithm.name).validate(self)

    def check_midsync(self) -> None:
        """``run.async_sync=step`` with an algorithm that weighs steps by truncated importance
        sampling reads the proximal policy off the update's own forward: one optimizer step."""
        run, minibatches = self.run, self.actor.minibatches
        if run.mode != "async" or run.async_sync != "step" or minibatches == 1:
            return
        if get_algorithm(self.algorithm.name).needs_logprobs:
            raise ConfigError(
                f"config key 'actor.minibatches' = {minibatches}: with run.async_sync=step, "
                f"{self.algorithm.name}'s truncated importance weights take the proximal policy "
                "(the update's start weights) off the update's own forward, which holds only "
                "before its first optimizer step; set actor.minibatches=1 or "
                "run.async_sync=batch"
            )


def resolve_recipe(path: str | None) -> Path:
    """A recipe path as given, else relative to the repository (so ``diffrl train`` works
    from any directory)."""
    path = path or DEFAULT_RECIPE
    names = [path] if path.endswith((".yaml", ".yml")) else [path, f"{path}.yaml"]
    for name in names:  # `shapes_grpo` is recipes/shapes_grpo.yaml
        for candidate in (Path(name), REPO_ROOT / name, REPO_ROOT / "recipes" / name):
            if candidate.is_file():
                return candidate
    shipped = sorted(p.stem for p in (REPO_ROOT / "recipes").glob("*.yaml"))
    raise ConfigError(
        f"recipe {path!r} not found (looked in . and {REPO_ROOT / 'recipes'}); recipes there: "
        f"{', '.join(shipped)}"
    )


def mergeable_schema(obj) -> DictConfig:
    """OmegaConf schema of a (frozen) config dataclass that recipes can be merged into.

    OmegaConf 2.3 marks the nodes of a frozen dataclass read-only, so merging a recipe into
    them fails ("Cannot set value of read-only config node"); 2.4 does not. The frozen
    dataclass is rebuilt by ``OmegaConf.to_object`` after the merge either way.
    """
    schema = OmegaConf.structured(obj)
    _clear_readonly(schema)
    return schema


def _clear_readonly(node: DictConfig) -> None:
    OmegaConf.set_readonly(node, None)  # each frozen dataclass node carries its own flag
    for key in node:
        child = node[key]
        if isinstance(child, DictConfig):
            _clear_readonly(child)


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Recipe YAML (optional) + ``key=value`` overrides -> validated, frozen ``Config``."""
    overrides = list(overrides or [])
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. algorithm.beta=0.1)")
    # found before the read below, whose errors are about the YAML and the overrides' syntax
    path = resolve_recipe(str(recipe)) if recipe is not None else None
    try:
        raw = OmegaConf.load(path) if path is not None else OmegaConf.create()
        cli = OmegaConf.from_dotlist(overrides)
        raw = OmegaConf.merge(preset_takes_over(raw, cli), cli)
    except yaml.YAMLError as e:
        # recipes are read with a safe loader: a python/object tag (code to run) is refused
        raise ConfigError(
            f"could not read the recipe/overrides as YAML: {' '.join(str(e).split())}"
        ) from None
    except (OmegaConfBaseException, TypeError, ValueError) as e:
        raise ConfigError(
            f"could not read the recipe/overrides: {' '.join(str(e).split())} (to change a list "
            "such as reward.scorers, give the whole list in YAML flow syntax)"
        ) from None
    algo_name = OmegaConf.select(raw, "algorithm.name", default=AlgorithmConfig.name)
    if algo_name not in registered_algorithms():
        raise ConfigError(
            f"config key 'algorithm.name' = {algo_name!r}: must be one of {registered_algorithms()}"
        )
    schema = mergeable_schema(Config(algorithm=get_algorithm(algo_name).config_cls()))
    try:
        merged = OmegaConf.merge(schema, raw)
        cfg = OmegaConf.to_object(merged)
    except ConfigKeyError as e:
        parent = e.full_key.rsplit(".", 1)[0] if "." in e.full_key else ""
        node = OmegaConf.select(schema, parent) if parent else schema
        allowed = sorted(node.keys()) if hasattr(node, "keys") else []
        raise ConfigError(f"unknown config key '{e.full_key}'; allowed here: {allowed}") from None
    except ValidationError as e:  # OmegaConf appends the key and types on lines of their own
        raise ConfigError(
            f"bad value for config key '{e.full_key}': {_first_line(e.msg)}"
        ) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad config: {_first_line(str(e))}") from None
    validate_tree(cfg)
    cfg.check_across()
    return cfg


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def validate_tree(node: Any, path: str = "") -> None:
    """Call ``validate()`` on every config dataclass, prefixing errors with the dotted key."""
    if not dataclasses.is_dataclass(node):
        return
    if hasattr(node, "validate"):
        try:
            node.validate()
        except FieldError as e:
            key = f"{path}.{e.field}" if path else e.field
            raise ConfigError(f"config key '{key}' = {e.value!r}: {e.allowed}") from None
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        child = f"{path}.{f.name}" if path else f.name
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                validate_tree(item, f"{child}[{i}]")
        else:
            validate_tree(value, child)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


__all__ = [
    "Config",
    "ConfigError",
    "RunConfig",
    "AlgorithmConfig",
    "load_config",
    "to_yaml",
    "check_choice",
]
