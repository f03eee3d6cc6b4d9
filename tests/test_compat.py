"""Each `algo.compat` preset reproduces its upstream's numbers on the same tensors (<= 1e-6).

Every upstream formula is transcribed here independently of dovetail's code, from the file and lines its
docstring names (commits: yifan123/flow_grpo ac4c86e, IamCreateAI/FlowCPS b402c7a -- a Sep 2025 fork of
flow_grpo carrying Flow-GRPO-Fast's window defaults and the CPS step --, XueZeyue/DanceGRPO 15cc71d,
verl-project/verl-omni a1139baf). dovetail's side goes through the config (`load_config`) and the functions
the training loops call (`recipe`, `models.flow_rl`), so a preset that wires a knob wrongly fails here.
"""

import json
import math

import numpy as np
import pytest
import torch
import yaml
from running import train
from safetensors.torch import load_file

from dovetail.algo import sde_step
from dovetail.config.common import DEFAULT_CHECKPOINT, ConfigError
from dovetail.config.load import dump_config, load_config, parse_config
from dovetail.graph.node import SampleId, sample_key
from dovetail.models.flow_rl import SDESettings, generate, recompute_log_probs
from dovetail.models.sampling import Trajectories, keyed_normal
from dovetail.pipelines.flow.config import flow_rules
from dovetail.pipelines.flow.recipe import advantages_of, policy_gradient, sample_timesteps, sde_settings, sde_steps

DTYPE = torch.float64
"""Both sides compute in float64 here (dovetail's step keeps fp64 inputs fp64): upstream and dovetail write the same
formulas in different orders, and fp32 rounding, which 1/std^2 amplifies on the late steps, tells two orderings apart
by ~1e-5 there; in float64 what is compared is the formula."""

# ------------------------------------------------------------------ upstream, transcribed


def flow_grpo_sde_step(sigmas, k, sample, model_output, noise_level, prev_sample):
    """Flow-GRPO's SDE step: flow_grpo/diffusers_patch/sd3_sde_with_logprob.py L40-L70 (flow_grpo ac4c86e);
    verl-omni's `sde` branch is the same (verl_omni/pipelines/schedulers/flow_match_sde.py L204-L240)."""
    sigma = sigmas[k].view(-1, 1, 1, 1)
    sigma_prev = sigmas[k + 1].view(-1, 1, 1, 1)
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = (
        sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim))), prev_sample_mean, std_dev_t


def cps_step(sigmas, k, sample, model_output, noise_level, prev_sample):
    """The CPS step with its constant-free log-prob: verl_omni/pipelines/schedulers/flow_match_sde.py L244-L269
    (verl-omni a1139baf); FlowCPS flow_grpo/diffusers_patch/sd3_sde_with_logprob.py L51-L70 is the same."""
    sigma = sigmas[k].view(-1, 1, 1, 1)
    sigma_prev = sigmas[k + 1].view(-1, 1, 1, 1)
    std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
    pred_original_sample = sample - sigma * model_output
    noise_estimate = sample + model_output * (1 - sigma)
    prev_sample_mean = pred_original_sample * (1 - sigma_prev) + noise_estimate * torch.sqrt(
        sigma_prev**2 - std_dev_t**2
    )
    log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2)
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim))), prev_sample_mean, std_dev_t


