"""One stochastic denoising step of a rectified-flow model, with its log-probability.

Sigma runs from 1 (noise) to 0 (data) and ``dt = sigma_next - sigma < 0``. The reverse-time SDE
that shares marginals with the flow ODE turns the deterministic Euler step into a Gaussian
policy, so each step has a log-probability that GRPO can push on.
"""

import math
from typing import NamedTuple

import torch

SDE_KINDS = ("flow_grpo", "dance_grpo", "cps")
CPS_LOG_PROBS = ("gaussian", "squared_error")


class SDEStep(NamedTuple):
    prev_latents: torch.Tensor  # the sample at sigma_next
    log_prob: torch.Tensor  # (B,), log-density averaged over non-batch dims (see `cps_log_prob`)
    mean: torch.Tensor  # mean of the step's Gaussian
    std: torch.Tensor  # (B,), total std of the step's Gaussian
    std_dev_t: torch.Tensor  # (B,), the std the upstream step functions return as `std_dev_t` (see `sde_step`)


def _per_sample(value, like: torch.Tensor) -> torch.Tensor:
    """A scalar or (B,) tensor in `like`'s dtype, of shape (B, 1, ..., 1), broadcastable against `like`."""
    value = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if value.ndim == 0:
        value = value.expand(like.shape[0])
    return value.reshape(-1, *([1] * (like.ndim - 1)))


def sde_step(
    velocity: torch.Tensor,
    latents: torch.Tensor,
    sigma,
    sigma_next,
    *,
    noise_level: float,
    kind: str = "flow_grpo",
    cps_log_prob: str = "gaussian",
    prev_latents: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> SDEStep:
    """Sample (or, given `prev_latents`, score) the step from `sigma` to `sigma_next`.

    kinds: ``flow_grpo`` std_t = a*sqrt(sigma/(1-sigma)) (sigma_next in the denominator at
    sigma = 1); ``dance_grpo`` constant std_t = a; ``cps`` coefficients-preserving sampling
    (std = sigma_next*sin(a*pi/2), the noise and data coefficients keep their ODE values).
    `noise` (standard normal, latents' shape) replaces drawing from `generator`: samplers key
    it by (step, prompt, sample) so that a sample does not depend on the device that made it.
    `noise_level` 0 makes the step the deterministic Euler step (Flow-GRPO-Fast's steps outside its window).

    `std_dev_t` is what Flow-GRPO, DanceGRPO and verl-omni return from their steps and divide their KL
    by: std_t for the flow_grpo SDE (the total std is std_t * sqrt(-dt)), the total std for the others.
    `cps_log_prob`: ``gaussian`` (the true log-density) or ``squared_error`` (-(x - mean)^2, Flow-GRPO's
    and verl-omni's CPS log-prob, which drops the Gaussian constants and the 1 / (2 std^2) factor).
    """
    if kind not in SDE_KINDS:
        raise ValueError(f"kind={kind!r} is not one of {SDE_KINDS}")
    if cps_log_prob not in CPS_LOG_PROBS:
        raise ValueError(f"cps_log_prob={cps_log_prob!r} is not one of {CPS_LOG_PROBS}")
    if cps_log_prob != "gaussian" and kind != "cps":
        raise ValueError(f"cps_log_prob={cps_log_prob!r} applies to kind cps only, not {kind!r}")
    dtype = torch.promote_types(velocity.dtype, torch.float32)  # fp32 at least (fp64 stays fp64)
    v = velocity.to(dtype)
    x = latents.to(dtype)
    s = _per_sample(sigma, x)
    s_next = _per_sample(sigma_next, x)
    dt = s_next - s

    if kind == "cps":
        std = s_next * math.sin(noise_level * math.pi / 2)
        x0_pred = x - s * v
        noise_pred = x + (1 - s) * v
        mean = x0_pred * (1 - s_next) + noise_pred * torch.sqrt((s_next**2 - std**2).clamp(min=0))
        std_dev_t = std
    else:
        if kind == "flow_grpo":
            denominator = torch.where(s >= 1, 1 - s_next, 1 - s)
            std_t = noise_level * torch.sqrt(s / denominator)
        else:
            std_t = torch.full_like(s, noise_level)
        mean = x + v * dt + std_t**2 / (2 * s) * (x + (1 - s) * v) * dt
        std = std_t * torch.sqrt(-dt)
        std_dev_t = std_t if kind == "flow_grpo" else std

    if prev_latents is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, dtype=dtype, device=x.device)
        prev = mean + std * noise
    else:
        prev = prev_latents.to(dtype)

    if cps_log_prob == "squared_error":
        log_prob = -((prev.detach() - mean) ** 2).mean(dim=tuple(range(1, x.ndim)))
    else:
        log_prob = gaussian_log_prob(prev.detach(), mean, std)
    return SDEStep(prev, log_prob, mean, std.reshape(-1), std_dev_t.reshape(-1))


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, std^2) averaged over non-batch dims; 0 where the step is deterministic."""
    safe_std = torch.where(std > 0, std, torch.ones_like(std))
    density = -((x - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - 0.5 * math.log(2 * math.pi)
    density = torch.where(std > 0, density, torch.zeros_like(density))
    return density.mean(dim=tuple(range(1, x.ndim)))
