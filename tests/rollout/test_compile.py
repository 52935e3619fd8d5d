"""rollout.compile: the blocks are compiled in place and sample what the eager engine samples."""

from __future__ import annotations

import asyncio

import pytest
import torch

from diffrl.models.compile import cpu_toolchain
from diffrl.rollout.engine import RolloutConfig, RolloutEngine, compile_blocks
from diffrl.tasks import Prompt, PromptSet
from diffrl.tasks.shapes.prompts import split_prompts

needs_cc = pytest.mark.skipif(  # the check compile_blocks makes before compiling
    bool(cpu_toolchain()), reason="inductor needs a C++ compiler"
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


def test_without_a_cpu_compiler_the_blocks_stay_eager(tiny_model, caplog) -> None:
    """No C++ compiler: one warning that says how to get one, nothing compiled, the same
    samples as eager (a laptop without a toolchain still runs a recipe that compiles). The
    compiler is hidden with inductor's own config.patch, which restores it afterwards (a
    monkeypatched torch config attribute is deleted on undo, not restored)."""
    from torch._inductor import config as inductor
    from torch._inductor.cpp_builder import cpp_compiler_search

    texts = [Prompt(p.text) for p in split_prompts("train")[:2]]
    prompts = PromptSet(texts, tiny_model.family.tokenize).all()
    cpp_compiler_search.cache_clear()
    try:
        with inductor.patch({"cpp.cxx": ("/nonexistent/c++",)}), caplog.at_level("WARNING"):
            cfg = RolloutConfig(group_size=2, num_steps=2, compile=True)
            eng = RolloutEngine(tiny_model, cfg, [], torch.device("cpu"))
    finally:
        cpp_compiler_search.cache_clear()
    assert eng.compiled == 0
    assert "no C++ compiler" in caplog.text and "CXX" in caplog.text
    assert cpu_toolchain() == ""  # the real compiler is back for the tests after this one
    got = asyncio.run(eng.generate(prompts, seed=4)).x0
    plain = RolloutEngine(tiny_model, RolloutConfig(group_size=2, num_steps=2), [],
                          torch.device("cpu"))  # fmt: skip
    torch.testing.assert_close(got, asyncio.run(plain.generate(prompts, seed=4)).x0)
