"""Rewards by name. Each takes images in [0, 1] of shape (B, H, W) (one channel: the built-in model's) or
(B, H, W, 3) (RGB: a diffusers model's VAE) and the prompts, returns (B,).

A video model's samples are videos (B, F, H, W, 3) in [0, 1], one (F, H, W, 3) array of frames per sample. A video
reward (marked with `video_reward`, as `temporal_smoothness`; a user's own function too) takes them whole, one
number per video; an image reward scores every frame as an image and a video gets its frames' mean, so any image
reward serves a video run. A video reward given images sees each as a one-frame video.

Rewards combine with weights: ``{"digit_match": 1.0, "jpeg_compressibility": 0.1}``. Your own reward is named
"package.module:function" and imported, when the config is read, even for a dry run: a config is code. Set
DOVETAIL_REWARD_MODULES to the comma-separated module prefixes that may be imported so (e.g. "myrewards,lab.rl";
"" allows none) to run configs you did not write.

What holds, and where. Your own reward runs in a reward process (`dovetail.rewards.process`, one per process that
calls rewards), so `reward_timeout_s` stops a call whatever it does: waits on a server, holds the GIL, loops in C.
Whatever it raises, SystemExit and KeyboardInterrupt included, and a process it ends are a RewardError naming it,
never the run's own exit or Ctrl-C. Ours (here and in `dovetail.rewards.text`) are fast, bounded and trusted: they
run in the calling process, directly, with no time limit. Every output is then checked: one finite number per
sample, else a RewardError naming the reward and the sample.

Model rewards (`MODEL_REWARDS`: CLIP score, PickScore, HPS v2, ImageReward, a sequence-classification reward
model) load a model from the user's directory (`reward_models.NAME.path`) onto the device of the engine that
scores, and the `http` reward posts batches to a reward server (`reward_server`); both are ours, so they run in
the calling process too. `RewardSources` carries what they need besides a name; docs/rewards.md gives each
reward's formula and source."""

