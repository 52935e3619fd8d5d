"""Model adapters: a canonical velocity API, a declared time convention, explicit LoRA targets."""