def dance_grpo_step(sigmas, k, latents, model_output, eta, prev_sample):
    """DanceGRPO's `flux_step` (grpo=True, sde_solver=True): fastvideo/train_grpo_flux.py L131-L165 (15cc71d);
    one index for the whole batch, as DanceGRPO steps."""
    sigma = sigmas[k]
    dsigma = sigmas[k + 1] - sigma
    prev_sample_mean = latents + dsigma * model_output
    pred_original_sample = latents - sigma * model_output
    delta_t = sigma - sigmas[k + 1]
    std_dev_t = eta * math.sqrt(delta_t)
    score_estimate = -(latents - pred_original_sample * (1 - sigma)) / sigma**2
    log_term = -0.5 * eta**2 * score_estimate
    prev_sample_mean = prev_sample_mean + log_term * dsigma
    log_prob = (
        (  # DanceGRPO casts both to float32 here; see DTYPE
            -((prev_sample.detach().to(DTYPE) - prev_sample_mean.to(DTYPE)) ** 2) / (2 * (std_dev_t**2))
        )
        - math.log(std_dev_t)
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    return (
        log_prob.mean(dim=tuple(range(1, log_prob.ndim))),
        prev_sample_mean,
        torch.full((len(latents),), std_dev_t, dtype=DTYPE),
    )


def dance_grpo_sigmas(sampling_steps, shift):
    """fastvideo/train_grpo_flux.py L127-L128 (`sd3_time_shift`) and L311-L313."""
    t = torch.linspace(1, 0, sampling_steps + 1)
    return (shift * t) / (1 + (shift - 1) * t)


def diffusers_sigmas(num_steps, shift, num_train_timesteps=1000):
    """What Flow-GRPO's and verl-omni's pipelines step through: diffusers' FlowMatchEulerDiscreteScheduler
    (diffusers 0.42 scheduling_flow_match_euler_discrete.py L127-L144 __init__, L342-L386 set_timesteps), redone in
    numpy: shift the training sigmas, space the steps from sigma_max to sigma_min, shift again, append 0."""
    train_sigmas = (
        np.linspace(1, num_train_timesteps, num_train_timesteps, dtype=np.float32)[::-1] / num_train_timesteps
    )
    train_sigmas = shift * train_sigmas / (1 + (shift - 1) * train_sigmas)
    sigma_max, sigma_min = float(train_sigmas[0]), float(train_sigmas[-1])
    timesteps = np.linspace(sigma_max * num_train_timesteps, sigma_min * num_train_timesteps, num_steps)
    sigmas = timesteps / num_train_timesteps
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return torch.cat([torch.from_numpy(sigmas).float(), torch.zeros(1)])


def flow_grpo_advantages(prompts, rewards, global_std):
    """PerPromptStatTracker.update(type='grpo'): flow_grpo/stat_tracking.py L11-L31 (numpy: population std)."""
    prompts = np.array(prompts)
    rewards = np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        prompt_rewards = rewards[prompts == prompt]
        mean = np.mean(prompt_rewards, axis=0, keepdims=True)
        std = (
            np.std(rewards, axis=0, keepdims=True) if global_std else np.std(prompt_rewards, axis=0, keepdims=True)
        ) + 1e-4
        advantages[prompts == prompt] = (prompt_rewards - mean) / std
    return advantages


def flow_grpo_batch_advantages(rewards):
    """Without per-prompt statistics: scripts/train_sd3.py L782 (numpy)."""
    rewards = np.array(rewards, dtype=np.float64)
    return (rewards - rewards.mean()) / (rewards.std() + 1e-4)


def dance_grpo_advantages(rewards, num_generations, use_group=True):
    """fastvideo/train_grpo_flux.py L533-L548: consecutive groups of num_generations, torch's (sample) std + 1e-8."""
    rewards = torch.as_tensor(rewards, dtype=DTYPE)  # DanceGRPO's rewards are float32 (L523); see DTYPE
    if not use_group:
        return (rewards - rewards.mean()) / (rewards.std() + 1e-8)
    advantages = torch.zeros_like(rewards)
    for i in range(len(rewards) // num_generations):
        group_rewards = rewards[i * num_generations : (i + 1) * num_generations]
        advantages[i * num_generations : (i + 1) * num_generations] = (group_rewards - group_rewards.mean()) / (
            group_rewards.std() + 1e-8
        )
    return advantages


def verl_omni_advantages(scores, index, global_std=True, epsilon=1e-4):
    """compute_flow_grpo_outcome_advantage: verl_omni/trainer/diffusion/diffusion_algos.py L192-L263."""
    scores = torch.as_tensor(scores, dtype=DTYPE).clone()  # float32 rewards in verl-omni; see DTYPE
    id2score, id2mean, id2std = {}, {}, {}
    batch_std = torch.std(scores) if global_std else None
    for i in range(len(scores)):
        id2score.setdefault(index[i], []).append(scores[i])
    for idx, members in id2score.items():
        if len(members) == 1:
            id2mean[idx] = members[0]
            id2std[idx] = batch_std if global_std else torch.tensor(1.0)
        else:
            stacked = torch.stack(members)
            id2mean[idx] = torch.mean(stacked)
            id2std[idx] = batch_std if global_std else torch.std(stacked)
    for i in range(len(scores)):
        scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
    return scores


def grpo_loss(log_prob, old_log_prob, advantages, clip_range, adv_clip_max=5.0):
    """The clipped surrogate of one timestep: flow_grpo scripts/train_sd3.py L881-L893, DanceGRPO
    fastvideo/train_grpo_flux.py L589-L603, verl-omni diffusion_algos.py FlowGRPOLoss (L277-L330): the same."""
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss))


def upstream_kl(prev_sample_mean, prev_sample_mean_ref, std_dev_t):
    """flow_grpo scripts/train_sd3.py L895-L896; verl-omni diffusion_algos.py L1035 (KLLoss): divided by std_dev_t^2."""
    kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (
        2 * std_dev_t.view(-1, 1, 1, 1) ** 2
    )
    return torch.mean(kl_loss)


