"""Controllers: the training loop (sync mode), one readable file each."""
