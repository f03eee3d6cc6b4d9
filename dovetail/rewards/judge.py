"""The digit judge: a classifier trained on scikit-learn's digits, our stand-in for GenEval.

It retrains in well under a second with a fixed seed, so nothing needs to be shipped for it.
"""

from functools import lru_cache

import numpy as np
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression


@lru_cache(maxsize=1)
def digit_judge() -> LogisticRegression:
    digits = load_digits()
    judge = LogisticRegression(C=5.0, max_iter=3000, random_state=0)
    judge.fit(digits.data / 16.0, digits.target)
    return judge


def digit_probabilities(images: np.ndarray) -> np.ndarray:
    """(B, 10) class probabilities for images in [0, 1] of shape (B, 8, 8)."""
    flat = np.clip(images, 0.0, 1.0).reshape(len(images), -1)
    return digit_judge().predict_proba(flat)