UPSTREAM_NOISE = {
    "flow_grpo": 0.7,  # flow_grpo config/base.py L54: sample.noise_level = 0.7
    "flow_grpo_fast": 0.7,  # FlowCPS config/base.py L56 (the same base as Flow-GRPO-Fast's window, L60-L62)
    "dance_grpo": 0.3,  # DanceGRPO scripts/finetune/finetune_flux_grpo_8gpus.sh L43: --eta 0.3
    "verl_omni": 1.0,  # verl_omni/trainer/config/_generated_diffusion_trainer.yaml L238: algo.noise_level: 1.0
}

# ------------------------------------------------------------------ dovetail's side


PRESETS = {
    # name: (overrides, upstream's step function)
    "flow_grpo": (["algo.compat=flow_grpo", "algo.timestep_fraction=0.99"], flow_grpo_sde_step),
    "flow_grpo cps": (["algo.compat=flow_grpo", "algo.timestep_fraction=0.99", "sampling.sde_kind=cps"], cps_step),
    "flow_grpo_fast cps": (["algo.compat=flow_grpo_fast", "sampling.sde_kind=cps"], cps_step),
    "dance_grpo": (["algo.compat=dance_grpo", "sampling.num_steps=16", "sampling.shift=3"], dance_grpo_step),
    "verl_omni": (["algo.compat=verl_omni"], flow_grpo_sde_step),
    "verl_omni cps": (["algo.compat=verl_omni", "sampling.sde_kind=cps"], cps_step),
}


class LinearVelocity(torch.nn.Module):
    """v(x, sigma, prompt) = x W + sigma b[prompt] on 1x2x2 latents: a small real module whose gradients both
    sides' losses are compared through."""

    latent_shape = (1, 2, 2)
    device = torch.device("cpu")

    def __init__(self, seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(4, 4, generator=generator) * 0.3)
        self.bias = torch.nn.Parameter(torch.randn(8, 4, generator=generator) * 0.3)

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        return torch.tensor([[int(p.split()[-1])] for p in prompts])

    def forward(self, x, sigma, prompt_ids):
        sigma = torch.as_tensor(sigma).reshape(-1, 1)
        return (x.flatten(1) @ self.weight + sigma * self.bias[prompt_ids[:, 0]]).view_as(x)


def preset_config(name: str, *extra: str):
    return load_config(None, [*PRESETS[name][0], *extra])


@pytest.mark.parametrize("name", PRESETS)
def test_sde_step_log_prob_mean_and_std_equal_upstream(name):
    """Every step of the preset's schedule, each sample scored at a draw from upstream's own Gaussian."""
    config = preset_config(name)
    upstream_step = PRESETS[name][1]
    sde = sde_settings(config)
    noise_level = UPSTREAM_NOISE[config.algo.compat]
    sigmas = sde.sigmas.to(DTYPE)
    generator = torch.Generator().manual_seed(1)
    for k in range(config.sampling.num_steps):
        x, v = (torch.randn(3, 1, 2, 2, generator=generator, dtype=DTYPE) for _ in range(2))
        _, mean, std_dev_t = upstream_step(sigmas, k, x, v, noise_level, x)
        sqrt_dt = math.sqrt(sigmas[k] - sigmas[k + 1]) if upstream_step is flow_grpo_sde_step else 1.0
        noise = torch.randn(3, 1, 2, 2, generator=generator, dtype=DTYPE)
        prev = mean + std_dev_t.reshape(-1, 1, 1, 1) * sqrt_dt * noise
        up_log_prob, up_mean, up_std = upstream_step(sigmas, k, x, v, noise_level, prev)
        ours = sde_step(
            v, x, sigmas[k], sigmas[k + 1], noise_level=sde.noise_level, kind=sde.kind,
            cps_log_prob=sde.cps_log_prob, prev_latents=prev,
        )  # fmt: skip
        torch.testing.assert_close(ours.mean, up_mean, rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.std_dev_t, up_std.reshape(-1).expand(3), rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.log_prob, up_log_prob, rtol=1e-6, atol=1e-6)


def rewards_and_groups(groups: int, group_size: int, seed: int = 0):
    """Rewards with ties, and prompt texts that repeat across groups ("digit 3" twice), as a step's batch holds."""
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 4, (groups * group_size,), generator=generator).double() / 3
    rewards += torch.rand(groups * group_size, generator=generator, dtype=torch.float64) * 0.1
    digits = [0, 3, 3, 5, 7, 3][:groups]
    prompt_index = [p for p in range(groups) for _ in range(group_size)]
    texts = [f"digit {digits[p]}" for p in prompt_index]
    return rewards.numpy(), prompt_index, texts


