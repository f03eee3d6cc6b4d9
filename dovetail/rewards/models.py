"""Model rewards: a model the user saved with `save_pretrained`, loaded from its directory onto the scoring
engine's device, scoring batches under torch.no_grad. Each loader (`MODEL_REWARDS`' `loader`) takes the reward's
`RewardModel` and the device and returns the reward function; a model is loaded once per (directory, device).

The formulas are upstream's (docs/rewards.md names each source):

* `clip_score`: torchmetrics' CLIPScore, 100 x cos(image embedding, text embedding), clamped at 0.
* `pickscore`: PickScore's, CLIP's logit scale exp(logit_scale) x cos(image embedding, text embedding): the
  logit its softmax over a prompt's images would take.
* `hps_v2`: HPS v2's (its score.py), the diagonal of image_features @ text_features.T, both normalised: cos,
  unscaled, on a CLIP with HPS v2's weights (`models.open_clip` converts its open_clip checkpoint).
* `image_reward`: ImageReward's (ImageReward/ImageReward.py, `score` / `inference_rank`): BLIP's ViT embeds the
  image, its BERT reads the prompt with cross-attention to the image's tokens, and an MLP of the [CLS] token's
  state, standardised by ImageReward's mean and std, is the score (`models.image_reward` converts its checkpoint).
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
from safetensors.torch import load_file
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BlipForImageTextRetrieval,
    CLIPModel,
    CLIPProcessor,
)

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


IMAGE_REWARD_HEAD = "image_reward_head.safetensors"
"""ImageReward's MLP (`mlp.layers.N` of its checkpoint, as `layers.N`), beside the BLIP model in its directory."""

IMAGE_REWARD_MEAN, IMAGE_REWARD_STD = 0.16717362830052426, 1.0333394966054072
"""ImageReward's standardisation of its MLP's output (`ImageReward.mean`, `.std`)."""

IMAGE_REWARD_TOKENS = 35
"""ImageReward's prompt length: BERT's tokens, cut and padded to 35 (`max_length=35`, `padding='max_length'`)."""

CLIP_PIXEL_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_PIXEL_STD = (0.26862954, 0.26130258, 0.27577711)
"""The image normalisation ImageReward's transform takes from CLIP."""


def image_reward_pixels(pictures: Sequence[Image.Image], size: int) -> torch.Tensor:
    """ImageReward's transform of RGB pictures, torchvision's steps done with PIL and torch as torchvision does them:
    Resize(size, bicubic) (the shorter side to `size`, the longer to int(size x long / short), a picture already
    that size untouched), CenterCrop(size) (offsets rounded), ToTensor (/ 255), Normalize(CLIP's mean and std)."""
    crops = []
    for picture in pictures:
        width, height = picture.size
        longer = int(size * max(width, height) / min(width, height))
        resized = (size, longer) if width <= height else (longer, size)
        if resized != picture.size:
            picture = picture.resize(resized, Image.Resampling.BICUBIC)
        top, left = int(round((resized[1] - size) / 2.0)), int(round((resized[0] - size) / 2.0))
        crops.append(np.asarray(picture.crop((left, top, left + size, top + size))))
    pixels = torch.from_numpy(np.stack(crops)).permute(0, 3, 1, 2).float().div(255)
    mean, std = torch.tensor(CLIP_PIXEL_MEAN)[:, None, None], torch.tensor(CLIP_PIXEL_STD)[:, None, None]
    return pixels.sub(mean).div(std)


def image_reward_head(path: str) -> torch.nn.Sequential:
    """ImageReward's MLP from `IMAGE_REWARD_HEAD`: its Linear layers in order (its Dropouts are the identity in
    eval, and it has no activations)."""
    state = load_file(str(Path(path) / IMAGE_REWARD_HEAD))
    indices = sorted({int(key.split(".")[1]) for key in state})
    layers = []
    for index in indices:
        weight, bias = state[f"layers.{index}.weight"], state[f"layers.{index}.bias"]
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0])
        layer.load_state_dict({"weight": weight, "bias": bias})
        layers.append(layer)
    return torch.nn.Sequential(*layers).eval().requires_grad_(False)


@lru_cache(maxsize=8)
def _image_reward(path: str, device: str):
    where = torch.device(device)
    model = BlipForImageTextRetrieval.from_pretrained(path, dtype=run_dtype(path, where))
    model = model.to(where).eval().requires_grad_(False)
    return model, image_reward_head(path).to(where), AutoTokenizer.from_pretrained(path)


def image_reward(settings: RewardModel, device: str):
    _image_reward(settings.path, device)

    def reward(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        """ImageReward of each image and its prompt: (mlp(text_encoder(prompt, image)[:, 0]) - mean) / std."""
        model, head, tokenizer = _image_reward(settings.path, device)
        size = model.config.vision_config.image_size
        scores = []
        for start in range(0, len(images), settings.batch_size):
            batch = slice(start, start + settings.batch_size)
            text = tokenizer(
                list(prompts[batch]),
                padding="max_length",
                truncation=True,
                max_length=IMAGE_REWARD_TOKENS,
                return_tensors="pt",
            ).to(model.device)
            pixels = image_reward_pixels(rgb_images(images[batch]), size).to(model.device, model.dtype)
            with torch.no_grad():
                image_tokens = model.vision_model(pixel_values=pixels).last_hidden_state
                states = model.text_encoder(
                    input_ids=text.input_ids,
                    attention_mask=text.attention_mask,
                    encoder_hidden_states=image_tokens,
                    encoder_attention_mask=torch.ones(image_tokens.shape[:-1], dtype=torch.long, device=model.device),
                ).last_hidden_state
                raw = head(states[:, 0, :].float())[:, 0]
            scores.append(((raw - IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD).cpu().numpy())
        return np.concatenate(scores).astype(np.float64) if scores else np.zeros(0)

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
