"""Actor: the trainable model (peft LoRA adapters), optimizer, checkpoints."""
