"""Tensor parallelism on CPU over gloo: each family's TP plan (and its text encoder's, on an ETP
mesh of its own) gives the unsharded forward on every rank, and a plan that does not fit the
model fails before anything is sharded.

Each parity test spawns 2 ranks (``spawn``, a free TCP port on 127.0.0.1). Every rank builds the
tiny preset's components from ``torch.manual_seed(0)`` (the same random weights everywhere),
runs the unsharded forward on fixed inputs, applies the plan on a 2-rank mesh, runs again and
writes the largest difference and what it checked to ``tmp_path``; the parent asserts on it.
The DiTs' parameter gradients are compared too (the sharded ones gathered): a weight every
head shares (qk-norm) would get only this rank's heads' share without ``PerHeadNorm``.
Tolerances, fp32: outputs atol 1e-5, gradients atol 2e-5 (the sharded matmuls only reorder
sums; diffs seen are ~5e-7 and ~2e-6).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import finish_rank, free_port, init_gloo, run_ranks
from torch.distributed.tensor import DTensor

from diffrl.errors import ConfigError
from diffrl.models.families._diffusers import init_weights
from diffrl.models.families._encoder_plans import ENCODER_TP_PLANS, T5_ENCODER_PLAN
from diffrl.parallel import tp

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)

WORLD = 2
ATOL = 1e-5  # outputs (magnitudes ~1)
GRAD_ATOL = 2e-5  # gradients (magnitudes up to ~25; seen ~2e-6)
# The presets' init (std 0.02) leaves a tiny DiT's blocks nearly silent (SD3's attention moves
# the output by ~1e-5); at 0.1 the sharded layers move it by 0.05-0.2, far above ATOL.
DIT_STD = 0.1
DEADLINE_S = 60.0  # a hang (a rank stuck in a collective) fails here, not at pytest's timeout


def _spawn(fn, *args) -> None:
    """Run ``fn(rank, port, *args)`` in WORLD fresh processes; re-raise a rank's failure."""
    run_ranks(fn, WORLD, (free_port(), *args), DEADLINE_S)


def _meshes(rank: int, port: int):
    """The TP mesh and a separate ETP mesh (here both over the 2 ranks)."""
    from torch.distributed.device_mesh import DeviceMesh

    init_gloo(rank, WORLD, port, DEADLINE_S)
    ranks = list(range(WORLD))
    return DeviceMesh("cpu", ranks, mesh_dim_names=("tp",)), DeviceMesh(
        "cpu", ranks, mesh_dim_names=("etp",)
    )


def _parity(module, mesh, plan, forward, grads: bool = False) -> dict:
    """The largest |sharded - unsharded| of ``forward(module)`` once ``plan`` is applied (and,
    with ``grads``, of every parameter's gradient of ``(out * probe).sum()``, the sharded ones
    gathered), and ``effect``: how far the output moves when every sharded Linear/Embedding
    outputs zeros (so a tolerance far below it cannot pass with a broken attention or MLP)."""
    with torch.no_grad():
        effect = _forward_with_sharded_zeroed(module, plan, forward)
    with torch.set_grad_enabled(grads):
        ref = forward(module)
        probe = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
        ref_grads = _grads(module, (ref * probe).sum()) if grads else {}
        tp.apply_plan(module, mesh, plan)
        out = forward(module)
        sharded_grads = _grads(module, (out * probe).sum()) if grads else {}
    result = dict(
        diff=(out - ref).abs().max().item(),
        effect=(effect - ref).abs().max().item(),
        shape=list(out.shape),
        dtensors=sum(isinstance(p, DTensor) for p in module.parameters()),
    )
    if grads:
        assert sharded_grads.keys() == ref_grads.keys()
        result["grad_diff"] = max(
            (sharded_grads[k] - g).abs().max().item() for k, g in ref_grads.items()
        )
        result["grad_scale"] = max(g.abs().max().item() for g in ref_grads.values())
    return result


def _grads(module, loss) -> dict:
    """Each parameter's gradient of ``loss``, a sharded one gathered to its full shape (none for
    a parameter the forward does not reach, e.g. FLUX's guidance embedder when unused)."""
    module.zero_grad(set_to_none=True)
    loss.backward()
    full = {}
    for name, p in module.named_parameters():
        g = p.grad
        if g is not None:
            full[name] = g.full_tensor() if isinstance(g, DTensor) else g.clone()
    module.zero_grad(set_to_none=True)
    return full