import importlib
import inspect
import io
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from dovetail.rewards import process
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
    pil = Image.fromarray((np.clip(image, 0, 1) * 255).round().astype(np.uint8))  # grey (H, W) or RGB (H, W, 3)
    scale = max(1, -(-32 // min(pil.size)))
    pil = pil.resize((pil.width * scale, pil.height * scale), Image.Resampling.NEAREST)
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


def video_reward(fn: RewardFn) -> RewardFn:
    """Mark `fn` a video reward: `fn(videos, prompts)` takes videos (B, F, H, W, 3) whole (see the module's
    docstring). A user's reward module may use it, or set `fn.video = True` itself."""
    setattr(fn, "video", True)  # noqa: B010 (a function's own attribute, which the Callable type does not declare)
    return fn


@video_reward
def temporal_smoothness(videos: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """Minus the mean absolute change of a pixel from one frame to the next: 0 for a still video (or one frame), lower
    the more it flickers."""
    changes = np.abs(np.diff(videos, axis=1)).reshape(len(videos), -1)
    return -changes.sum(axis=1) / max(changes.shape[1], 1)


REWARDS: dict[str, RewardFn] = {
    "digit_match": digit_match,
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    "brightness": brightness,
    "temporal_smoothness": temporal_smoothness,
}


class RewardError(RuntimeError):
    """A reward failed or returned a non-finite value; names the reward and the sample."""


@dataclass(frozen=True)
class RewardModel:
    """A model reward's directory (what `save_pretrained` wrote) and the samples it scores per forward pass."""

    path: str
    batch_size: int = 32


@dataclass(frozen=True)
class RewardServer:
    """The `http` reward's server: batches of `batch_size` samples POSTed to `url`, at most `concurrency` at once,
    each given `timeout_s`, and tried again up to `retries` times after backoff_s, 2 backoff_s, 4 backoff_s..."""

    url: str
    concurrency: int = 4
    timeout_s: float = 60.0
    retries: int = 3
    backoff_s: float = 1.0
    batch_size: int = 64


@dataclass(frozen=True)
class RewardSources:
    """What rewards need besides their names: the model rewards' directories by reward name, the reward server,
    and the device the models run on (the scoring engine's: a reward-pool device where runtime.reward_devices sets
    one apart)."""

    models: Mapping[str, RewardModel] = field(default_factory=dict)
    server: RewardServer | None = None
    device: str = "cpu"


@dataclass(frozen=True)
class ModelReward:
    """A model reward: what it scores ("images" or "texts"), the model class its directory's config.json must name
    (`architectures`; a suffix, as ...ForSequenceClassification), what the user saves there, and the
    "module:function" that loads it: `function(RewardModel, device)` returns the reward function. A string, imported
    on first use, so that reading a config imports no torch. `files`: the files beside the model it reads, each
    group's one of several names (a processor's or tokenizer's, as transformers versions have written them)."""

    scores: str
    architecture: str
    saved: str
    loader: str
    files: tuple[tuple[str, ...], ...]


CLIP_FILES = (("processor_config.json", "preprocessor_config.json"), ("tokenizer.json", "vocab.json"))
TOKENIZER_FILES = (("tokenizer.json", "tokenizer_config.json"),)
IMAGE_REWARD_FILES = (("image_reward_head.safetensors",), *TOKENIZER_FILES)


MODEL_REWARDS: dict[str, ModelReward] = {
    "clip_score": ModelReward(
        "images", "CLIPModel", "a CLIPModel and its CLIPProcessor", "dovetail.rewards.models:clip_score", CLIP_FILES
    ),
    "pickscore": ModelReward(
        "images", "CLIPModel", "a CLIPModel and its CLIPProcessor", "dovetail.rewards.models:pickscore", CLIP_FILES
    ),
    "hps_v2": ModelReward(
        "images",
        "CLIPModel",
        "a CLIPModel with HPS v2's weights and its CLIPProcessor (`dovetail convert-clip` writes one)",
        "dovetail.rewards.models:hps_v2",
        CLIP_FILES,
    ),
    "image_reward": ModelReward(
        "images",
        "BlipForImageTextRetrieval",
        "ImageReward's BLIP, score head and BERT tokenizer (`dovetail convert-imagereward` writes them)",
        "dovetail.rewards.models:image_reward",
        IMAGE_REWARD_FILES,
    ),
    "lm_reward_model": ModelReward(
        "texts",
        "ForSequenceClassification",
        "an AutoModelForSequenceClassification and its tokenizer",
        "dovetail.rewards.models:lm_reward_model",
        TOKENIZER_FILES,
    ),
}

SERVED_REWARD = "http"
"""The reward a reward server computes (`reward_server`), for images and texts alike."""

SERVER_CLIENT = "dovetail.rewards.http:served_reward"
"""`served_reward(RewardServer, scores)`: the `http` reward's function, imported on first use."""


def model_problem(name: str, path: Path) -> str | None:
    """What keeps `path` from serving as model reward `name`'s directory, in words with the fix; None if nothing.
    Read from its config.json and the names of its files: no model is loaded."""
    spec = MODEL_REWARDS[name]
    fix = f"save {spec.saved} there with save_pretrained"
    if not path.is_dir():
        return f"{path} is not a directory; {fix}"
    try:
        saved = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return f"{path} has no readable config.json; {fix}"
    architectures = saved.get("architectures") if isinstance(saved, dict) else None
    if not isinstance(architectures, list) or not any(str(a).endswith(spec.architecture) for a in architectures):
        return f"{path} holds a {architectures or 'model of no architecture'}, not a ...{spec.architecture}; {fix}"
    for names in spec.files:
        if not any((path / name).is_file() for name in names):
            return f"{path} has no {' or '.join(names)}; {fix}"
    return None


def load_function(name: str) -> Callable:
    """The function a "module:function" string names: a lazy registry's entry, ours."""
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


def sourced_reward(name: str, sources: RewardSources, scores: str) -> Callable | None:
    """Reward `name` where it is a model reward or the `http` one (their functions of images or texts, `scores`,
    loaded on first use and kept); None for any other name. A ValueError where its section is missing."""
    if name == SERVED_REWARD:
        if sources.server is None:
            raise ValueError(f"reward {name!r} posts to a reward server: give reward_server.url")
        return load_function(SERVER_CLIENT)(sources.server, scores)
    spec = MODEL_REWARDS.get(name)
    if spec is None:
        return None
    if spec.scores != scores:
        raise ValueError(
            f"reward {name!r} scores {spec.scores}, not {scores}; model rewards for {scores}: "
            f"{sorted(n for n, s in MODEL_REWARDS.items() if s.scores == scores)}"
        )
    if name not in sources.models:
        raise ValueError(
            f"reward {name!r} loads a model: give reward_models.{name}.path, the directory of {spec.saved}"
        )
    model = sources.models[name]
    try:
        return load_function(spec.loader)(model, sources.device)
    except Exception as error:  # what the config's check cannot see: the weights, a tokenizer's contents
        raise RewardError(
            f"reward {name!r} could not load {spec.saved} from {model.path} onto {sources.device}: "
            f"{process.describe(error)}"
        ) from None


class RewardRaised(RewardError):
    """The reward raised (the other failures: it overran its time, ended its process, returned no scores)."""


REWARD_TIMEOUT_S = 600.0
"""Default of a run's `reward_timeout_s`: a reward call (one batch) that takes longer is a failure, not a hang."""


def call_reward(name: str, fn: Callable, args: tuple, kwargs: dict, samples: int, timeout_s: float):
    """`fn(*args, **kwargs)` on `samples` samples: a user's reward ("package.module:function") in the reward
    process, stopped after `timeout_s` whatever it does (`dovetail.rewards.process`); one of ours here, directly.
    What the reward raises, SystemExit and KeyboardInterrupt included, is a RewardRaised naming it, in one line."""
    if ":" not in name:
        try:
            return fn(*args, **kwargs)
        except RewardError:  # ours, already one line naming what failed (the reward server)
            raise
        except Exception as error:
            raise RewardRaised(f"reward {name!r} raised {process.describe(error)}") from error
    try:
        return process.call(name, args, kwargs, samples, timeout_s)
    except process.Raised as error:
        raise RewardRaised(f"reward {name!r} raised {error}") from None
    except process.Failed as error:
        raise RewardError(f"reward {name!r} {error}") from None


ALLOWED_MODULES = "DOVETAIL_REWARD_MODULES"
"""Environment variable: comma-separated module prefixes a custom reward may be imported from; unset, any."""


def reward_fn(name: str, sources: RewardSources = RewardSources()) -> RewardFn:
    """A reward by name (a model reward's and the `http` one's from `sources`), or your own as
    "package.module:function" (same signature)."""
    if name in REWARDS:
        return REWARDS[name]
    sourced = sourced_reward(name, sources, "images")
    if sourced is not None:
        return sourced
    if ":" in name:
        return _image_reward(name, custom_reward(name, "(images, prompts)"))
    known = sorted([*REWARDS, *(n for n, s in MODEL_REWARDS.items() if s.scores == "images"), SERVED_REWARD])
    raise ValueError(f"unknown reward {name!r}; known rewards: {known}, or give module:function")


SAMPLE_NAMES = frozenset({"images", "image", "videos", "video", "samples"})
PROMPT_NAMES = frozenset({"prompts", "prompt"})
"""Parameter names that say what an image reward's first (`SAMPLE_NAMES`) or second (`PROMPT_NAMES`) argument is."""


def _image_reward(name: str, fn: Callable) -> RewardFn:
    """`fn` if it can be called f(images, prompts) by position, as DDPO and Flow-GRPO call theirs; else a ValueError
    naming it and its file. One that names its first two parameters the other way round, (prompts, images), is
    refused too: it would take the prompts for the images and score them without error."""
    attribute = name.partition(":")[2]
    try:
        signature = inspect.signature(fn)
    except ValueError:  # no signature to read (some built-ins): its first call tells
        return fn
    try:
        signature.bind(None, None)
    except TypeError:
        raise ValueError(
            f"reward {name!r} must be a function of (images, prompts), not {attribute}{signature}"
        ) from None
    positional = [
        p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    first, second = (positional + ["", ""])[:2]
    if first in PROMPT_NAMES or second in SAMPLE_NAMES:
        raise ValueError(
            f"reward {name!r} ({reward_file(name)}) takes ({first}, {second}); an image reward is called f(images, "
            f"prompts), images first, as DDPO and Flow-GRPO call theirs: write def {attribute}(images, prompts)"
        )
    return fn


def custom_reward(name: str, arguments: str) -> Callable:
    """Your own reward "package.module:function" (`import_named`); the caller checks that it takes `arguments` as it
    will be called."""
    fn = import_named(name, "reward")
    if not callable(fn):
        raise ValueError(f"reward {name!r} must be a function of {arguments}, not a {type(fn).__name__}")
    return fn


def import_named(name: str, what: str) -> object:
    """What "package.module:attribute" names, its module imported: which runs the module's code, so only from a
    module DOVETAIL_REWARD_MODULES allows, where it is set (a reward's, an environment's: a config is code). `what`
    says what it is in an error's one line ("reward", "environment")."""
    module, _, attribute = name.partition(":")
    allowed = os.environ.get(ALLOWED_MODULES)
    if allowed is not None:
        prefixes = [prefix.strip() for prefix in allowed.split(",") if prefix.strip()]
        if not any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            raise ValueError(
                f"{what} {name!r}: module {module!r} is not allowed by {ALLOWED_MODULES}={allowed!r}; add it there "
                "if you trust its code"
            )
    try:
        return getattr(importlib.import_module(module), attribute)
    except Exception as error:  # importing runs the module: it may raise anything
        raise ValueError(f"{what} {name!r} cannot be imported: {process.describe(error)}") from None


def reward_file(name: str) -> str:
    """The file of the module a custom reward "package.module:function" was imported from, for its messages."""
    module = name.partition(":")[0]
    return getattr(sys.modules.get(module), "__file__", None) or module


def check_reward_names(weights: dict[str, float]) -> None:
    """Each reward exists; a model reward's and the `http` one's sections are the config's to check."""
    for name in weights:
        if name not in MODEL_REWARDS and name != SERVED_REWARD:
            reward_fn(name)


def load_rewards(weights: dict[str, float], sources: RewardSources = RewardSources()) -> None:
    """Build now what the rewards would build on first use (the judge loads its weights, a model reward its
    model onto `sources.device`), so that the first step of a run does not pay for it."""
    if "digit_match" in weights:
        digit_judge()
    for name in weights:
        if name in MODEL_REWARDS:
            sourced_reward(name, sources, MODEL_REWARDS[name].scores)


def reward_values(name: str, output, samples: int) -> np.ndarray:
    """A reward's output as float64 scores, one number per sample; anything else (None, a scalar, the wrong shape,
    strings) is a RewardError naming the reward and what it must return."""
    try:
        values = np.asarray(output)
        got = f"{type(output).__name__} of shape {values.shape} and dtype {values.dtype}"
    except Exception:  # a ragged nesting of lists, or an object numpy cannot read
        values, got = None, f"a {type(output).__name__} that is no array"
    if values is None or values.dtype.kind not in "biuf" or values.shape != (samples,):
        raise RewardError(f"reward {name!r} returned {got}; return one number per sample: shape ({samples},)")
    return values.astype(np.float64)


def score(
    images: np.ndarray,
    prompts: Sequence[str],
    weights: dict[str, float],
    timeout_s: float = REWARD_TIMEOUT_S,
    sources: RewardSources = RewardSources(),
) -> dict[str, np.ndarray]:
    """Each named reward and their weighted sum under "total": sum of weight x reward. `images` may be videos
    (B, F, H, W, 3); `sources`: what model rewards and the `http` one need."""
    scores = {}
    for name in weights:
        values = _reward_of_samples(name, reward_fn(name, sources), images, prompts, timeout_s)
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            i = int(bad[0])
            raise RewardError(f"reward {name!r} returned {values[i]} for sample {i} (prompt {prompts[i]!r})")
        scores[name] = values
    scores["total"] = sum(weights[name] * scores[name] for name in weights)
    return scores


def _reward_of_samples(name: str, fn: RewardFn, samples: np.ndarray, prompts: Sequence[str], timeout_s: float):
    """One reward's scores of images or videos: an image reward given videos scores their frames as one batch of
    images (each with its video's prompt) and averages each video's; a video reward given images scores each as a
    one-frame video."""
    video = getattr(fn, "video", False)
    if samples.ndim == 5 and not video:
        frames = samples.shape[1]
        per_frame = [prompt for prompt in prompts for _ in range(frames)]
        frames_and_prompts = (samples.reshape(-1, *samples.shape[2:]), per_frame)
        output = call_reward(name, fn, frames_and_prompts, {}, len(per_frame), timeout_s)
        return reward_values(name, output, len(per_frame)).reshape(len(prompts), frames).mean(axis=1)
    if samples.ndim != 5 and video:
        samples = samples[:, None]
    output = call_reward(name, fn, (samples, prompts), {}, len(prompts), timeout_s)
    return reward_values(name, output, len(prompts))
