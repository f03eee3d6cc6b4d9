"""The engines on a CUDA device compute what they compute on the CPU: the same keyed noise, trajectories and
policy gradient within float tolerance (the kernels differ). Skipped without a GPU; `benchmarks/gpu_check`
runs it, with the Ray runtime's GPU test, on a lent GPU machine."""

import numpy as np
import pytest
import torch

from dovetail.config.load import load_config
from dovetail.models.flow_rl import generate, group_sample_ids, step_prompts
from dovetail.models.t2i import load_model
from dovetail.models.training import strict_fp32
from dovetail.pipelines.flow.config import flow_rules
from dovetail.pipelines.flow.recipe import advantages_of, policy_gradient, sde_settings, step_timesteps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu() - b.cpu()).norm() / b.cpu().norm())


def test_generation_and_policy_gradient_on_cuda_match_the_cpu():
    strict_fp32()
    config = load_config(None, [])
    prompts_per_step, group = 4, 4
    prompts = step_prompts(config.seed, 0, prompts_per_step)
    ids = group_sample_ids(0, list(range(prompts_per_step)), group)
    sample_prompts = [prompts[s.prompt] for s in ids]
    advantages = advantages_of(config, np.linspace(0.0, 1.0, len(ids)), [s.prompt for s in ids])
    timesteps = step_timesteps(config, 0)

    results = {}
    for device in ("cpu", "cuda"):
        model = load_model(config.model.checkpoint).to(device)
        sde = sde_settings(config, device)
        trajectories = generate(
            model, sample_prompts, ids, sde, seed=config.seed, shared_group_noise=flow_rules(config).shared_group_noise
        )
        policy_gradient(model, trajectories, advantages, timesteps, sde, config, total_pairs=len(ids) * len(timesteps))
        gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[device] = trajectories, gradient

    (cpu, cpu_gradient), (gpu, gpu_gradient) = results["cpu"], results["cuda"]
    assert gpu.latents.device.type == "cuda" and gpu_gradient.device.type == "cuda"
    assert relative_error(gpu.latents, cpu.latents) <= 1e-4
    assert relative_error(gpu.log_probs, cpu.log_probs) <= 1e-4
    assert relative_error(gpu_gradient, cpu_gradient) <= 1e-3
