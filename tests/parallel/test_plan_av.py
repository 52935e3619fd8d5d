"""``diffrl plan`` for the audio-video families beyond H3's FL2VA (diffrl/parallel/plan.py):
LTX-2's two token streams against autograd's saved tensors of its real block, the plan of both
LTX-2 recipes, and H3's Ref2VA rows against the packed sequence the net builds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("diffusers")

from diffrl.models.families import ltx2  # noqa: E402
from diffrl.models.families.ltx2 import ltx2_rope, ltx2_text_token, ltx2_token  # noqa: E402
from diffrl.models.memory import Widths  # noqa: E402


def _ltx2_block_saved(per_token_t: bool, n: tuple[int, int, int], rank: int) -> int:
    """Bytes autograd keeps for one forward of the tiny preset's block under peft LoRA on the
    family's targets (fp32 adapters), weights left out. The block is the model's own, called by
    the model's own forward (its RoPE tables, adaLN tables and masks as the model makes them);
    its inputs require grad, as every block's but the first do in training."""
    from diffusers import LTX2VideoTransformer3DModel
    from peft import LoraConfig, get_peft_model

    frames, side, n_audio, n_text = 3, 5, n[1], n[2]
    cfg = {**ltx2.PRESETS["ltx2-tiny"]["transformer"], "num_layers": 1}
    torch.manual_seed(0)
    tf = LTX2VideoTransformer3DModel(**cfg).to(torch.bfloat16)
    model = get_peft_model(tf, LoraConfig(r=rank, target_modules=list(ltx2.LORA_TARGETS)))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    block = tf.transformer_blocks[0]
    forward = block.forward

    def hooked(**kw):
        for k in ("hidden_states", "audio_hidden_states"):
            kw[k] = kw[k].detach().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return forward(**kw)

    block.forward = hooked
    b, n_video = 1, frames * side * side
    assert n_video == n[0]
    t = torch.full((b,), 500.0)
    text = torch.randn(b, n_text, cfg["caption_channels"], dtype=torch.bfloat16)
    tf(
        hidden_states=torch.randn(b, n_video, cfg["in_channels"], dtype=torch.bfloat16),
        audio_hidden_states=torch.randn(b, n_audio, cfg["audio_in_channels"]).bfloat16(),
        encoder_hidden_states=text,
        audio_encoder_hidden_states=text,
        timestep=t[:, None].expand(b, n_video) if per_token_t else t,
        audio_timestep=t,
        sigma=t,
        encoder_attention_mask=torch.ones(b, n_text),
        audio_encoder_attention_mask=torch.ones(b, n_text),
        num_frames=frames,
        height=side,
        width=side,
        audio_num_frames=n_audio,
        use_cross_timestep=True,
        return_dict=False,
    )
    return sum(nbytes for ptr, nbytes in kept.items() if ptr not in weights)


@pytest.mark.parametrize("per_token_t", [False, True], ids=["t2va", "frame-conditioned"])
def test_ltx2_block_formula_matches_autograd(per_token_t: bool) -> None:
    """Per video, audio and text token, on the CPU (rms=4: nn.RMSNorm's composite path keeps
    an fp32 copy); a frame condition's per-token timesteps add the per-token adaLN tables."""
    c = ltx2.PRESETS["ltx2-tiny"]["transformer"]
    rank, n = 4, (75, 7, 11)  # odd counts: no token count equals a width
    h, h_a = c["num_attention_heads"] * c["attention_head_dim"], 16
    w = Widths(h=h, a=h, f=4 * h, heads=c["num_attention_heads"], r=rank, rms=4)
    wa = dataclasses.replace(w, h=h_a, a=h_a, f=4 * h_a, heads=c["audio_num_attention_heads"])
    ax, heads_x = h_a, c["audio_num_attention_heads"]
    video = ltx2_token(w, ax, heads_x) + ltx2_rope(w, ax) + (16 * h if per_token_t else 0)
    audio = ltx2_token(wa, ax, heads_x) + ltx2_rope(wa, ax)
    want = n[0] * video + n[1] * audio + n[2] * (ltx2_text_token(w) + ltx2_text_token(wa))
    got = _ltx2_block_saved(per_token_t, n, rank)
    assert got / want == pytest.approx(1, abs=0.01), (got, want)