def _forward_with_sharded_zeroed(module, plan, forward):
    """``forward(module)`` with every Linear/Embedding the plan shards outputting zeros."""
    paths = tp.resolve(module, plan)
    hooks = [
        module.get_submodule(path).register_forward_hook(lambda m, i, o: torch.zeros_like(o))
        for pattern, style in plan.items()
        if isinstance(style, (tp.ColwiseParallel, tp.RowwiseParallel))
        for path in paths[pattern]
    ]
    try:
        return forward(module)
    finally:
        for h in hooks:
            h.remove()


def _read(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


# --- SD3.5 DiT (TP) + T5 encoder (ETP) --------------------------------------------------------


def _sd3_rank(rank: int, port: int, out: Path) -> None:
    from diffrl.models.families import sd3

    tp_mesh, etp_mesh = _meshes(rank, port)
    torch.manual_seed(0)
    parts = sd3.tiny_components()
    dit, t5 = parts["transformer"], parts["text_encoder_3"]
    init_weights(dit, std=DIT_STD)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 8, 8, generator=g)  # (B, C, H, W) latents
    txt = torch.randn(2, 12, 48, generator=g)  # (B, L, joint_attention_dim)
    pooled = torch.randn(2, 40, generator=g)
    t = torch.tensor([250.0, 900.0])
    ids = torch.randint(0, t5.config.vocab_size, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0  # one padded row: the mask goes through the sharded heads' bias too

    def dit_fwd(m):
        return m(x, txt, pooled, t, return_dict=False)[0]

    def t5_fwd(m):
        return m(input_ids=ids, attention_mask=mask).last_hidden_state

    result = dict(
        dit=_parity(dit, tp_mesh, sd3.FAMILY.tp_plan, dit_fwd, grads=True),
        t5=_parity(t5, etp_mesh, sd3.FAMILY.etp_plans["t5"], t5_fwd),
        heads=[dit.transformer_blocks[0].attn.heads, dit.transformer_blocks[0].attn2.heads],
        t5_heads=t5.encoder.block[0].layer[0].SelfAttention.n_heads,
        local_q=list(dit.transformer_blocks[0].attn.to_q.weight.to_local().shape),
        again=_error_of(lambda: tp.apply_plan(dit, tp_mesh, sd3.TP_PLAN)),
    )
    finish_rank(out, rank, result)


def _error_of(fn) -> str:
    try:
        fn()
    except ConfigError as e:
        return str(e)
    return ""


def test_sd3_dit_and_t5_encoder_sharded_match_unsharded(tmp_path):
    _spawn(_sd3_rank, tmp_path)
    for r in _read(tmp_path):
        assert r["dit"]["shape"] == [2, 16, 8, 8] and r["t5"]["shape"] == [2, 16, 48]
        assert r["dit"]["diff"] <= ATOL and r["dit"]["grad_diff"] <= GRAD_ATOL, r
        assert r["t5"]["diff"] <= ATOL, r
        assert min(r["dit"]["effect"], r["t5"]["effect"]) > 1000 * ATOL  # the shards matter
        assert r["heads"] == [1, 1] and r["t5_heads"] == 2  # 2 and 4 heads over 2 ranks
        assert r["local_q"] == [16, 32]  # each rank holds half of to_q's output columns
        assert r["dit"]["dtensors"] > 0 and r["t5"]["dtensors"] > 0
        assert "already has DTensor parameters" in r["again"]  # a second apply_plan refuses


# --- Wan DiT (TP, q/k normed across heads) + UMT5 encoder (ETP) --------------------------------


def _wan_rank(rank: int, port: int, out: Path) -> None:
    from diffrl.models.families import wan

    tp_mesh, etp_mesh = _meshes(rank, port)
    torch.manual_seed(0)
    parts = wan.tiny_components()
    dit, umt5 = parts["transformer"], parts["text_encoder"]
    init_weights(dit, std=DIT_STD)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 2, 4, 4, generator=g)  # (B, C, F, H, W): 2 x 2 x 2 = 8 tokens
    txt = torch.randn(2, 10, 32, generator=g)  # (B, L, text_dim)
    t = torch.tensor([250.0, 900.0])
    ids = torch.randint(0, umt5.config.vocab_size, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, 12:] = 0

    def dit_fwd(m):
        return m(x, t, txt, return_dict=False)[0]

    def umt5_fwd(m):
        return m(input_ids=ids, attention_mask=mask).last_hidden_state

    result = dict(
        dit=_parity(dit, tp_mesh, wan.FAMILY.tp_plan, dit_fwd, grads=True),
        umt5=_parity(umt5, etp_mesh, wan.FAMILY.etp_plans["umt5"], umt5_fwd),
        heads=[dit.blocks[0].attn1.heads, dit.blocks[0].attn2.heads],
        local_norm_q=list(dit.blocks[0].attn1.norm_q.weight.to_local().shape),
    )
    finish_rank(out, rank, result)


