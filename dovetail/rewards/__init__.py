"""Rewards by name. Each takes images in [0, 1] of shape (B, H, W) and the prompts, returns (B,).

Rewards combine with weights: ``{"digit_match": 1.0, "jpeg_compressibility": 0.1}``.
"""

import importlib
import io
import re
from collections.abc import Callable, Sequence

import numpy as np
from PIL import Image

from dovetail.rewards.judge import digit_judge, digit_probabilities

RewardFn = Callable[[np.ndarray, Sequence[str]], np.ndarray]


def prompted_digit(prompt: str) -> int:
    match = re.fullmatch(r"\s*digit\s+(\d)\s*", prompt)
    if match is None:
        raise ValueError(f"prompt {prompt!r} does not name a digit (expected 'digit N')")
    return int(match.group(1))


def digit_match(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """Judge probability that the image shows the prompted digit."""
    probs = digit_probabilities(images)
    return probs[np.arange(len(images)), [prompted_digit(p) for p in prompts]]


def _jpeg_kilobytes(image: np.ndarray) -> float:
    """DDPO's measure: size of the JPEG at quality 95, after upscaling to at least 32x32."""
    pil = Image.fromarray((np.clip(image, 0, 1) * 255).round().astype(np.uint8), mode="L")
    scale = max(1, -(-32 // min(pil.size)))
    pil = pil.resize((pil.width * scale, pil.height * scale), Image.NEAREST)
    buffer = io.BytesIO()
    pil.save(buffer, format="JPEG", quality=95)
    return buffer.tell() / 1000.0


def jpeg_compressibility(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    return -np.array([_jpeg_kilobytes(im) for im in images])


def jpeg_incompressibility(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    return np.array([_jpeg_kilobytes(im) for im in images])


def brightness(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """Mean pixel intensity: the simplest target, handy to see a policy move."""
    return images.reshape(len(images), -1).mean(axis=1)


REWARDS: dict[str, RewardFn] = {
    "digit_match": digit_match,
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    "brightness": brightness,
}


class RewardError(RuntimeError):
    """A reward failed or returned a non-finite value; names the reward and the sample."""


def reward_fn(name: str) -> RewardFn:
    """A reward by name, or your own as "package.module:function" (same signature)."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        module, _, attribute = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"reward {name!r} cannot be imported: {error}") from None
    raise ValueError(f"unknown reward {name!r}; known rewards: {sorted(REWARDS)}, or give module:function")


def check_reward_names(weights: dict[str, float]) -> None:
    for name in weights:
        reward_fn(name)


def load_rewards(weights: dict[str, float]) -> None:
    """Build now what the rewards would build on first use (the judge is fitted in about a second), so that the
    first step of a run does not pay for it."""
    if "digit_match" in weights:
        digit_judge()


def score(images: np.ndarray, prompts: Sequence[str], weights: dict[str, float]) -> dict[str, np.ndarray]:
    """Each named reward and their weighted sum under "total"."""
    scores = {}
    for name in weights:
        try:
            values = np.asarray(reward_fn(name)(images, prompts), dtype=np.float64)
        except Exception as error:
            raise RewardError(f"reward {name!r} raised {type(error).__name__}: {error}") from error
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            i = int(bad[0])
            raise RewardError(f"reward {name!r} returned {values[i]} for sample {i} (prompt {prompts[i]!r})")
        scores[name] = values
    scores["total"] = sum(weights[name] * scores[name] for name in weights)
    return scores
