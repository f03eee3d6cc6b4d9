"""A text-to-image flow model in miniature: diffusers' MMDiT (SD3) on 8x8 digit images.

Prompts such as ``"digit 7"`` are read by a small learned token embedding instead of CLIP/T5, so
nothing is downloaded. The image is its own latent (one channel, no VAE).
"""

import json
from pathlib import Path

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from pydantic import BaseModel, ConfigDict
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dovetail.files import one_line

VOCAB = ("<pad>", "digit", *[str(d) for d in range(10)])
CHECKPOINT_DIR = Path(__file__).resolve().parent.parent / "assets"


class T2IConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    image_size: int = 8
    patch_size: int = 2
    num_layers: int = 3
    num_heads: int = 4
    head_dim: int = 32
    text_dim: int = 64
    max_prompt_tokens: int = 4


def tokenize(prompt: str, max_tokens: int) -> list[int]:
    words = prompt.lower().split()
    unknown = [w for w in words if w not in VOCAB]
    if unknown:
        raise ValueError(f"prompt {prompt!r} has words outside the vocabulary {VOCAB}: {unknown}")
    ids = [VOCAB.index(w) for w in words][:max_tokens]
    return ids + [0] * (max_tokens - len(ids))


class TinyT2I(torch.nn.Module):
    """Velocity model v(x_sigma, sigma, prompt) of a rectified flow x_sigma = (1-sigma) x0 + sigma noise."""

    def __init__(self, config: T2IConfig):
        super().__init__()
        self.config = config
        self.token_embedding = torch.nn.Embedding(len(VOCAB), config.text_dim, padding_idx=0)
        self.transformer = SD3Transformer2DModel(
            sample_size=config.image_size,
            patch_size=config.patch_size,
            in_channels=1,
            out_channels=1,
            num_layers=config.num_layers,
            attention_head_dim=config.head_dim,
            num_attention_heads=config.num_heads,
            joint_attention_dim=config.text_dim,
            caption_projection_dim=config.num_heads * config.head_dim,
            pooled_projection_dim=config.text_dim,
            pos_embed_max_size=config.image_size // config.patch_size,
        )

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return (1, self.config.image_size, self.config.image_size)

    @property
    def device(self) -> torch.device:
        return self.token_embedding.weight.device

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        ids = [tokenize(p, self.config.max_prompt_tokens) for p in prompts]
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def forward(self, latents: torch.Tensor, sigma: torch.Tensor, prompt_ids: torch.Tensor) -> torch.Tensor:
        tokens = self.token_embedding(prompt_ids)
        mask = (prompt_ids > 0).unsqueeze(-1).float()
        pooled = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1)
        timestep = sigma.expand(latents.shape[0]) * 1000.0
        return self.transformer(
            hidden_states=latents, encoder_hidden_states=tokens, pooled_projections=pooled, timestep=timestep
        ).sample

    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """What weight publication, trainer hand-over and checkpoints carry: the whole model."""
        return self.state_dict()

    def load_trained_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(state)


SIGMA_SCHEDULES = ("diffusers", "dance_grpo")


def latents_to_images(latents: torch.Tensor) -> np.ndarray:
    """Model space [-1, 1] (B, 1, H, W) to reward space [0, 1] (B, H, W)."""
    return ((latents[:, 0].detach().float().clamp(-1, 1) + 1) / 2).cpu().numpy()


def flow_sigmas(num_steps: int, shift: float = 1.0, schedule: str = "diffusers") -> torch.Tensor:
    """num_steps + 1 sigmas from 1 down to 0.

    ``diffusers``: as diffusers' flow-matching Euler scheduler lays them (Flow-GRPO, verl-omni), which
    spaces the steps down to its shifted sigma_min and shifts again: the last non-zero sigma is small
    (0.0089 at 16 steps, shift 3). ``dance_grpo``: DanceGRPO's own, linspace(1, 0) shifted once by
    shift * t / (1 + (shift - 1) * t): its last non-zero sigma is 0.167 there.
    """
    if schedule == "dance_grpo":
        t = torch.linspace(1, 0, num_steps + 1)
        return (shift * t) / (1 + (shift - 1) * t)
    if schedule != "diffusers":
        raise ValueError(f"schedule={schedule!r} is not one of {SIGMA_SCHEDULES}")
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.float()


def save_model(model: TinyT2I, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "model.safetensors")
    (directory / "config.json").write_text(model.config.model_dump_json(indent=2))


def checkpoint_weights(directory: Path | str) -> Path:
    """The weights file of a model checkpoint directory; a missing one is an error that says how to make it."""
    weights = Path(directory) / "model.safetensors"
    if not weights.exists():
        raise FileNotFoundError(
            f"no checkpoint at {weights}; run `dovetail pretrain digits --out {directory}` to make one"
        )
    return weights


def load_model(directory: Path | str) -> TinyT2I:
    """The model of a checkpoint directory, in eval mode; a config or weights that do not load (a damaged file,
    another model's) are one line naming the file."""
    directory = Path(directory)
    weights = checkpoint_weights(directory)
    config_path = directory / "config.json"
    try:
        config = T2IConfig(**json.loads(config_path.read_text()))
    except (OSError, ValueError, TypeError) as error:  # pydantic's ValidationError is a ValueError
        raise ValueError(f"unreadable {config_path}: {one_line(error)}") from None
    model = TinyT2I(config)
    try:
        model.load_state_dict(load_file(weights))
    except (SafetensorError, RuntimeError, OSError) as error:  # a damaged header; a tensor missing or misshapen
        raise ValueError(f"cannot load {weights} into the model {config_path} describes: {one_line(error)}") from None
    return model.eval()
