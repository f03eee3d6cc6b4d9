"""Model rewards: a model the user saved with `save_pretrained`, loaded from its directory onto the scoring
engine's device, scoring batches under torch.no_grad. Each loader (`MODEL_REWARDS`' `loader`) takes the reward's
`RewardModel` and the device and returns the reward function; a model is loaded once per (directory, device).

The formulas are upstream's (docs/rewards.md names each source):

* `clip_score`: torchmetrics' CLIPScore, 100 x cos(image embedding, text embedding), clamped at 0.
* `pickscore`: PickScore's, CLIP's logit scale exp(logit_scale) x cos(image embedding, text embedding): the
  logit its softmax over a prompt's images would take.
* `hps_v2`: HPS v2's (its score.py), the diagonal of image_features @ text_features.T, both normalised: cos,
  unscaled, on a CLIP with HPS v2's weights (`models.open_clip` converts its open_clip checkpoint).
* `lm_reward_model`: TRL's and OpenRLHF's, logits[:, 0] of an AutoModelForSequenceClassification at the last
  token that is not padding, of the prompt and completion as one text (a chat's messages through the chat
  template, the completion the assistant's turn), tokenized without added special tokens, padded on the right.

A model saved in bfloat16 runs in bfloat16 on a GPU; anything else, and every model on a CPU, in float32."""

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoModelForSequenceClassification, AutoTokenizer, CLIPModel, CLIPProcessor

from dovetail.rewards import RewardModel


def run_dtype(path: str, device: torch.device) -> torch.dtype:
    """bfloat16 where the model was saved so (config.json's dtype) and runs on a GPU; float32 otherwise."""
    saved = json.loads((Path(path) / "config.json").read_text())
    dtype = saved.get("dtype") or saved.get("torch_dtype")
    return torch.bfloat16 if dtype == "bfloat16" and device.type == "cuda" else torch.float32


@lru_cache(maxsize=8)
def _clip(path: str, device: str) -> tuple[CLIPModel, CLIPProcessor]:
    where = torch.device(device)
    model = CLIPModel.from_pretrained(path, dtype=run_dtype(path, where)).to(where).eval().requires_grad_(False)
    return model, CLIPProcessor.from_pretrained(path)


def rgb_images(images: np.ndarray) -> list[Image.Image]:
    """Images in [0, 1], grey (B, H, W) or RGB (B, H, W, 3), as the 8-bit RGB pictures a CLIP processor takes."""
    pixels = (np.clip(images, 0, 1) * 255).round().astype(np.uint8)
    return [Image.fromarray(image).convert("RGB") for image in pixels]


def clip_cosines(settings: RewardModel, device: str, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """cos(image embedding, text embedding) of each image and its prompt (CLIPModel's normalised projections),
    `settings.batch_size` at a time."""
    model, processor = _clip(settings.path, device)
    positions = model.config.text_config.max_position_embeddings
    cosines = []
    for start in range(0, len(images), settings.batch_size):
        batch = slice(start, start + settings.batch_size)
        inputs = processor(
            text=list(prompts[batch]),
            images=rgb_images(images[batch]),
            padding=True,
            truncation=True,
            max_length=positions,
            return_tensors="pt",
        ).to(model.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        with torch.no_grad():
            out = model(**inputs)
        cosines.append((out.image_embeds.float() * out.text_embeds.float()).sum(dim=-1).cpu().numpy())
    return np.concatenate(cosines).astype(np.float64) if cosines else np.zeros(0)


def clip_score(settings: RewardModel, device: str):
    _clip(settings.path, device)

    def reward(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        """torchmetrics' CLIPScore of each image and its prompt: max(100 cos, 0)."""
        return np.maximum(100.0 * clip_cosines(settings, device, images, prompts), 0.0)

    return reward


def pickscore(settings: RewardModel, device: str):
    model, _ = _clip(settings.path, device)
    scale = float(model.logit_scale.float().exp())

    def reward(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        """PickScore of each image and its prompt: exp(logit_scale) cos."""
        return scale * clip_cosines(settings, device, images, prompts)

    return reward


def hps_v2(settings: RewardModel, device: str):
    _clip(settings.path, device)

    def reward(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        """HPS v2 of each image and its prompt: cos, the diagonal of its normalised features' product."""
        return clip_cosines(settings, device, images, prompts)

    return reward


@lru_cache(maxsize=8)
def _sequence_classifier(path: str, device: str):
    where = torch.device(device)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=run_dtype(path, where))
    model = model.to(where).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:  # TRL's choice: pad with the end of sequence, which the model then reads past
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def conversation_text(tokenizer, prompt, completion: str) -> str:
    """The text a reward model reads: a plain prompt followed by the completion, or a chat's messages with the
    completion as the assistant's turn, through the tokenizer's chat template (as TRL builds it)."""
    if isinstance(prompt, str):
        return prompt + completion
    messages = [*prompt, {"role": "assistant", "content": completion}]
    return tokenizer.apply_chat_template(messages, tokenize=False)


def lm_reward_model(settings: RewardModel, device: str):
    _sequence_classifier(settings.path, device)

    def reward(completions: Sequence[str], prompts: Sequence) -> np.ndarray:
        """logits[:, 0] at the last token that is not padding, of each prompt and completion."""
        model, tokenizer = _sequence_classifier(settings.path, device)
        texts = [conversation_text(tokenizer, p, c) for p, c in zip(prompts, completions, strict=True)]
        scores = []
        for start in range(0, len(texts), settings.batch_size):
            inputs = tokenizer(
                texts[start : start + settings.batch_size],
                padding=True,
                padding_side="right",
                add_special_tokens=False,
                return_tensors="pt",
            ).to(model.device)
            with torch.no_grad():
                scores.append(model(**inputs).logits[:, 0].float().cpu().numpy())
        return np.concatenate(scores).astype(np.float64) if scores else np.zeros(0)

    return reward
