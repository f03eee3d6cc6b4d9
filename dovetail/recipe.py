"""What one RL step of a training config is, shared by the reference loop and the Ray workers:
the SDE, the trained timesteps of a step, the optimizer, and the held-out evaluation."""

import numpy as np
import torch

from dovetail.algo import select_train_timesteps
from dovetail.config.train import TrainConfig
from dovetail.models.flow_rl import SDESettings
from dovetail.models.pretrain import latents_to_images
from dovetail.models.sampling import keyed_normal, sample_key, sample_ode
from dovetail.models.t2i import flow_sigmas
from dovetail.rewards import score


def sde_settings(config: TrainConfig) -> SDESettings:
    return SDESettings(
        flow_sigmas(config.sampling.num_steps, config.sampling.shift), config.noise_level, config.sde_kind
    )


def step_timesteps(config: TrainConfig, step: int) -> list[int]:
    generator = torch.Generator().manual_seed(sample_key(config.seed, "timesteps", step))
    return select_train_timesteps(
        config.sampling.num_steps, fraction=config.algo.timestep_fraction, mode=config.timestep_mode, generator=generator
    )


def evaluate(model, config: TrainConfig) -> tuple[dict[str, float], np.ndarray, list[str]]:
    """ODE samples on fixed held-out seeds, the same at every evaluation."""
    prompts = [f"digit {d}" for d in range(10) for _ in range(config.eval.per_digit)]
    noise = keyed_normal([sample_key(config.eval.seed, i) for i in range(len(prompts))], model.latent_shape)
    images = latents_to_images(sample_ode(model, prompts, sde_settings(config).sigmas, noise))
    scores = score(images, prompts, config.reward)
    return {name: float(values.mean()) for name, values in scores.items()}, images, prompts


def make_optimizer(model, config: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=config.train.lr, weight_decay=config.train.weight_decay)
