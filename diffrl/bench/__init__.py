"""``diffrl bench``: per-stage and whole-pipeline throughput and MFU of a recipe's engines,
against a plain diffusers-style loop (``mfu.py``)."""
