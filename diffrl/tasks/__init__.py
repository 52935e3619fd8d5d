"""Tasks by name (lazily imported): the controller builds whichever the config names."""

from __future__ import annotations

import importlib

from diffrl.errors import ConfigError
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

TASK_MODULES = {
    "shapes": "diffrl.tasks.shapes",
    "prompts": "diffrl.tasks.prompts",
    "avbench": "diffrl.tasks.avbench",  # T2VA
    "avbench_fl2va": "diffrl.tasks.avbench",  # FL2VA: the same module, mode from cfg.task
}


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
