"""The digit judge: a multinomial logistic regression on scikit-learn's digits, our stand-in for GenEval.

Its weights ship in `dovetail/assets/digit-judge/` (`fit_digit_judge` made them), so every machine scores with
the same numbers and no process imports scikit-learn or refits at start-up (together seconds per process, paid by
the driver and by every device that scores).
"""

from functools import lru_cache
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

JUDGE_WEIGHTS = Path(__file__).resolve().parent.parent / "assets" / "digit-judge" / "judge.safetensors"


def fit_digit_judge(out: Path = JUDGE_WEIGHTS):
    """Fit the judge on all 1,797 digits (pixels scaled to [0, 1]; C=5, lbfgs, seed 0), write its weights to `out`
    (`coef` (10, 64) and `intercept` (10,), float64) and return the fitted scikit-learn regression."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    digits = load_digits()
    judge = LogisticRegression(C=5.0, max_iter=3000, random_state=0).fit(digits.data / 16.0, digits.target)
    weights = {"coef": np.ascontiguousarray(judge.coef_), "intercept": np.ascontiguousarray(judge.intercept_)}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out))
    return judge


@lru_cache(maxsize=1)
def digit_judge() -> tuple[np.ndarray, np.ndarray]:
    """The shipped judge's (coef, intercept)."""
    weights = load_file(str(JUDGE_WEIGHTS))
    return weights["coef"], weights["intercept"]


def digit_probabilities(images: np.ndarray) -> np.ndarray:
    """(B, 10) class probabilities for images in [0, 1] of shape (B, 8, 8): softmax(x W^T + b), what the fitted
    regression's `predict_proba` gives."""
    coef, intercept = digit_judge()
    logits = np.clip(images, 0.0, 1.0).reshape(len(images), -1) @ coef.T + intercept
    logits -= logits.max(axis=1, keepdims=True)
    probabilities = np.exp(logits)
    return probabilities / probabilities.sum(axis=1, keepdims=True)
