"""Parallel layout: degrees and device meshes (``dims``); TP/ETP plans, FSDP2 and Ulysses SP
are applied outside the model from these."""
