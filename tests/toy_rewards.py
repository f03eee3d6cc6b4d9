"""Rewards a tiny model learns within a few GRPO steps: what the fast "it learns" tests train on."""

import numpy as np

SHORT_CHARACTERS = 40


def short_completions(completions, prompts) -> np.ndarray:
    """1 for an empty completion, falling linearly to 0 at SHORT_CHARACTERS characters: the model learns to end
    early."""
    return np.array([1.0 - min(len(c), SHORT_CHARACTERS) / SHORT_CHARACTERS for c in completions])
