"""A reward that turns NaN while a flag file exists: how the runtime tests break a reward mid-run."""

import os

import numpy as np

from dovetail.rewards import digit_match


def nan_when_flagged(images, prompts):
    values = digit_match(images, prompts)
    if os.path.exists(os.environ["DOVETAIL_TEST_NAN_FLAG"]):
        values = values.copy()
        values[1] = np.nan
    return values
