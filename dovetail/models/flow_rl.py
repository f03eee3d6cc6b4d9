"""The pieces of a FlowGRPO / DanceGRPO step that any executor runs: generate, train, commit.

The reference loop calls them in order in one process; the Ray runtime calls the same functions
on fragments of the batch on different devices. Every random draw is keyed by the sample's
identity, so both give the same numbers.
"""

from dataclasses import dataclass

import torch

from dovetail.algo import flow_grpo_loss, sde_step
from dovetail.models.sampling import Trajectories, keyed_normal, sample_key, sample_sde


@dataclass(frozen=True)
class SDESettings:
    sigmas: torch.Tensor
    noise_level: float
    kind: str


@dataclass(frozen=True)
class SampleId:
    """A sample is the `index`-th of the group of prompt `prompt` in RL step `step`."""

    step: int
    prompt: int
    index: int


def step_prompts(seed: int, step: int, count: int) -> list[str]:
    """The B prompts of an RL step, a pure function of (seed, step): resumable and device-free."""
    generator = torch.Generator().manual_seed(sample_key(seed, "prompts", step))
    return [f"digit {d}" for d in torch.randint(0, 10, (count,), generator=generator).tolist()]


def group_sample_ids(step: int, prompt_indices: list[int], group_size: int) -> list[SampleId]:
    return [SampleId(step, p, i) for p in prompt_indices for i in range(group_size)]


def generate(
    model,
    prompts: list[str],
    ids: list[SampleId],
    sde: SDESettings,
    *,
    seed: int,
    shared_group_noise: bool,
) -> Trajectories:
    """SDE rollouts of `ids`; prompts[i] belongs to ids[i]."""
    shape = model.latent_shape
    num_steps = len(sde.sigmas) - 1
    init_keys = [
        sample_key(seed, "init", s.step, s.prompt) if shared_group_noise else sample_key(seed, "init", s.step, s.prompt, s.index)
        for s in ids
    ]
    step_keys = [sample_key(seed, "sde", s.step, s.prompt, s.index) for s in ids]
    init_noise = keyed_normal(init_keys, shape)
    step_noise = keyed_normal(step_keys, (num_steps, *shape))
    return sample_sde(
        model, prompts, sde.sigmas, init_noise=init_noise, step_noise=step_noise, noise_level=sde.noise_level, kind=sde.kind
    )


def accumulate_policy_gradient(
    model,
    trajectories: Trajectories,
    advantages: torch.Tensor,
    timesteps: list[int],
    sde: SDESettings,
    *,
    chunk_size: int,
    total_pairs: int,
    clip_range: float,
    beta: float = 0.0,
    reference_model=None,
) -> dict[str, float]:
    """Backpropagate the GRPO loss of every (sample, timestep) pair, `chunk_size` pairs at a time.

    Time-step parallel training: pairs from different timesteps share one batched forward.
    Each chunk's mean loss is weighted by its share of `total_pairs` (the whole logical batch),
    so the accumulated gradient is the same for any chunking and any split into fragments.
    Returns the pair-weighted sums of the loss statistics (divide by pair count for means).
    """
    pairs = [(i, k) for k in timesteps for i in range(len(trajectories.prompts))]
    totals: dict[str, float] = {}
    for start in range(0, len(pairs), chunk_size):
        rows, steps = map(list, zip(*pairs[start : start + chunk_size]))
        x = trajectories.latents[rows, steps]
        sigma = sde.sigmas[steps]
        sigma_next = sde.sigmas[[k + 1 for k in steps]]
        prompt_ids = trajectories.prompt_ids[rows]
        velocity = model(x, sigma, prompt_ids)
        step = sde_step(
            velocity, x, sigma, sigma_next, noise_level=sde.noise_level, kind=sde.kind,
            prev_latents=trajectories.latents[rows, [k + 1 for k in steps]],
        )
        ref_mean = None
        if beta > 0:
            with torch.no_grad():
                ref_velocity = reference_model(x, sigma, prompt_ids)
                ref_mean = sde_step(ref_velocity, x, sigma, sigma_next, noise_level=sde.noise_level, kind=sde.kind,
                                    prev_latents=step.prev_latents).mean
        loss, stats = flow_grpo_loss(
            step.log_prob, trajectories.log_probs[rows, steps], advantages[rows],
            clip_range=clip_range, ref_mean=ref_mean, mean=step.mean, std=step.std, beta=beta,
        )
        weight = len(rows) / total_pairs
        (loss * weight).backward()
        stats["loss"] = loss.item()
        for name, value in stats.items():
            if name == "ratio_min":
                totals[name] = min(totals.get(name, value), value)
            elif name == "ratio_max":
                totals[name] = max(totals.get(name, value), value)
            else:
                totals[name] = totals.get(name, 0.0) + value * len(rows)
    return totals


def commit(model, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> float:
    """One optimizer step for the whole logical batch; returns the pre-clip gradient norm."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)