ADVANTAGES = {
    # name: (overrides, upstream advantages (clamped at the loss, +-5 in every upstream's defaults))
    "flow_grpo global std": (
        ["algo.compat=flow_grpo"],
        lambda r, idx, texts, g: flow_grpo_advantages(texts, r, global_std=True),
    ),
    "flow_grpo group std": (
        ["algo.compat=flow_grpo", "algo.std_scope=group"],
        lambda r, idx, texts, g: flow_grpo_advantages(texts, r, global_std=False),
    ),
    "flow_grpo no per-prompt stats": (
        ["algo.compat=flow_grpo", "algo.adv_baseline=batch"],
        lambda r, idx, texts, g: flow_grpo_batch_advantages(r),
    ),
    "flow_grpo_fast": (
        ["algo.compat=flow_grpo_fast"],
        lambda r, idx, texts, g: flow_grpo_advantages(texts, r, global_std=True),
    ),
    "dance_grpo": (["algo.compat=dance_grpo"], lambda r, idx, texts, g: dance_grpo_advantages(r, g)),
    "dance_grpo without groups": (
        ["algo.compat=dance_grpo", "algo.adv_baseline=batch", "algo.std_scope=global"],
        lambda r, idx, texts, g: dance_grpo_advantages(r, g, use_group=False),
    ),
    "verl_omni global std": (["algo.compat=verl_omni"], lambda r, idx, texts, g: verl_omni_advantages(r, idx)),
    "verl_omni group std": (
        ["algo.compat=verl_omni", "algo.std_scope=group"],
        lambda r, idx, texts, g: verl_omni_advantages(r, idx, global_std=False),
    ),
}


@pytest.mark.parametrize("name", ADVANTAGES)
@pytest.mark.parametrize("groups, group_size", [(6, 4), (4, 2), (3, 7)])
def test_advantages_equal_upstream(name, groups, group_size):
    overrides, upstream = ADVANTAGES[name]
    config = load_config(None, overrides)
    rewards, prompt_index, texts = rewards_and_groups(groups, group_size)
    expected = torch.as_tensor(upstream(rewards, prompt_index, texts, group_size), dtype=torch.float64).clamp(-5, 5)
    ours = advantages_of(config, rewards, prompt_index, texts)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-6, atol=1e-6)


def test_dovetail_advantages_are_sqrt_g_over_g_minus_1_larger_than_dance_grpos():
    """The measured difference of issue 12: dovetail's own population std against DanceGRPO's sample std (with
    DanceGRPO's eps, so that the std convention alone differs)."""
    rewards, prompt_index, texts = rewards_and_groups(4, 4)
    ours = advantages_of(load_config(None, ["algorithm=dance_grpo", "algo.adv_eps=1e-8"]), rewards, prompt_index, texts)
    dance = dance_grpo_advantages(rewards, 4)
    torch.testing.assert_close(ours.double(), dance * math.sqrt(4 / 3), rtol=1e-6, atol=1e-6)


def step_samples(step: int, groups: int = 4, group_size: int = 4) -> list[SampleId]:
    return [SampleId(step, p, i) for p in range(groups) for i in range(group_size)]


@pytest.mark.parametrize("num_steps", [2, 3, 10, 16, 40])
@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5, 0.6, 0.99, 1.0])
def test_trained_timesteps_are_upstreams(num_steps, fraction):
    """Flow-GRPO: range(int(K * fraction)) (scripts/train_sd3.py L345, L864); DanceGRPO: a random permutation of
    the K - 1 steps before the last (fastvideo/train_grpo_flux.py L511-L520) per sample, of which it trains
    int((K - 1) * fraction) (L551-L572); verl-omni: every step of its default SDE window (0, K - 1)
    (verl_omni/pipelines/qwen_image_flow_grpo/vllm_omni_rollout_adapter.py L310-L320). The planner's count is the
    same. A fraction whose upstream count is 0, or reaches the last step, is refused (dovetail never trains it)."""
    upstream = {
        "flow_grpo": int(num_steps * fraction),
        "dance_grpo": int((num_steps - 1) * fraction),
        "verl_omni": num_steps - 1,
    }
    for preset, count in upstream.items():
        overrides = [f"algo.compat={preset}", f"sampling.num_steps={num_steps}", f"algo.timestep_fraction={fraction}"]
        if preset == "verl_omni":
            overrides.pop()  # verl-omni trains its whole window: the preset's fraction is 1
        if not 1 <= count <= num_steps - 1:
            with pytest.raises(ConfigError, match="algo.timestep_fraction"):
                load_config(None, overrides)
            continue
        config = load_config(None, overrides)
        drawn = [sample_timesteps(config, s) for step in range(3) for s in step_samples(step)]
        assert flow_rules(config).trained_timesteps == count and {len(t) for t in drawn} == {count}
        if preset != "dance_grpo":
            assert all(t == list(range(count)) for t in drawn)
        else:
            assert all(t == sorted(set(t)) and t[-1] < num_steps - 1 for t in drawn)


