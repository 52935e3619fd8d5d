"""Qwen2.5-Omni's thinker (transformers' ``Qwen2_5OmniThinkerForConditionalGeneration``) as an
autoregressive family: it reads a prompt's text and image and answers in text.

It is an ``ARFamily`` (``models/family.py``), a kind beside the diffusion families: no time
convention, no latents. What it shares with them is the rest of the map:

- **Tokens once (contract 3).** ``tokenize`` writes the chat template around each prompt,
  expands its ``<image>`` marker into ``<|vision_bos|>``, the image's ``<|IMAGE|>`` tokens
  and ``<|vision_eos|>``, and left-pads the batch (so a batch's completions start in one
  column). Those ids, and the sampled ids, are what the loss sees: nothing decodes and
  re-encodes. Decoding happens once, for the reward (``decode`` -> ``extra_fields["text"]``).
- **Images through the model's own processor.** A prompt's image is a condition encoded once
  in the data stage (``encode_conditions``: its pixels, hashed beside the ids); each forward
  runs it through transformers' Qwen2-VL image processor (resize, normalise, patchify), which
  is what the thinker's vision tower reads. The pixels travel (rather than the patches) so the
  verifier sees the exact image the model saw (``extra_fields["image"]``).
- **Sources.** ``model.preset=qwen-omni-tiny`` builds the real config class at CPU size with
  random weights and a word-level tokenizer built in code (no download); ``model.path`` is a
  local thinker directory (``save_pretrained`` layout: config, weights, tokenizer, and the
  image processor's ``preprocessor_config.json``); ``model.weights`` a ``.safetensors`` over
  either (``builtin:shapes_omni``, the ShapesQA base).
- **LoRA** through peft on the text decoder's attention projections (the audio encoder's
  Whisper-style ``self_attn.q/k/v_proj`` match too: with no audio input they get no gradient).

Audio inputs are not wired yet: the thinker's audio tower is built and loaded, but
``encode_conditions`` takes an image per prompt only (the Whisper features and the
``<|AUDIO|>`` expansion are the next step).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from diffrl.errors import ConfigError
from diffrl.models.family import (
    IMAGE_MARKER,
    NO_TOKEN,
    Builtin,
    FamilySpec,
    Shared,
    TokenBatch,
    hash_rows,
)
from diffrl.models.words import read_words
from diffrl.sync.weights import SlotMap
from diffrl.types import text_to_bytes

LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
# Qwen2.5-Omni's special tokens, by the names its tokenizer gives them
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_BOS, VISION_EOS, IMAGE = "<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>"
AUDIO_BOS, AUDIO_EOS, AUDIO, VIDEO = "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>", "<|VIDEO|>"
SPECIALS = (PAD, IM_START, IM_END, VISION_BOS, VISION_EOS, IMAGE, AUDIO_BOS, AUDIO_EOS, AUDIO)
SPECIALS += (VIDEO,)
TEMPLATE = f"{IM_START}user\n{{}}{IM_END}\n{IM_START}assistant\n"
# the words the tiny tokenizer knows beyond ShapesBench's: the chat template's, and the
# ShapesQA questions' and answers' (tests/tasks/test_shapes_qa.py checks the task's grammar)
QA_WORDS = (
    "?", "are", "assistant", "colour", "how", "is", "many", "one", "shape", "shapes", "there",
    "user", "what", "where",
)  # fmt: skip

BUILTIN = {
    "builtin:shapes_omni": Builtin(
        "shapes_omni.safetensors",
        "diffrl pretrain task=shapes_qa steps=2000 batch=32 lr=1e-3 warmup=100 threads=1",
        preset="qwen-omni-tiny",
    )
}
PRESETS = {
    "qwen-omni-tiny": dict(
        image_size=32,
        patch=4,
        merge=2,
        hidden=128,
        layers=2,
        heads=4,
        kv_heads=2,
        context=256,
        vision_hidden=64,
        vision_depth=2,
    ),
}


def word_vocabulary() -> list[str]:
    """The tiny tokenizer's tokens in id order: ``[UNK]``, the words, then the specials."""
    return ["[UNK]", *sorted(set(read_words("shapes")) | set(QA_WORDS)), *SPECIALS]


