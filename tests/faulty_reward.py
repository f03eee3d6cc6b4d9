"""A reward that turns NaN while a flag file exists: how the runtime tests break a reward mid-run."""

import os

import numpy as np

from dovetail.rewards import digit_match
from dovetail.rewards.text import exact_answer


def nan_when_flagged(images, prompts):
    values = digit_match(images, prompts)
    if os.path.exists(os.environ["DOVETAIL_TEST_NAN_FLAG"]):
        values = values.copy()
        values[1] = np.nan
    return values


def nan_text_when_flagged(completions, prompts):
    """The same for language-model completions: the exact-answer reward, NaN at sample 1 while flagged."""
    values = exact_answer(completions, prompts)
    if os.path.exists(os.environ["DOVETAIL_TEST_NAN_FLAG"]):
        values = values.copy()
        values[1] = np.nan
    return values