def test_wan_dit_and_umt5_encoder_sharded_match_unsharded(tmp_path):
    _spawn(_wan_rank, tmp_path)
    for r in _read(tmp_path):
        assert r["dit"]["shape"] == [2, 16, 2, 4, 4] and r["umt5"]["shape"] == [2, 16, 32]
        assert r["dit"]["diff"] <= ATOL and r["dit"]["grad_diff"] <= GRAD_ATOL, r
        assert r["umt5"]["diff"] <= ATOL, r
        assert min(r["dit"]["effect"], r["umt5"]["effect"]) > 1000 * ATOL
        assert r["heads"] == [1, 1]
        assert r["local_norm_q"] == [16]  # the across-heads norm's weight, sharded like q


# --- MiniMax-H3 DiT (TP, self-attention only) + Qwen3-VL text encoder (ETP) -------------------


def _h3_inputs(g: torch.Generator) -> dict:
    """One packed sequence of 6 text, 8 video and 4 audio rows at two noise levels."""
    n_txt, n_vid, n_aud = 6, 8, 4
    seq = n_txt + n_vid + n_aud
    tags = torch.tensor([1] * n_txt + [0] * n_vid + [2] * n_aud)  # 0 video, 1 text, 2 audio
    return dict(
        hidden_states=torch.randn(2, n_vid, 16, generator=g),  # (B, Nv, C * 1 * 2 * 2)
        audio_hidden_states=torch.randn(2, n_aud, 4, generator=g),  # (B, Na, C_audio)
        encoder_hidden_states=torch.randn(2, n_txt, 32, generator=g),  # (B, Nt, text_dim)
        timestep=torch.tensor([0.3, 0.8]),
        timestep_indices=torch.randint(0, 2, (seq,), generator=g),
        token_tags=tags,
        position_ids=torch.randint(0, 8, (seq, 3), generator=g),
        video_indices=torch.arange(n_txt, n_txt + n_vid),
        audio_indices=torch.arange(n_txt + n_vid, seq),
        text_indices=torch.arange(n_txt),
        return_dict=False,
    )


def _h3_rank(rank: int, port: int, out: Path) -> None:
    from diffrl.models.families import minimax_h3

    tp_mesh, etp_mesh = _meshes(rank, port)
    torch.manual_seed(0)
    parts = minimax_h3.tiny_components()
    dit, qwen = parts["transformer"], parts["text_encoder"]
    init_weights(dit, std=DIT_STD)
    g = torch.Generator().manual_seed(1)
    inputs = _h3_inputs(g)
    ids = torch.randint(0, qwen.config.text_config.vocab_size, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0

    def dit_fwd(m):
        video, audio = m(**inputs)
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)  # (B, Nv*16 + Na*4)

    def qwen_fwd(m):  # the text path the family reads (no LM head)
        return m.model(input_ids=ids, attention_mask=mask).last_hidden_state

    result = dict(
        dit=_parity(dit, tp_mesh, minimax_h3.FAMILY.tp_plan, dit_fwd, grads=True),
        qwen=_parity(qwen, etp_mesh, minimax_h3.FAMILY.etp_plans["qwen3_vl"], qwen_fwd),
        heads=[
            dit.token_refiner.refiner_blocks[0].attn.heads,
            dit.transformer_blocks[0].attn.heads,
        ],
        local_q=list(qwen.model.language_model.layers[0].self_attn.q_proj.weight.to_local().shape),
    )
    finish_rank(out, rank, result)