def tiny_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` with Qwen2.5-Omni's special tokens (built in
    code, no download); round-trips through save_pretrained/AutoTokenizer."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(word_vocabulary())}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token=PAD, eos_token=IM_END,
        padding_side="left",
    )  # fmt: skip


def image_processor(patch: int, merge: int, image_size: int):
    """transformers' Qwen2-VL image processor (the one Qwen2.5-Omni's processor holds), set to
    keep ``image_size`` square images at their size. Its torchvision backend where installed,
    else its PIL one (the same numbers on these uint8 images)."""
    try:
        from transformers import Qwen2VLImageProcessorPil as Processor
    except ImportError:  # transformers < 5.2x: the class is the PIL/numpy one
        from transformers import Qwen2VLImageProcessor as Processor
    side = image_size * image_size
    return Processor(
        patch_size=patch, merge_size=merge, temporal_patch_size=2, min_pixels=side,
        max_pixels=side,
    )  # fmt: skip


def tiny_config(tokenizer, p: dict):
    """The real ``Qwen2_5OmniThinkerConfig`` at CPU size, its special ids from ``tokenizer``."""
    from transformers import Qwen2_5OmniThinkerConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    head = p["hidden"] // p["heads"]
    half = head // 2  # mrope splits the rotary half-dims over (time, height, width)
    section = [half - 2 * (half // 3), half // 3, half // 3]
    return Qwen2_5OmniThinkerConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=p["hidden"], intermediate_size=2 * p["hidden"],
            num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
            num_key_value_heads=p["kv_heads"], max_position_embeddings=p["context"],
            rope_scaling={"type": "default", "mrope_section": section},
        ),
        vision_config=dict(
            depth=p["vision_depth"], hidden_size=p["vision_hidden"],
            intermediate_size=2 * p["vision_hidden"], num_heads=2,
            out_hidden_size=p["hidden"], patch_size=p["patch"], spatial_merge_size=p["merge"],
            temporal_patch_size=2, fullatt_block_indexes=[0], window_size=p["image_size"],
        ),
        audio_config=dict(
            d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
            output_dim=p["hidden"], num_mel_bins=16, max_source_positions=64, n_window=8,
        ),
        image_token_index=ids[IMAGE], audio_token_index=ids[AUDIO], video_token_index=ids[VIDEO],
        vision_start_token_id=ids[VISION_BOS], vision_end_token_id=ids[VISION_EOS],
        audio_start_token_id=ids[AUDIO_BOS], audio_end_token_id=ids[AUDIO_EOS],
    )  # fmt: skip


class QwenOmniFamily:
    """The ``ARFamily`` record's instance: tokenizer, image processor and geometry."""

    name = "qwen_omni"
    native_convention = ""  # autoregressive: no time convention (contract 1 does not apply)
    lora_targets = LORA_TARGETS
    media = frozenset({"text", "image"})  # image: the prompt's own, for a verifier to read

    def __init__(self, tokenizer, processor, image_size: int, context: int, params: int) -> None:
        self.tokenizer, self.processor = tokenizer, processor
        self.image_size, self.context, self.params = image_size, context, params
        self.pad_id = int(tokenizer.convert_tokens_to_ids(PAD))
        self.eos_id = int(tokenizer.convert_tokens_to_ids(IM_END))
        # tokens an answer never holds: the template's and the media placeholders (a sampled
        # <|audio_bos|> would make the thinker look for audio). Sampling and scoring both give
        # them probability 0, so the recorded log-probs stay the sampled distribution's
        # the most bytes one token decodes to (and a space before it): the text field's width
        self.token_bytes = 1 + max(len(t.encode()) for t in tokenizer.get_vocab())
        self.banned = sorted(
            {int(tokenizer.convert_tokens_to_ids(t)) for t in SPECIALS if t != IM_END}
        )
        pixels = processor(images=[np.zeros((image_size, image_size, 3), np.uint8)])
        grid = torch.as_tensor(np.asarray(pixels["image_grid_thw"]))[0]
        self.grid = grid  # (3,) (t, h, w) patches of every image this family samples with
        self.image_tokens = int(grid.prod()) // processor.merge_size**2

    # --- the data stage ----------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> TokenBatch:
        image = VISION_BOS + IMAGE * self.image_tokens + VISION_EOS
        prompts = [TEMPLATE.format(t.replace(IMAGE_MARKER, image)) for t in texts]
        enc = self.tokenizer(prompts, padding=True, return_tensors="pt")
        ids = enc["input_ids"].long()
        unknown = ids == self.tokenizer.unk_token_id
        if self.tokenizer.unk_token_id is not None and unknown.any():
            row = int(unknown.any(1).nonzero()[0])
            raise ConfigError(
                f"qwen_omni: prompt {texts[row]!r} has words outside the tokenizer's "
                "vocabulary (model.path's tokenizer, or the tiny one's word list)"
            )
        return TokenBatch(ids, enc["attention_mask"].bool(), hash_rows(ids))

    def media_geometry(self) -> dict[str, float]:
        return {"frames": 1, "size": self.image_size, "fps": 0, "sample_rate": 0}

    def encode_conditions(self, conditions: Sequence[dict]) -> Tensor:
        """Each prompt's ``image`` ((H, W, 3) uint8) as (N, 3, H, W) float32 pixel values
        0..255, exact. (Audio conditions are not wired yet.)"""
        images = []
        for c in conditions:
            if set(c) - {"image"}:
                raise ConfigError(f"qwen_omni takes an image per prompt, got {sorted(c)}")
            img = np.asarray(c["image"])
            if img.shape != (self.image_size, self.image_size, 3) or img.dtype != np.uint8:
                raise ConfigError(
                    f"qwen_omni: a prompt's image is {img.shape} {img.dtype}, the family "
                    f"takes ({self.image_size}, {self.image_size}, 3) uint8"
                )
            images.append(torch.from_numpy(img).permute(2, 0, 1).float())
        return torch.stack(images)

    def condition_media(self, cond: Tensor) -> dict[str, Tensor]:
        """The prompts' images as media, exactly as encoded: ``image`` (B, H, W, 3) uint8."""
        pixels = cond.detach().round().clamp(0, 255).to("cpu", torch.uint8)
        return {"image": pixels.permute(0, 2, 3, 1).contiguous()}

    def vision_inputs(self, cond: Tensor | None) -> dict[str, Tensor]:
        """(B, 3, H, W) pixels -> the thinker's ``pixel_values`` and ``image_grid_thw``,
        through the model's own image processor."""
        if cond is None:
            return {}
        images = self.condition_media(cond)["image"]
        out = self.processor(images=[i.numpy() for i in images], return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    # --- the rollout's media ------------------------------------------------------------------
    def decode_text(self, tokens: Tensor) -> list[str]:
        """(B, T) completion ids -> each answer's text, up to its end-of-turn token."""
        rows = [[int(t) for t in row if t not in (NO_TOKEN, self.eos_id)] for row in tokens]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

    def decode(self, tokens: Tensor) -> dict[str, Tensor]:
        # a fixed width for T tokens, so every micro-batch's field has the same shape
        return {"text": text_to_bytes(self.decode_text(tokens), tokens.shape[1] * self.token_bytes)}

    def latent_shape(self) -> tuple[int, ...]:
        return (self.context,)  # the most tokens one sample can hold (the memory check's bound)

    def serving_layout(self, model: nn.Module) -> SlotMap:
        return SlotMap()  # the rollout samples with the thinker's own layout

    def flops(self, batch: int) -> float:
        """A forward's FLOPs per token of one sample: 2 per parameter (attention over the
        short contexts here is small beside it)."""
        return float(2 * self.params * batch)


class OmniThinker(nn.Module):
    """The thinker behind the ``ARModel`` interface: ``forward`` scores given tokens (the
    actor), ``sample`` generates them with the KV cache (the rollout)."""

    def __init__(self, net: nn.Module, family: QwenOmniFamily) -> None:
        super().__init__()
        self.net = net
        self._family = Shared(family=family)  # shared across copies, unregistered

    @property
    def family(self) -> QwenOmniFamily:
        return self._family.family

    def ids_device(self, device: torch.device | str) -> torch.device:
        return torch.device(device)  # the thinker embeds the ids itself

    def _inputs(self, cond: Tensor | None, device: torch.device) -> dict[str, Tensor]:
        vision = self.family.vision_inputs(cond)
        dtype = next(self.net.parameters()).dtype
        return {
            k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in vision.items()
        }

    def forward(
        self,
        tokens: Tensor,
        temperature: Tensor | float,
        input_ids: Tensor,
        cond: Tensor | None = None,
    ) -> Tensor:
        """(B, T) log-probs (float32) of ``tokens`` (B, T) following the prompts ``input_ids``
        (B, L), each softmax at ``temperature``; 0 where ``tokens`` is ``NO_TOKEN``. One
        forward over prompt + completion, no cache: what training differentiates."""
        fam = self.family
        done = tokens == NO_TOKEN
        ids = torch.cat([input_ids, tokens.masked_fill(done, fam.pad_id)], 1)
        mask = torch.cat([input_ids != fam.pad_id, ~done], 1).long()
        out = self.net(
            input_ids=ids, attention_mask=mask, use_cache=False, **self._inputs(cond, ids.device)
        )
        start = input_ids.shape[1] - 1  # the logits at position i predict token i + 1
        logits = out.logits[:, start:-1].float()
        temp = torch.as_tensor(temperature, dtype=logits.dtype, device=logits.device)
        lp = log_softmax_allowed(logits / temp.reshape(-1, 1, 1), fam.banned)
        lp = lp.gather(-1, tokens.clamp(min=0)[..., None]).squeeze(-1)
        return lp.masked_fill(done, 0.0)

    @torch.no_grad()
    def sample(
        self, input_ids: Tensor, cond: Tensor | None, max_tokens: int, greedy: bool, seed: int
    ) -> tuple[Tensor, Tensor]:
        """Completions of the prompts ``input_ids`` (B, L), batched, with transformers'
        ``generate`` (KV cache): tokens (B, max_tokens) int64, ``NO_TOKEN`` after each one's
        first end-of-turn, and their log-probs (B, max_tokens) float32 at temperature 1,
        recorded at generation from the raw logits (0 after the end). ``greedy`` takes the
        argmax (held-out eval); else each token is drawn from the policy's own softmax (no
        top-k/top-p, no penalties: the recorded log-probs are the distribution sampled from).
        The draws come from ``seed`` (the torch RNG, forked, so the caller's is untouched)."""
        from transformers import GenerationConfig

        fam = self.family
        settings = dict(
            max_new_tokens=max_tokens, eos_token_id=fam.eos_id, pad_token_id=fam.pad_id,
            output_logits=True, return_dict_in_generate=True, do_sample=not greedy,
            suppress_tokens=fam.banned,
        )  # fmt: skip
        if not greedy:
            settings |= dict(temperature=1.0, top_k=0, top_p=1.0)
        ids = input_ids
        devices = [ids.device] if ids.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = self.net.generate(
                input_ids=ids,
                attention_mask=(ids != fam.pad_id).long(),
                generation_config=GenerationConfig(**settings),
                **self._inputs(cond, ids.device),
            )
        new = out.sequences[:, ids.shape[1] :]
        lp = log_softmax_allowed(torch.stack(out.logits, 1).float(), fam.banned)
        lp = lp.gather(-1, new[..., None]).squeeze(-1)
        is_end = (new == fam.eos_id).long()
        after = (is_end.cumsum(1) - is_end) > 0  # positions after the first end-of-turn
        new, lp = new.masked_fill(after, NO_TOKEN), lp.masked_fill(after, 0.0)
        short = max_tokens - new.shape[1]  # every row ended before max_tokens
        new = torch.nn.functional.pad(new, (0, short), value=NO_TOKEN)
        return new, torch.nn.functional.pad(lp, (0, short))


def log_softmax_allowed(logits: Tensor, banned: list[int]) -> Tensor:
    """log_softmax over the vocabulary with the ``banned`` ids' probabilities set to 0 (what
    ``generate``'s ``suppress_tokens`` samples from)."""
    index = torch.tensor(banned, device=logits.device)
    return torch.log_softmax(logits.index_fill(-1, index, float("-inf")), -1)


def save_local(model: OmniThinker, directory: str | Path) -> None:
    """``model`` as a local thinker directory (what ``model.path`` loads): transformers'
    ``save_pretrained`` layout for the weights, the tokenizer and the image processor."""
    model.net.save_pretrained(directory)
    model.family.tokenizer.save_pretrained(directory)
    model.family.processor.save_pretrained(directory)


def load(cfg, device: torch.device) -> OmniThinker:
    """A ``ModelConfig`` -> the thinker: a local directory (``model.path``) or a preset."""
    from transformers import AutoTokenizer, Qwen2_5OmniThinkerForConditionalGeneration

    if cfg.path:
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"config key 'model.path' = {cfg.path!r}: no config.json there (a thinker "
                "directory written by save_pretrained, with its tokenizer and image processor)"
            )
        net = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        processor = _local_processor(path, net.config)
        size = int(cfg.resolution or 32)
    elif cfg.preset in PRESETS:
        p = PRESETS[cfg.preset]
        tokenizer = tiny_tokenizer()
        net = Qwen2_5OmniThinkerForConditionalGeneration(tiny_config(tokenizer, p))
        processor = image_processor(p["patch"], p["merge"], p["image_size"])
        size = p["image_size"]
    else:
        raise ConfigError(
            "model family 'qwen_omni' needs model.path (a local thinker directory) or "
            f"model.preset (one of {sorted(PRESETS)}); got preset {cfg.preset!r}"
        )
    context = int(net.config.get_text_config().max_position_embeddings)
    params = sum(p.numel() for p in net.parameters())
    family = QwenOmniFamily(tokenizer, processor, size, context, params)
    return OmniThinker(net.to(device), family)


def _local_processor(path: Path, config):
    """The directory's own image processor (``preprocessor_config.json``), else Qwen2-VL's at
    the checkpoint's patch and merge sizes."""
    vision = config.vision_config
    if (path / "preprocessor_config.json").is_file():
        proc = image_processor(vision.patch_size, vision.spatial_merge_size, 32)
        return type(proc).from_pretrained(path)
    return image_processor(vision.patch_size, vision.spatial_merge_size, 32)


FAMILY = FamilySpec(
    load=load,
    family_class=QwenOmniFamily,
    presets=PRESETS,
    builtins=BUILTIN,
)
