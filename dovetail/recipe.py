"""What one RL step of a training config is, shared by the reference loop and the Ray workers:
the SDE, the trained timesteps of a step, advantages, the policy gradient, the optimizer, and the
held-out evaluation."""

import numpy as np
import torch

from dovetail.algo import group_advantages, select_train_timesteps
from dovetail.config.train import FlowTrainConfig
from dovetail.exec.pipeline import trainable_parameters
from dovetail.models.flow_rl import SDESettings, accumulate_policy_gradient
from dovetail.models.pretrain import latents_to_images
from dovetail.models.sampling import keyed_normal, sample_key, sample_ode
from dovetail.models.t2i import flow_sigmas
from dovetail.prompts import eval_prompts
from dovetail.rewards import score


def sde_settings(config: FlowTrainConfig, device: torch.device | str = "cpu") -> SDESettings:
    return SDESettings(
        flow_sigmas(config.sampling.num_steps, config.sampling.shift).to(device), config.noise_level, config.sde_kind
    )


def step_timesteps(config: FlowTrainConfig, step: int) -> list[int]:
    generator = torch.Generator().manual_seed(sample_key(config.seed, "timesteps", step))
    return select_train_timesteps(
        config.sampling.num_steps,
        fraction=config.algo.timestep_fraction,
        mode=config.timestep_mode,
        generator=generator,
    )


def evaluate(
    model, config: FlowTrainConfig, decode=latents_to_images
) -> tuple[dict[str, float], np.ndarray, list[str]]:
    """ODE samples of the eval prompts on fixed held-out seeds, the same at every evaluation; `decode` turns latents
    into the images the rewards score."""
    prompts = eval_prompts(config)
    noise = keyed_normal([sample_key(config.eval.seed, i) for i in range(len(prompts))], model.latent_shape).to(
        model.device
    )
    images = decode(sample_ode(model, prompts, sde_settings(config, model.device).sigmas, noise))
    scores = score(images, prompts, config.reward, config.reward_timeout_s)
    return {name: float(values.mean()) for name, values in scores.items()}, images, prompts


def make_optimizer(model, config: FlowTrainConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (a LoRA run's adapter alone)."""
    return torch.optim.AdamW(trainable_parameters(model), lr=config.train.lr, weight_decay=config.train.weight_decay)


def advantages_of(config: FlowTrainConfig, rewards: np.ndarray, prompts: list[int]) -> torch.Tensor:
    """Group-relative advantages; `prompts[i]` is sample i's prompt index (its group)."""
    return group_advantages(
        torch.as_tensor(rewards), torch.tensor(prompts), std_scope=config.algo.std_scope, clip=config.algo.adv_clip
    )


def policy_gradient(
    model,
    trajectories,
    advantages,
    timesteps: list[int],
    sde: SDESettings,
    config: FlowTrainConfig,
    *,
    total_pairs: int,
    reference_model=None,
    stale: bool = False,
) -> dict[str, float]:
    """`accumulate_policy_gradient` with the config's knobs; `stale` (TCSS) turns on the decoupled correction."""
    algo = config.algo
    return accumulate_policy_gradient(
        model,
        trajectories,
        advantages.to(trajectories.latents.device),
        timesteps,
        sde,
        chunk_size=config.train.chunk_size,
        total_pairs=total_pairs,
        clip_range=algo.clip_range,
        beta=algo.beta,
        reference_model=reference_model,
        stale_max_weight=algo.stale_max_weight if stale else None,
    )
