"""Time-step parallel training is exact: batched (sample, timestep) chunks of any size, and any
split of the batch into fragments, give the gradient of the per-timestep loop."""

import pytest
import torch

from dovetail.algo import flow_grpo_loss, sde_step
from dovetail.models.flow_rl import SDESettings, accumulate_policy_gradient, generate, group_sample_ids
from dovetail.models.t2i import T2IConfig, TinyT2I, flow_sigmas

TINY = T2IConfig(num_layers=1, num_heads=2, head_dim=8, text_dim=16)


@pytest.fixture(scope="module")
def rollout():
    torch.manual_seed(0)
    model = TinyT2I(TINY).eval()
    sde = SDESettings(flow_sigmas(6), 0.7, "flow_grpo")
    ids = group_sample_ids(step=0, prompt_indices=[0, 1, 2], group_size=3)
    prompts = [f"digit {s.prompt + 4}" for s in ids]
    trajectories = generate(model, prompts, ids, sde, seed=0, shared_group_noise=False)
    # Pretend the rollout came from slightly different weights, so some ratios leave the clip range.
    trajectories.log_probs += 1e-3 * torch.randn_like(trajectories.log_probs)
    advantages = torch.randn(len(ids))
    return model, sde, trajectories, advantages


def gradient(model) -> torch.Tensor:
    flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return flat


def per_timestep_loop(model, sde, trajectories, advantages, timesteps, clip_range):
    """How colocated trainers (flow_grpo) train: one forward/backward per denoising step."""
    for k in timesteps:
        x = trajectories.latents[:, k]
        velocity = model(x, sde.sigmas[k].expand(len(x)), trajectories.prompt_ids)
        step = sde_step(
            velocity,
            x,
            sde.sigmas[k],
            sde.sigmas[k + 1],
            noise_level=sde.noise_level,
            kind=sde.kind,
            prev_latents=trajectories.latents[:, k + 1],
        )
        loss, _ = flow_grpo_loss(step.log_prob, trajectories.log_probs[:, k], advantages, clip_range=clip_range)
        (loss / len(timesteps)).backward()
    return gradient(model)


@pytest.mark.parametrize("chunk_size", [1, 5, 9, 16, 45])
def test_batched_chunks_match_the_per_timestep_loop(rollout, chunk_size):
    model, sde, trajectories, advantages = rollout
    timesteps = [0, 1, 2, 3, 4]
    expected = per_timestep_loop(model, sde, trajectories, advantages, timesteps, clip_range=1e-3)
    n_pairs = len(trajectories.prompts) * len(timesteps)
    accumulate_policy_gradient(
        model, trajectories, advantages, timesteps, sde, chunk_size=chunk_size, total_pairs=n_pairs, clip_range=1e-3
    )
    got = gradient(model)
    assert expected.abs().max() > 0
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-5


def test_fragments_accumulate_to_the_whole_batch_gradient(rollout):
    """GAP: groups trained as separate fragments, in any order, sum to the full-batch gradient."""
    model, sde, trajectories, advantages = rollout
    timesteps = [0, 2, 3]
    n_pairs = len(trajectories.prompts) * len(timesteps)
    expected = per_timestep_loop(model, sde, trajectories, advantages, timesteps, clip_range=1e-3)
    for rows in ([6, 7, 8], [0, 1, 2], [3, 4, 5]):
        accumulate_policy_gradient(
            model,
            trajectories.select(rows),
            advantages[rows],
            timesteps,
            sde,
            chunk_size=4,
            total_pairs=n_pairs,
            clip_range=1e-3,
        )
    got = gradient(model)
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-5