def test_h3_dit_and_qwen3_vl_encoder_sharded_match_unsharded(tmp_path):
    _spawn(_h3_rank, tmp_path)
    for r in _read(tmp_path):
        assert r["dit"]["shape"] == [2, 8 * 16 + 4 * 4] and r["qwen"]["shape"] == [2, 12, 32]
        assert r["dit"]["diff"] <= ATOL and r["dit"]["grad_diff"] <= GRAD_ATOL, r
        assert r["qwen"]["diff"] <= ATOL, r
        assert min(r["dit"]["effect"], r["qwen"]["effect"]) > 1000 * ATOL
        assert r["heads"] == [1, 1]
        assert r["local_q"] == [16, 32]  # 2 of Qwen3-VL's 4 query heads (head_dim 8) per rank


# --- the plan checks, in one process --------------------------------------------------------


def _mesh_of(size: int):
    # check_plan runs before parallelize_module touches the mesh, so a stand-in will do
    return types.SimpleNamespace(ndim=1, size=lambda: size)


def test_unmatched_pattern_is_named_and_nothing_is_sharded():
    from diffrl.models.families import sd3

    torch.manual_seed(0)
    dit = sd3.tiny_components()["transformer"]
    plan = {**sd3.TP_PLAN, "transformer_blocks.*.attn.to_qkv": tp.ColwiseParallel()}
    with pytest.raises(
        ConfigError, match=r"no submodule matches \['transformer_blocks\.\*\.attn\.to_qkv'\]"
    ):
        tp.apply_plan(dit, _mesh_of(2), plan)
    assert dit.transformer_blocks[0].attn.heads == 2  # untouched
    assert not any(isinstance(p, DTensor) for p in dit.parameters())


def test_heads_not_divisible_is_a_clear_error():
    from diffrl.models.families import sd3

    torch.manual_seed(0)
    parts = sd3.tiny_components()
    with pytest.raises(
        ConfigError, match=r"mesh of 3: every head count.*transformer_blocks\.0\.attn\.heads=2"
    ):
        tp.apply_plan(parts["transformer"], _mesh_of(3), sd3.TP_PLAN)
    with pytest.raises(ConfigError, match=r"SelfAttention\.n_heads=4"):
        tp.check_plan(parts["text_encoder_3"], 3, T5_ENCODER_PLAN)
    assert parts["transformer"].transformer_blocks[0].attn.heads == 2
    tp.check_plan(parts["transformer"], 2, sd3.TP_PLAN)  # divides: no error


def test_a_wrapped_linear_is_named_before_anything_is_sharded():
    # peft's LoRA wraps a target Linear; torch's ColwiseParallel would raise NotImplementedError
    from diffrl.models.families import sd3

    torch.manual_seed(0)
    dit = sd3.tiny_components()["transformer"]
    attn = dit.transformer_blocks[1].attn
    attn.to_q = torch.nn.Sequential(attn.to_q)
    with pytest.raises(ConfigError, match=r"blocks\.1\.attn\.to_q is a Sequential, not a Linear"):
        tp.apply_plan(dit, _mesh_of(2), sd3.TP_PLAN)
    assert dit.transformer_blocks[0].attn.heads == 2


def test_fused_chunks_not_divisible_is_a_clear_error():
    from diffrl.models.families import minimax_h3

    torch.manual_seed(0)
    dit = minimax_h3.tiny_components()["transformer"]
    plan = {"transformer_blocks.*.ff.net.0.proj": tp.FusedColwiseParallel(chunks=2)}
    with pytest.raises(ConfigError, match=r"ff\.net\.0\.proj\.out_features=128 \(2 fused\)"):
        tp.check_plan(dit, 3, plan)  # 128 = 2 chunks of 64; 64 rows over 3 ranks
    tp.check_plan(dit, 2, minimax_h3.TP_PLAN)


def test_fused_rowwise_chunks_not_divisible_is_a_clear_error():
    # FLUX's single-block proj_out reads [attn; 4 x mlp]: 5 chunks of 32 columns in flux1-tiny
    from diffrl.models.families import flux

    torch.manual_seed(0)
    dit = flux.tiny_components()["transformer"]
    proj_out = "single_transformer_blocks.*.proj_out"
    with pytest.raises(ConfigError, match=r"blocks\.0\.proj_out\.in_features=160 \(5 fused\)"):
        tp.check_plan(dit, 3, {proj_out: flux.TP_PLAN[proj_out]})  # 32 columns over 3 ranks
    with pytest.raises(ConfigError, match=r"proj_out\.in_features=160 \(3 fused\)"):
        tp.check_plan(dit, 2, {proj_out: tp.FusedRowwiseParallel(3)})
    tp.check_plan(dit, 2, flux.TP_PLAN)