def test_dance_grpo_draws_each_samples_own_subset_by_its_identity():
    """One subset per sample (DanceGRPO's per-sample randperm), uniform over the K - 1 steps, and a function of the
    sample alone: any device that trains the sample draws the same."""
    config = load_config(None, ["algo.compat=dance_grpo", "sampling.num_steps=16", "algo.timestep_fraction=0.6"])
    samples = [s for step in range(40) for s in step_samples(step)]
    drawn = {s: sample_timesteps(config, s) for s in samples}
    assert len({tuple(t) for t in drawn.values()}) > 0.9 * len(samples)  # C(15, 9) = 5005 subsets
    assert all(sample_timesteps(config, s) == drawn[s] for s in reversed(samples))
    counts = np.bincount([k for t in drawn.values() for k in t], minlength=15)
    expected = len(samples) * 9 / 15
    assert counts.shape == (15,) and np.all(np.abs(counts - expected) < 5 * math.sqrt(expected))


def test_flow_grpo_fast_trains_a_window_of_consecutive_steps():
    """Flow-GRPO-Fast's window: start uniform in [lo, hi - size] (random.randint, both ends included; verl-omni
    vllm_omni_rollout_adapter.py L310-L318 draws the same range), `size` consecutive steps, the size 2 of FlowCPS
    config/base.py L60. dovetail draws one window per RL step, keyed by (seed, step)."""
    config = load_config(None, ["algo.compat=flow_grpo_fast", "algo.window_range=[1, 7]"])
    windows = [sample_timesteps(config, SampleId(step, 0, 0)) for step in range(300)]
    assert flow_rules(config).trained_timesteps == 2 and all(w == [w[0], w[0] + 1] for w in windows)
    assert {w[0] for w in windows} == set(range(1, 7 - 2 + 1))
    assert all(sample_timesteps(config, s) == windows[3] for s in step_samples(3))


@pytest.mark.parametrize("num_steps, shift", [(16, 3.0), (10, 1.0), (25, 5.0)])
def test_sigma_schedules_are_upstreams(num_steps, shift):
    """DanceGRPO's own schedule, and diffusers' (Flow-GRPO, verl-omni): issue 12's 0.167 against 0.0089."""
    sampling = [f"sampling.num_steps={num_steps}", f"sampling.shift={shift}"]
    dance = sde_settings(load_config(None, ["algo.compat=dance_grpo", *sampling])).sigmas
    torch.testing.assert_close(dance, dance_grpo_sigmas(num_steps, shift), rtol=0, atol=1e-6)
    for preset in ("dovetail", "flow_grpo", "verl_omni"):
        sigmas = sde_settings(load_config(None, [f"algo.compat={preset}", *sampling])).sigmas
        torch.testing.assert_close(sigmas, diffusers_sigmas(num_steps, shift), rtol=0, atol=1e-6)
    if (num_steps, shift) == (16, 3.0):
        assert round(float(dance[-2]), 3) == 0.167 and round(float(diffusers_sigmas(16, 3.0)[-2]), 4) == 0.0089


def test_default_noise_levels_are_upstreams():
    for preset, noise_level in UPSTREAM_NOISE.items():
        assert flow_rules(load_config(None, [f"algo.compat={preset}"])).noise_level == noise_level
    assert flow_rules(load_config(None, ["algo.compat=flow_grpo", "sampling.noise_level=0.9"])).noise_level == 0.9
    own = load_config(None, [])
    dance = load_config(None, ["algorithm=dance_grpo"])
    assert (flow_rules(own).noise_level, flow_rules(dance).noise_level) == (1.0, 0.5)
    assert own.algo.kl_std == "total" and own.algo.adv_unbiased is False and own.sampling.schedule == "diffusers"


