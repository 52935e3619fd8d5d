"""One module per model family (see diffrl.models.family for the protocol)."""