def test_local_rope_cuts_each_rank_s_heads_and_refuses_what_it_cannot_cut():
    """LocalRope's pre-hook, on a stand-in mesh of 2 (rank 1): a 3-D table is cut by columns,
    a 4-D one by heads; a table that does not split, or tables passed by position, refuse."""
    mesh = types.SimpleNamespace(size=lambda: 2, get_local_rank=lambda: 1)
    seen = {}

    class Attn(torch.nn.Module):
        heads = 4

        def forward(self, x, query_rotary_emb=None, key_rotary_emb=None):
            seen.update(q=query_rotary_emb, k=key_rotary_emb)
            return x

    attn = tp.LocalRope("heads", kwargs=("query_rotary_emb", "key_rotary_emb"))._apply(Attn(), mesh)
    assert attn.heads == 2
    cols = torch.arange(8.0).expand(1, 3, 8)  # (B, S, heads * head_dim)
    per_head = torch.arange(4.0).view(1, 4, 1, 1).expand(1, 4, 3, 2)  # (B, H, S, D / 2)
    attn(torch.zeros(1), query_rotary_emb=(cols, cols), key_rotary_emb=(per_head, per_head))
    assert seen["q"][0][0, 0].tolist() == [4.0, 5.0, 6.0, 7.0]  # rank 1's two heads' columns
    assert seen["k"][1][0, :, 0, 0].tolist() == [2.0, 3.0]
    with pytest.raises(ConfigError, match=r"RoPE table of shape \(1, 3, 7\).*over 2 ranks"):
        attn(torch.zeros(1), query_rotary_emb=(cols[..., :7], cols[..., :7]))
    with pytest.raises(ConfigError, match=r"by keyword"):
        attn(torch.zeros(1), (cols, cols))


def test_qk_norm_entries_are_optional():
    # SD3.0 has no qk-norm: the SD3.5 plan's norm_q/norm_k entries match nothing, and that is fine
    from diffusers import SD3Transformer2DModel

    from diffrl.models.families import sd3
    from diffrl.models.families._diffusers import random_component

    cfg = {**sd3.PRESETS["sd35-tiny"]["transformer"], "qk_norm": None, "dual_attention_layers": ()}
    dit = random_component(SD3Transformer2DModel, cfg, torch.float32, torch.device("cpu"))
    paths = tp.check_plan(dit, 2, sd3.TP_PLAN)
    assert paths["transformer_blocks.*.attn.norm_q"] == []
    assert paths["transformer_blocks.*.attn.to_q"] == [
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.1.attn.to_q",
    ]


def test_plans_live_in_the_family_records_and_encoder_plans_by_model_type():
    from diffrl.models.registry import FAMILIES

    with_tp = {name for name, f in FAMILIES.items() if f.tp_plan}
    assert with_tp == {"sd3", "flux", "qwen_image", "wan", "ltx2", "minimax_h3"}
    assert FAMILIES["tiny_dit"].tp_plan is None  # the refusal's subject (test_tp_lora_gloo)
    for f in FAMILIES.values():  # an ETP plan is one of the shared encoder plans, by model_type
        assert all(ENCODER_TP_PLANS[k] is v for k, v in f.etp_plans.items()), f.name
    # the encoders' config.model_type, which is how a caller finds an encoder's plan
    from transformers import Qwen3VLConfig, T5Config, UMT5Config

    for cfg in (T5Config, UMT5Config, Qwen3VLConfig):
        assert cfg.model_type in ENCODER_TP_PLANS


# --- FLUX, Qwen-Image, LTX-2 DiTs (TP) through the family's own forward; their encoders (ETP) --

# one process group for the three (each rank's spawn and imports are most of a small test's time)
FAMILY_DITS = [("flux", "flux1-tiny"), ("qwen_image", "qwen-image-tiny"), ("ltx2", "ltx2-tiny")]


