"""The Qwen2.5-Omni thinker family: tokens once (image tokens expanded, left-padded), the KV-cache
sampler's recorded log-probs equal the training forward's, a local directory loads the same
model, and peft's LoRA lands on the decoder's attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from diffrl.errors import ConfigError
from diffrl.models.families.qwen_omni import IMAGE, LORA_TARGETS, save_local
from diffrl.models.family import NO_TOKEN, is_autoregressive
from diffrl.models.registry import ModelConfig, load_model
from diffrl.types import bytes_to_text

QUESTIONS = ["<image> how many shapes are there ?", "<image> what colour is the circle ?"]


@pytest.fixture(scope="module")
def omni():
    torch.manual_seed(0)
    return load_model(ModelConfig(preset="qwen-omni-tiny"), "cpu")


def _inputs(model):
    fam = model.family
    images = np.zeros((2, 32, 32, 3), np.uint8)
    images[0, 4:12, 4:12] = (220, 40, 40)
    images[1, 20:28, 8:16] = (50, 90, 235)
    cond = fam.encode_conditions([{"image": i} for i in images])
    return fam.tokenize(QUESTIONS).input_ids, cond


def test_tokens_once_with_the_image_expanded_and_left_padded(omni) -> None:
    fam = omni.family
    assert is_autoregressive(omni)
    ids = fam.tokenize(QUESTIONS + ["<image> how many shapes are there ?"]).input_ids
    image_id = fam.tokenizer.convert_tokens_to_ids(IMAGE)
    assert ((ids == image_id).sum(1) == fam.image_tokens).all() and fam.image_tokens == 16
    assert torch.equal(ids[0], ids[2])  # the same text, the same row
    assert (ids[:, -1] != fam.pad_id).all()  # left-padded: every prompt ends in the last column
    with pytest.raises(ConfigError, match="outside the tokenizer"):
        fam.tokenize(["what is a zebra ?"])


def test_sampled_log_probs_are_the_training_forwards(omni) -> None:
    ids, cond = _inputs(omni)
    tokens, lp = omni.sample(ids, cond, 6, greedy=False, seed=3)
    again, _ = omni.sample(ids, cond, 6, greedy=False, seed=3)
    assert tokens.shape == lp.shape == (2, 6) and torch.equal(tokens, again)
    recomputed = omni(tokens, 1.0, ids, cond)
    torch.testing.assert_close(recomputed, lp, atol=1e-5, rtol=0)
    assert (lp <= 0).all() and (lp[tokens != NO_TOKEN] < 0).all()
    # the image reaches the answer: another image, other log-probs for the same tokens
    assert not torch.allclose(omni(tokens, 1.0, ids, cond.flip(0)), recomputed)
    # an ended completion: NO_TOKEN after its first end-of-turn, and log-prob 0 there
    ended = tokens.clone()
    ended[0, 2], ended[0, 3:] = omni.family.eos_id, NO_TOKEN
    scored = omni(ended, 1.0, ids, cond)
    assert (scored[0, 3:] == 0).all() and (scored[0, :3] < 0).all()
    text = bytes_to_text(omni.family.decode(ended)["text"])
    assert text == omni.family.decode_text(ended) and len(text) == 2


def test_a_local_directory_loads_the_same_model(omni, tmp_path) -> None:
    save_local(omni, tmp_path / "thinker")
    local = load_model(ModelConfig(family="qwen_omni", path=str(tmp_path / "thinker")), "cpu")
    ids, cond = _inputs(omni)
    assert torch.equal(local.family.tokenize(QUESTIONS).input_ids, ids)
    tokens, _ = omni.sample(ids, cond, 4, greedy=True, seed=0)
    torch.testing.assert_close(local(tokens, 1.0, ids, cond), omni(tokens, 1.0, ids, cond))
    with pytest.raises(ConfigError, match="model.path"):
        load_model(ModelConfig(family="qwen_omni", path=str(tmp_path)), "cpu")


def test_lora_through_peft_on_the_decoder_attention(omni) -> None:
    import copy

    model = get_peft_model(copy.deepcopy(omni), LoraConfig(r=2, target_modules=list(LORA_TARGETS)))
    names = [n for n, _ in model.named_modules() if n.endswith("lora_B.default")]
    assert any("language_model" in n for n in names) and not any("visual" in n for n in names)
    ids, cond = _inputs(omni)
    tokens, _ = omni.sample(ids, cond, 4, greedy=True, seed=0)
    base = omni(tokens, 1.0, ids, cond)
    torch.testing.assert_close(model(tokens, 1.0, ids, cond), base)  # B = 0 at init
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    assert not torch.allclose(model(tokens, 1.0, ids, cond), base)
    with model.disable_adapter():
        torch.testing.assert_close(model(tokens, 1.0, ids, cond), base)
