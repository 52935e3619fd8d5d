"""Datasets, prompts and tokenizers for diffrl."""
