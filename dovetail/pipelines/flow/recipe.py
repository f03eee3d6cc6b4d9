"""What one RL step of a training config is, shared by the reference loop and the Ray workers:
the SDE, the trained timesteps of a step, advantages, the policy gradient, the optimizer, and the
held-out evaluation."""

import numpy as np
import torch

from dovetail.algo import forward_timesteps, group_advantages, select_train_timesteps, sliding_window
from dovetail.graph.node import SampleId, sample_key
from dovetail.models.flow_rl import SDESettings, accumulate_nft_gradient, accumulate_policy_gradient, per_row
from dovetail.models.sampling import keyed_normal, sample_ode
from dovetail.models.t2i import flow_sigmas, latents_to_images
from dovetail.pipelines.flow.config import FlowTrainConfig, flow_rules
from dovetail.prompts import eval_prompts
from dovetail.rewards import score


def sde_settings(config: FlowTrainConfig, device: torch.device | str = "cpu") -> SDESettings:
    sampling, rules = config.sampling, flow_rules(config)
    sigmas = flow_sigmas(sampling.num_steps, sampling.shift, sampling.schedule).to(device)
    return SDESettings(sigmas, rules.noise_level, rules.sde_kind, sampling.cps_log_prob)


def step_timesteps(config: FlowTrainConfig, step: int) -> list[int]:
    """The trained steps of RL step `step`'s samples (0 the run's first): one draw for all of them keyed by
    (seed, step), or algo.sde_window's window at that step (MixGRPO)."""
    window = config.algo.sde_window
    if window is not None:
        window_range = config.algo.window_range or (0, config.sampling.num_steps - 1)
        return sliding_window(
            config.sampling.num_steps,
            window.size,
            window.shift_every,
            step,
            stride=window.stride,
            low=window_range[0],
            high=window_range[1],
        )
    return _select_timesteps(config, sample_key(config.seed, "timesteps", step))


def sample_timesteps(config: FlowTrainConfig, sample: SampleId) -> list[int]:
    """The steps trained on `sample`: its RL step's (`step_timesteps`), or with algo.per_sample_timesteps its own
    (DanceGRPO), keyed by its identity so that every device and the reference loop draw the same. DiffusionNFT's
    are always its own, of all K steps of the schedule (`algo.forward_timesteps`)."""
    key = sample_key(config.seed, "timesteps", sample.step, sample.prompt, sample.member)
    if config.algorithm == "diffusion_nft":
        count = flow_rules(config).trained_timesteps
        return forward_timesteps(config.sampling.num_steps, count, torch.Generator().manual_seed(key))
    if not config.algo.per_sample_timesteps:
        return step_timesteps(config, sample.step)
    return _select_timesteps(config, key)


def sde_steps(config: FlowTrainConfig, samples: list[SampleId]) -> list[list[int]] | None:
    """Each sample's stochastic steps where only its SDE window is (algo.timesteps=window, as Flow-GRPO-Fast
    samples: the other steps are deterministic), none at all for DiffusionNFT (the ODE, as upstream samples with
    `deterministic=True`: it needs no likelihood); None where every step is."""
    if config.algorithm == "diffusion_nft":
        return [[] for _ in samples]
    if flow_rules(config).timestep_mode != "window":
        return None
    return [sample_timesteps(config, s) for s in samples]


def _select_timesteps(config: FlowTrainConfig, key: int) -> list[int]:
    algo = config.algo
    return select_train_timesteps(
        config.sampling.num_steps,
        fraction=algo.timestep_fraction,
        mode=flow_rules(config).timestep_mode,
        window=algo.window_size,
        window_range=None if algo.window_range is None else (algo.window_range[0], algo.window_range[1]),
        rounding=algo.timestep_rounding,
        pool=algo.timestep_pool,
        generator=torch.Generator().manual_seed(key),
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
    scores = score(images, prompts, config.reward, config.reward_timeout_s, config.reward_sources(str(model.device)))
    return {name: float(values.mean()) for name, values in scores.items()}, images, prompts


def advantages_of(
    config: FlowTrainConfig, rewards: np.ndarray, prompts: list[int], texts: list[str] | None = None
) -> torch.Tensor:
    """Group-relative advantages; `prompts[i]` is sample i's prompt index (its group), `texts[i]` its prompt's text:
    with algo.adv_group=prompt_text the samples of equal texts form one group (Flow-GRPO's per-prompt statistics)."""
    algo = config.algo
    if algo.adv_group == "prompt_text":
        if texts is None:
            raise ValueError("algo.adv_group=prompt_text groups the samples by their prompts' texts: pass `texts`")
        prompts = [texts.index(text) for text in texts]
    return group_advantages(
        torch.as_tensor(rewards),
        torch.tensor(prompts),
        std_scope=algo.std_scope,
        baseline=algo.adv_baseline,
        eps=algo.adv_eps,
        unbiased=algo.adv_unbiased,
        clip=algo.adv_clip,
    )


def policy_gradient(
    model,
    trajectories,
    advantages,
    timesteps: list[int] | list[list[int]],
    sde: SDESettings,
    config: FlowTrainConfig,
    *,
    total_pairs: int,
    reference_model=None,
    stale: bool = False,
    samples: list[SampleId] | None = None,
    old_model=None,
) -> dict[str, float]:
    """`accumulate_policy_gradient` with the config's knobs; `stale` (TCSS) turns on the decoupled correction.
    DiffusionNFT's (`accumulate_nft_gradient`) needs the trajectories' `samples` (its noise is keyed by them) and
    `old_model`, its old policy: the weights that sampled them."""
    algo = config.algo
    if config.algorithm == "diffusion_nft":
        if samples is None or old_model is None:
            raise ValueError("algorithm diffusion_nft trains with the samples' identities and the old policy")
        return accumulate_nft_gradient(
            model,
            old_model,
            trajectories,
            samples,
            advantages.to(trajectories.latents.device),
            per_row(timesteps, len(samples)),
            seed=config.seed,
            chunk_size=config.train.chunk_size,
            total_pairs=total_pairs,
            beta=algo.nft.beta,
            adv_clip=algo.adv_clip,
            kl_beta=algo.beta,
            reference_model=reference_model,
        )
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
        kl_std=algo.kl_std,
        reference_model=reference_model,
        stale_max_weight=algo.stale_max_weight if stale else None,
        ratio_normalization=algo.ratio_normalization,
    )