LOSSES = {
    # name: (overrides with upstream configs' KL coefficient, upstream's step function)
    "flow_grpo": (["algo.compat=flow_grpo", "algo.timestep_fraction=0.99", "algo.beta=0.04"], flow_grpo_sde_step),
    "flow_grpo cps": (
        ["algo.compat=flow_grpo", "algo.timestep_fraction=0.99", "algo.beta=0.04", "sampling.sde_kind=cps"],
        cps_step,
    ),
    "flow_grpo_fast cps": (["algo.compat=flow_grpo_fast", "algo.beta=0.04", "sampling.sde_kind=cps"], cps_step),
    "dance_grpo": (
        ["algo.compat=dance_grpo", "sampling.num_steps=16", "sampling.shift=3", "algo.timestep_fraction=0.6"],
        dance_grpo_step,
    ),
    "verl_omni": (["algo.compat=verl_omni", "algo.beta=0.001"], flow_grpo_sde_step),  # kl_loss_coef: 0.001
}


def upstream_gradient(config, model, reference, trajectories, advantages, timesteps, upstream_step):
    """Upstream's training loop over the same trajectories: per trained timestep j, the surrogate of the batch plus
    beta * KL (flow_grpo scripts/train_sd3.py L864-L897 -- its gradient accumulation averages the T timesteps --,
    verl-omni FlowGRPOLoss + KLLoss), or, with each sample's own timesteps, sample by sample divided by
    gradient_accumulation_steps * train_timesteps (DanceGRPO fastvideo/train_grpo_flux.py L570-L605, one optimizer
    step for the batch as dovetail takes). Returns (loss, the parameters' gradient)."""
    sigmas, algo = trajectories.sigmas, config.algo
    noise_level = UPSTREAM_NOISE[algo.compat]
    rows, count = len(timesteps), len(timesteps[0])
    total = torch.zeros((), dtype=DTYPE)
    for i in range(rows):  # a batch of one sample keeps each sample's own timesteps
        for j in range(count):
            k = timesteps[i][j]
            x, prev = trajectories.latents[i : i + 1, k], trajectories.latents[i : i + 1, k + 1]
            ids = trajectories.prompt_ids[i : i + 1]
            log_prob, mean, std_dev_t = upstream_step(sigmas, k, x, model(x, sigmas[k : k + 1], ids), noise_level, prev)
            loss = grpo_loss(log_prob, trajectories.log_probs[i : i + 1, k], advantages[i : i + 1], algo.clip_range)
            if algo.beta > 0:
                with torch.no_grad():
                    _, ref_mean, _ = upstream_step(
                        sigmas, k, x, reference(x, sigmas[k : k + 1], ids), noise_level, prev
                    )
                loss = loss + algo.beta * upstream_kl(mean, ref_mean, std_dev_t.reshape(-1))
            total = total + loss / (rows * count)
    total.backward()
    return total.item(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("name", LOSSES)
def test_loss_and_gradient_of_a_step_equal_upstream(name):
    """Rollouts of a small real module, its weights moved (the policy is no longer the behaviour one), rewards;
    dovetail's training step (advantages, trained timesteps, surrogate, KL, normaliser, as the reference loop and
    every Ray worker run them) against upstream's loop on the same tensors: loss and gradient <= 1e-6."""
    overrides, upstream_step = LOSSES[name]
    config = load_config(None, [*overrides, "algo.prompts_per_step=3", "algo.group_size=4"])
    sde = sde_settings(config)
    behaviour = LinearVelocity(0)
    ids = step_samples(5, groups=3, group_size=4)
    prompts = [f"digit {(3 * s.prompt) % 8}" for s in ids]
    with torch.no_grad():
        rollout = generate(
            behaviour, prompts, ids, sde, seed=0, shared_group_noise=flow_rules(config).shared_group_noise,
            sde_steps=sde_steps(config, ids),
        )  # fmt: skip
    trajectories = Trajectories(
        prompts, rollout.prompt_ids, rollout.latents.to(DTYPE), rollout.log_probs.to(DTYPE), sde.sigmas.to(DTYPE)
    )
    rewards = torch.rand(len(ids), generator=torch.Generator().manual_seed(2), dtype=DTYPE).numpy()
    timesteps = [sample_timesteps(config, s) for s in ids]
    reference = LinearVelocity(0).to(DTYPE).requires_grad_(False)

    def policy() -> LinearVelocity:
        moved = LinearVelocity(0).to(DTYPE)
        with torch.no_grad():
            for parameter in moved.parameters():
                parameter += 0.02 * torch.randn(
                    parameter.shape, generator=torch.Generator().manual_seed(3), dtype=DTYPE
                )
        return moved

    ours = policy()
    sums = policy_gradient(
        ours, trajectories, advantages_of(config, rewards, [s.prompt for s in ids], prompts), timesteps,
        SDESettings(trajectories.sigmas, sde.noise_level, sde.kind, sde.cps_log_prob), config,
        total_pairs=flow_rules(config).pairs_per_step, reference_model=reference,
    )  # fmt: skip
    group_size = config.algo.group_size
    upstream_advantages = {
        "flow_grpo": lambda: flow_grpo_advantages(prompts, rewards, global_std=True),
        "flow_grpo_fast": lambda: flow_grpo_advantages(prompts, rewards, global_std=True),
        "dance_grpo": lambda: dance_grpo_advantages(rewards, group_size),
        "verl_omni": lambda: verl_omni_advantages(rewards, [s.prompt for s in ids]),
    }[config.algo.compat]()
    theirs = policy()
    loss, gradient = upstream_gradient(
        config, theirs, reference, trajectories, torch.as_tensor(upstream_advantages, dtype=DTYPE), timesteps,
        upstream_step,
    )  # fmt: skip
    pairs = flow_rules(config).pairs_per_step
    assert pairs == len(ids) * len(timesteps[0])
    assert sums["loss"] / pairs == pytest.approx(loss, rel=1e-6, abs=1e-6)
    assert 0 < sums["clip_frac"] < pairs  # both branches of the clip are exercised
    ours_gradient = torch.cat([p.grad.flatten() for p in ours.parameters()])
    assert gradient.abs().max() > 1e-3
    torch.testing.assert_close(ours_gradient, gradient, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind, upstream_step", [("flow_grpo", flow_grpo_sde_step), ("cps", cps_step)])
def test_flow_grpo_fast_samples_deterministically_outside_its_window(kind, upstream_step):
    """Outside the SDE window the step runs at noise level 0 (the deterministic Euler step), inside at the noise
    level, and only the window's log-probs are recorded: verl-omni vllm_omni_rollout_adapter.py L520-L547 (Flow-GRPO-
    Fast's sd3_pipeline_with_logprob_fast does the same). Each sample's whole trajectory against upstream's loop."""
    config = load_config(None, ["algo.compat=flow_grpo_fast", f"sampling.sde_kind={kind}", "algo.window_size=3"])
    sde, model = sde_settings(config), LinearVelocity(4)
    ids = step_samples(2, groups=2, group_size=3)
    prompts = [f"digit {s.prompt}" for s in ids]
    windows = sde_steps(config, ids)
    step_noise = keyed_normal([sample_key(7, "sde", *s) for s in ids], (config.sampling.num_steps, 1, 2, 2))
    with torch.no_grad():
        ours = generate(model, prompts, ids, sde, seed=7, shared_group_noise=False, sde_steps=windows)
        init_noise = ours.latents[:, 0]
        for row, window in enumerate(windows):
            x = init_noise[row : row + 1]
            prompt_ids = model.encode_prompts(prompts[row : row + 1])
            for k in range(config.sampling.num_steps):
                in_window = window[0] <= k < window[-1] + 1
                level = UPSTREAM_NOISE["flow_grpo_fast"] if in_window else 0.0
                v = model(x, sde.sigmas[k : k + 1], prompt_ids)
                _, mean, std_dev_t = upstream_step(sde.sigmas, k, x, v, level, x)
                sqrt_dt = math.sqrt(sde.sigmas[k] - sde.sigmas[k + 1]) if kind == "flow_grpo" else 1.0
                prev = mean + std_dev_t.reshape(-1, 1, 1, 1) * sqrt_dt * step_noise[row, k]
                torch.testing.assert_close(prev[0], ours.latents[row, k + 1], rtol=0, atol=1e-6)
                if in_window:
                    log_prob, _, _ = upstream_step(sde.sigmas, k, x, v, level, prev)
                    torch.testing.assert_close(ours.log_probs[row, k], log_prob[0], rtol=1e-6, atol=1e-6)
                else:
                    assert ours.log_probs[row, k] == 0 and torch.equal(prev, mean)
                x = prev
    assert {tuple(w) for w in windows} == {tuple(windows[0])}  # one window per RL step
    assert torch.equal(recompute_log_probs(model, ours, windows, sde), ours.log_probs)  # on policy the ratio is 1


def test_old_log_probs_are_recomputed_at_each_samples_own_timesteps():
    """What colocated trainers do with DanceGRPO's per-sample subsets: each sample's trained steps re-scored under the
    trainer's weights, one sample at a time as upstream scores them; every other step keeps the rollout's."""
    config = load_config(None, ["algo.compat=dance_grpo", "sampling.num_steps=12", "algo.timestep_fraction=0.4"])
    sde, behaviour, trainer = sde_settings(config), LinearVelocity(0), LinearVelocity(5).to(DTYPE)
    ids = step_samples(1, groups=2, group_size=3)
    prompts = [f"digit {s.prompt}" for s in ids]
    with torch.no_grad():
        rollout = generate(behaviour, prompts, ids, sde, seed=3, shared_group_noise=True)
    sigmas = sde.sigmas.to(DTYPE)
    rollout = Trajectories(prompts, rollout.prompt_ids, rollout.latents.to(DTYPE), rollout.log_probs.to(DTYPE), sigmas)
    timesteps = [sample_timesteps(config, s) for s in ids]
    recomputed = recompute_log_probs(trainer, rollout, timesteps, SDESettings(sigmas, sde.noise_level, sde.kind))
    for row, steps in enumerate(timesteps):
        for k in range(config.sampling.num_steps):
            if k not in steps:
                assert recomputed[row, k] == rollout.log_probs[row, k]
                continue
            x, prev = rollout.latents[row : row + 1, k], rollout.latents[row : row + 1, k + 1]
            with torch.no_grad():
                v = trainer(x, sigmas[k : k + 1], rollout.prompt_ids[row : row + 1])
            log_prob, _, _ = dance_grpo_step(sigmas, k, x, v, UPSTREAM_NOISE["dance_grpo"], prev)
            torch.testing.assert_close(recomputed[row, k], log_prob[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["algo.compat=flow_grpo", "policy=digen"],
            r"algo.std_scope=global and algo.adv_group=prompt_text \(algo.compat=flow_grpo\) needs the whole batch",
        ),
        (["algo.compat=verl_omni", "policy=colocated"], r"algo.std_scope=global \(algo.compat=verl_omni\)"),
        (["algo.adv_baseline=batch", "policy=disaggregated"], "use algo.adv_baseline=group, or policy=reference"),
        (["algo.compat=flow_grpo", "algo.timestep_fraction=1.0"], "Flow-GRPO's own configs use 0.99"),
        (["algo.compat=dance_grpo", "algorithm=flow_grpo"], "algo.compat=dance_grpo is algorithm dance_grpo"),
        (["algo.compat=flow_grpo_fast", "algorithm=dance_grpo"], "algo.compat=flow_grpo_fast is algorithm flow_grpo"),
        (["algo.compat=flow_grpo_fast", "algo.window_range=[4, 5]"], "algo.window_size=2"),
        (["sampling.cps_log_prob=squared_error"], "sampling.cps_log_prob=squared_error applies to the cps SDE only"),
        (["algo.compat=flow_grpo_v2"], "algo.compat"),
    ],
)
def test_a_preset_the_run_cannot_honour_is_one_line_naming_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config(None, overrides)
    assert "\n" not in str(error.value).strip()


def test_a_preset_fills_only_what_the_config_leaves_unset_and_records_it():
    """The resolved values reach config.yaml, which then loads to the same config."""
    config = load_config(None, ["algo.compat=dance_grpo", "algo.adv_eps=1e-3", "policy=digen"])
    assert (config.algo.adv_eps, config.algo.adv_unbiased, config.algorithm) == (1e-3, True, "dance_grpo")
    dumped = yaml.safe_load(dump_config(config))
    assert dumped["sampling"]["schedule"] == "dance_grpo" and parse_config(dumped) == config


@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
def test_dance_grpo_preset_on_the_ray_runtime_reproduces_the_reference(tmp_path):
    """Per-sample random timesteps on digen's fragments and timestep chunks (each sample's own subset, looked up
    from its identity on whichever device trains it): the parameters equal the reference loop's <= 1e-5, and every
    (sample, trained position) is trained once."""
    common = [
        "algo.compat=dance_grpo", "algo.prompts_per_step=4", "eval.every=100", "checkpoint.every=100",
        "cluster.devices=2",
    ]  # fmt: skip
    runs = {}
    for policy in (["policy=reference"], ["policy=digen", "runtime.fragments=2", "runtime.tsp_chunk=2"]):
        runs[policy[0]] = out = tmp_path / policy[0].partition("=")[2]
        train(load_config(None, common + policy), out, steps=2)
    weights = {name: load_file(out / "checkpoints" / "step_000002" / "model.safetensors") for name, out in runs.items()}
    reference, digen = weights["policy=reference"], weights["policy=digen"]
    assert max((reference[k] - digen[k]).abs().max().item() for k in reference) <= 1e-5
    base = load_file(DEFAULT_CHECKPOINT / "model.safetensors")
    assert max((reference[k] - base[k]).abs().max().item() for k in reference) > 1e-4  # it did train
    ledger = json.loads((runs["policy=digen"] / "ledger.json").read_text())
    assert ledger["problems"] == [] and len(ledger["trained"]) == 2 * 4 * 8 * 4  # steps x samples x positions
