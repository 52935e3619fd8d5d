"""Actor -> rollout weight sync: map each trained LoRA tensor to its rollout slot, verify."""
