"""Tasks by name (lazily imported): the controller builds whichever the config names.

A task that grades its own samples exactly (ShapesBench, AVBench) keeps its scorer in its
package; this registry adds those scorers to the reward registry under the names recipes use,
so reward/ never imports a task. Every process that builds engines imports this package (the
local factory, each Ray host, ``diffrl serve-reward``), so the names exist wherever a pool is
built.
"""

from __future__ import annotations

import importlib

from diffrl.errors import ConfigError
from diffrl.reward.scorer import register_scorer
from diffrl.tasks.avbench.scorer import AVBenchScorer
from diffrl.tasks.base import (
    EvalResult,
    ProbeData,
    Prompt,
    PromptSet,
    PromptSource,
    SpreadSampler,
    Task,
    TaskConfig,
    prompt_source,
)
from diffrl.tasks.shapes.scorer import ShapesScorer
from diffrl.tasks.shapes_qa import ShapesQAScorer

TASK_MODULES = {
    "shapes": "diffrl.tasks.shapes",
    "prompts": "diffrl.tasks.prompts",
    "avbench": "diffrl.tasks.avbench",  # T2VA
    "avbench_fl2va": "diffrl.tasks.avbench",  # FL2VA: the same module, mode from cfg.task
    "avbench_i2av": "diffrl.tasks.avbench",  # I2AV (first frame): the same module
    "avbench_ref2va": "diffrl.tasks.avbench",  # Ref2VA: a reference image and soundtrack
    "shapes_qa": "diffrl.tasks.shapes_qa",  # questions on ShapesBench images (AR families)
}

# scorer name (as recipes spell it) -> the task's scorer
TASK_SCORERS = {"shapes": ShapesScorer, "avbench": AVBenchScorer, "shapes_qa": ShapesQAScorer}
for _name, _scorer in TASK_SCORERS.items():
    register_scorer(_name)(_scorer)


def build_task(cfg: TaskConfig) -> Task:
    if cfg.task not in TASK_MODULES:
        raise ConfigError(
            f"config key 'data.task' = {cfg.task!r}: must be one of {sorted(TASK_MODULES)}"
        )
    return importlib.import_module(TASK_MODULES[cfg.task]).build(cfg)


__all__ = [
    "EvalResult",
    "ProbeData",
    "Prompt",
    "PromptSet",
    "PromptSource",
    "SpreadSampler",
    "Task",
    "TaskConfig",
    "build_task",
    "prompt_source",
]
