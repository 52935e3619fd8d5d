"""``diffrl pretrain``: flow-matching pre-training of the built-in base models, one recipe per
task (``shapes.py``: the tiny DiT or a diffusers preset on ShapesBench; ``avbench.py``: the tiny
H3 on AVBench), over what both share (``common.py``)."""

from __future__ import annotations

from pathlib import Path

from diffrl.pretrain.avbench import pretrain_avbench
from diffrl.pretrain.common import PretrainConfig, load_pretrain_config
from diffrl.pretrain.shapes import evaluate_checkpoint, pretrain_shapes
from diffrl.pretrain.shapes_qa import pretrain_shapes_qa


def pretrain(cfg: PretrainConfig) -> Path:
    """Pre-train the base that ``cfg.task`` names; returns the weights' path."""
    if cfg.task == "shapes_qa":  # the tiny omni thinker (an autoregressive family)
        return pretrain_shapes_qa(cfg)
    return pretrain_avbench(cfg) if cfg.task == "avbench" else pretrain_shapes(cfg)


__all__ = ["PretrainConfig", "evaluate_checkpoint", "load_pretrain_config", "pretrain"]
