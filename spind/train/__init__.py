"""Training drafters for a target: `spind train-drafter` (spind/train/cli.py)."""
