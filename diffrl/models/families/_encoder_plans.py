"""The text encoders' tensor-parallel plans, applied on the ETP mesh (``parallel.etp``), by
encoder architecture: several families share an encoder (T5 in SD3, FLUX; UMT5 in Wan; Qwen3-VL
in MiniMax-H3; Qwen2.5-VL in Qwen-Image; Gemma-3 in LTX-2), and each family's record lists the
ones it uses in ``etp_plans``, keyed by the encoder's ``config.model_type`` (how the planner and
the launcher find an encoder's plan).
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from diffrl.parallel.tp import LocalHeads, PerHeadNorm, Plan

# T5 / UMT5 encoders (T5EncoderModel, UMT5EncoderModel): the relative-position bias is an
# Embedding(buckets, heads), column-sharded so each rank adds its own heads' bias (T5 has it in
# block 0 and passes it on; UMT5 has one per block). Gated-GELU MLP: wi_0, wi_1 -> wo.
T5_ENCODER_PLAN: Plan = {
    "encoder.block.*.layer.0.SelfAttention": LocalHeads("n_heads", "inner_dim"),
    "encoder.block.*.layer.0.SelfAttention.q": ColwiseParallel(),
    "encoder.block.*.layer.0.SelfAttention.k": ColwiseParallel(),
    "encoder.block.*.layer.0.SelfAttention.v": ColwiseParallel(),
    "encoder.block.*.layer.0.SelfAttention.relative_attention_bias": ColwiseParallel(),
    "encoder.block.*.layer.0.SelfAttention.o": RowwiseParallel(),
    "encoder.block.*.layer.1.DenseReluDense.wi*": ColwiseParallel(),  # wi, or wi_0 and wi_1
    "encoder.block.*.layer.1.DenseReluDense.wo": RowwiseParallel(),
}

# Qwen3-VL's text model (MiniMax-H3's encoder) and Qwen3: reshapes with -1 heads, so nothing is
# divided, but query and key/value head counts must both divide by the mesh size (GQA's group
# size stays num_heads / num_kv_heads on every rank). The encoders are frozen, so PerHeadNorm's
# gradient sum is moot here; it keeps the plan right should one train.
_QWEN3_LAYER = {
    "self_attn": LocalHeads(check=("config.num_attention_heads", "config.num_key_value_heads")),
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.q_norm": PerHeadNorm(heads_dim=2),  # on (B, S, H, D)
    "self_attn.k_norm": PerHeadNorm(heads_dim=2),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}
QWEN3_VL_ENCODER_PLAN: Plan = {
    f"model.language_model.layers.*.{k}": v for k, v in _QWEN3_LAYER.items()
}
QWEN3_ENCODER_PLAN: Plan = {f"model.layers.*.{k}": v for k, v in _QWEN3_LAYER.items()}

# Qwen2.5-VL's text model (Qwen-Image's encoder): Qwen3's layer without the qk-norm (q, k, v
# have biases, column-sharded with their rows); it too reshapes with -1 heads and reads its
# counts off the attention module itself. The vision tower stays whole (Qwen-Image encodes text).
QWEN2_5_VL_ENCODER_PLAN: Plan = {
    f"model.language_model.layers.*.{k}": v
    for k, v in {
        **{k: v for k, v in _QWEN3_LAYER.items() if "norm" not in k},
        "self_attn": LocalHeads(check=("num_heads", "num_key_value_heads")),
    }.items()
}

# Gemma-3's text model (LTX-2's encoder, Gemma3ForConditionalGeneration): Qwen3's layer shape,
# but its qk-norm runs after the transpose, on (B, H, S, D). LTX-2 reads every layer's hidden
# state, each the replicated output of a row-sharded projection plus the residual.
GEMMA3_ENCODER_PLAN: Plan = {
    f"model.language_model.layers.*.{k}": v
    for k, v in {
        **_QWEN3_LAYER,
        "self_attn.q_norm": PerHeadNorm(heads_dim=1),
        "self_attn.k_norm": PerHeadNorm(heads_dim=1),
    }.items()
}

ENCODER_TP_PLANS: dict[str, Plan] = {
    "t5": T5_ENCODER_PLAN,
    "umt5": T5_ENCODER_PLAN,
    "qwen3_vl": QWEN3_VL_ENCODER_PLAN,
    "qwen3": QWEN3_ENCODER_PLAN,
    "qwen2_5_vl": QWEN2_5_VL_ENCODER_PLAN,
    "gemma3": GEMMA3_ENCODER_PLAN,
}