def _family_dit(family: str, preset: str):
    """The tiny preset's model (seed 0, the DiT at DIT_STD), its DiT, and a forward of the
    whole family model (packing, RoPE tables, text states: the real call) on fixed inputs."""
    from diffrl.models.family import transformer_root
    from diffrl.models.registry import ModelConfig, load_model

    torch.manual_seed(0)
    model = load_model(ModelConfig(family=family, preset=preset), "cpu")
    dit = transformer_root(model)
    init_weights(dit, std=DIT_STD)
    g = torch.Generator().manual_seed(1)
    x = torch.randn((2, *model.family.latent_shape()), generator=g)
    ids = model.family.tokenize(["a red square", "a blue circle"]).input_ids
    sigma = torch.tensor([0.3, 0.8])
    return model, dit, lambda _: model(x, sigma, ids)


def _encoder(model):
    """The family's one text encoder, as ETP finds it."""
    from diffrl.parallel.etp import text_encoders

    (encoder,) = text_encoders(model).values()
    return encoder


def _gemma3(model):
    """A Gemma-3 of ltx2-tiny's shape but 2 key/value heads: the preset's one KV head does not
    split over 2 ranks (ETP refuses it by name), and the plan's point is the sharded heads."""
    from transformers import Gemma3ForConditionalGeneration

    from diffrl.models.families._diffusers import random_component

    cfg = _encoder(model).config.to_dict()
    cfg["text_config"]["num_key_value_heads"] = 2
    torch.manual_seed(0)
    return random_component(Gemma3ForConditionalGeneration, cfg, torch.float32, "cpu")


def _families_rank(rank: int, port: int, out: Path) -> None:
    from diffrl.models.registry import FAMILIES

    tp_mesh, etp_mesh = _meshes(rank, port)
    result = {}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 40, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # left-padded, as both pipelines pad
    for family, preset in FAMILY_DITS:
        model, dit, fwd = _family_dit(family, preset)
        result[family] = _parity(dit, tp_mesh, FAMILIES[family].tp_plan, fwd, grads=True)
        # every attention (a module with to_q) now sees its 2 heads / 2 ranks
        result[family]["heads"] = sorted({m.heads for m in dit.modules() if hasattr(m, "to_q")})
        if family == "qwen_image":  # Qwen2.5-VL: the last hidden state, as the family reads it
            enc = _encoder(model)
            plan = FAMILIES[family].etp_plans["qwen2_5_vl"]
            result["qwen2_5_vl"] = _parity(
                enc, etp_mesh, plan, lambda m: m.model(input_ids=ids, attention_mask=mask)[0]
            )
        if family == "ltx2":  # Gemma-3: every layer's hidden state, as the family stacks them
            enc, plan = _gemma3(model), FAMILIES[family].etp_plans["gemma3"]
            preset_gemma = _encoder(model)
            result["preset_gemma3"] = _error_of(lambda: tp.check_plan(preset_gemma, 2, plan))  # noqa: B023

            def gemma_fwd(m):
                out = m.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
                return torch.stack(out.hidden_states, -1)

            result["gemma3"] = _parity(enc, etp_mesh, plan, gemma_fwd)
    finish_rank(out, rank, result)


def test_flux_qwen_image_ltx2_dits_sharded_match_unsharded(tmp_path):
    """Forward and every parameter's gradient at tp=2 against the unsharded model, for FLUX
    (single blocks' fused proj_out included), Qwen-Image and LTX-2 (all six attentions, RoPE
    cut per rank). Outputs atol 1e-5 (seen <= 1e-6); gradients within 2e-6 of the largest
    gradient (reordered fp32 sums; magnitudes to ~60, seen <= 3.1e-7 of it, LTX-2's). And the
    text encoders' ETP plans on the same ranks: Qwen2.5-VL (Qwen-Image's) and Gemma-3 (LTX-2's)
    give the unsharded hidden states."""
    _spawn(_families_rank, tmp_path)
    for r in _read(tmp_path):
        for family, _ in FAMILY_DITS:
            got = r[family]
            assert got["diff"] <= ATOL, (family, got)
            assert got["grad_diff"] <= 2e-6 * got["grad_scale"], (family, got)
            assert got["effect"] > 1000 * ATOL, (family, got)
            assert got["dtensors"] > 0 and got["heads"] == [1], (family, got)
        for encoder in ("qwen2_5_vl", "gemma3"):  # their ETP plans
            got = r[encoder]
            assert got["diff"] <= ATOL and got["effect"] > 1000 * ATOL, (encoder, got)
        assert "num_key_value_heads=1" in r["preset_gemma3"]  # ltx2-tiny's Gemma: refused
