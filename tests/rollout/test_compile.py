"""rollout.compile: the blocks are compiled in place and sample what the eager engine samples."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from diffrl.data.shapes import split_prompts
from diffrl.rollout.engine import RolloutConfig, RolloutEngine, compile_blocks
from diffrl.tasks import Prompt, PromptSet

needs_cc = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="inductor needs a C compiler"
)


@needs_cc
def test_compiled_rollout_samples_what_the_eager_one_does(tiny_model) -> None:
    texts = [Prompt(p.text) for p in split_prompts("train")[:2]]
    prompts = PromptSet(texts, tiny_model.family.tokenize).all()
    out = {}
    for flag in (False, True):
        cfg = RolloutConfig(group_size=2, num_steps=3, compile=flag)
        eng = RolloutEngine(tiny_model, cfg, [], torch.device("cpu"))
        out[flag] = asyncio.run(eng.generate(prompts, seed=4)).x0
        assert eng.compiled == (len(tiny_model.net.blocks) if flag else 0)
    torch.testing.assert_close(out[True], out[False], rtol=1e-4, atol=1e-4)


def test_a_net_without_block_lists_is_refused() -> None:
    model = torch.nn.Module()
    model.net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="no block lists"):
        compile_blocks(model)


def test_without_a_cpu_compiler_the_blocks_stay_eager(tiny_model, monkeypatch, caplog) -> None:
    """No C++ compiler: one warning that says how to get one, nothing compiled, the same
    samples as eager (a laptop without a toolchain still runs a recipe that compiles)."""
    from torch._inductor import config as inductor
    from torch._inductor.cpp_builder import cpp_compiler_search

    monkeypatch.setattr(inductor.cpp, "cxx", ("/nonexistent/c++",))
    cpp_compiler_search.cache_clear()
    try:
        texts = [Prompt(p.text) for p in split_prompts("train")[:2]]
        prompts = PromptSet(texts, tiny_model.family.tokenize).all()
        cfg = RolloutConfig(group_size=2, num_steps=2, compile=True)
        with caplog.at_level("WARNING"):
            eng = RolloutEngine(tiny_model, cfg, [], torch.device("cpu"))
        assert eng.compiled == 0
        assert "no C++ compiler" in caplog.text and "CXX" in caplog.text
        got = asyncio.run(eng.generate(prompts, seed=4)).x0
        plain = RolloutEngine(tiny_model, RolloutConfig(group_size=2, num_steps=2), [],
                              torch.device("cpu"))  # fmt: skip
        torch.testing.assert_close(got, asyncio.run(plain.generate(prompts, seed=4)).x0)
    finally:
        cpp_compiler_search.cache_clear()
