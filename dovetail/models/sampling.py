"""Our own sampling loops: the SDE sampler that rollouts use and the ODE sampler for evaluation.

Randomness is keyed by (seed, step, prompt, sample), never by a device or a batch position, so a
sample is the same wherever and with whatever neighbours it is generated.
"""

from dataclasses import dataclass
from functools import partial

import torch

from dovetail.algo import sde_step


def keyed_normal(keys: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """One standard-normal tensor of `shape` per key, stacked: row i depends on keys[i] only."""
    rows = [torch.randn(shape, generator=torch.Generator().manual_seed(k)) for k in keys]
    return torch.stack(rows)


@dataclass
class Trajectories:
    """A batch of SDE rollouts: everything training needs to re-score any step."""

    prompts: list[str]
    prompt_ids: torch.Tensor  # (B, L)
    latents: torch.Tensor  # (B, K+1, C, H, W): latents[:, k] is the input of step k
    log_probs: torch.Tensor  # (B, K): log-prob of the step taken at each k
    sigmas: torch.Tensor  # (K+1,)

    @property
    def images(self) -> torch.Tensor:
        return self.latents[:, -1]

    def select(self, rows: list[int]) -> "Trajectories":
        return Trajectories(
            [self.prompts[i] for i in rows],
            self.prompt_ids[rows],
            self.latents[rows],
            self.log_probs[rows],
            self.sigmas,
        )

    @staticmethod
    def concat(parts: list["Trajectories"]) -> "Trajectories":
        return Trajectories(
            [p for part in parts for p in part.prompts],
            torch.cat([p.prompt_ids for p in parts]),
            torch.cat([p.latents for p in parts]),
            torch.cat([p.log_probs for p in parts]),
            parts[0].sigmas,
        )


@torch.no_grad()
def sample_sde(
    model,
    prompts: list[str],
    sigmas: torch.Tensor,
    *,
    init_noise: torch.Tensor,
    step_noise: torch.Tensor,
    noise_level: float,
    kind: str,
    cps_log_prob: str = "gaussian",
    stochastic: torch.Tensor | None = None,
) -> Trajectories:
    """Roll out the SDE from pure noise; step_noise[:, k] drives step k. Where `stochastic[i, k]` (bool, (B, K)) is
    False, sample i takes the deterministic Euler step k (noise level 0; log-prob 0); its stochastic steps are
    computed exactly as training scores them."""
    prompt_ids = model.encode_prompts(prompts)
    x = init_noise.float()
    chain, log_probs = [x], []
    for k in range(len(sigmas) - 1):
        velocity = model(x, sigmas[k].expand(x.shape[0]), prompt_ids)
        step_k = partial(sde_step, velocity, x, sigmas[k], sigmas[k + 1], kind=kind, cps_log_prob=cps_log_prob)
        step = step_k(noise_level=noise_level, noise=step_noise[:, k])
        x, log_prob = step.prev_latents, step.log_prob
        if stochastic is not None and not bool(stochastic[:, k].all()):
            euler = step_k(noise_level=0.0, noise=step_noise[:, k])
            keep = stochastic[:, k].to(x.device)
            x = torch.where(keep.view(-1, *[1] * (x.ndim - 1)), x, euler.prev_latents)
            log_prob = torch.where(keep, log_prob, euler.log_prob)
        chain.append(x)
        log_probs.append(log_prob)
    return Trajectories(prompts, prompt_ids, torch.stack(chain, 1), torch.stack(log_probs, 1), sigmas)


@torch.no_grad()
def sample_ode(model, prompts: list[str], sigmas: torch.Tensor, init_noise: torch.Tensor) -> torch.Tensor:
    """Deterministic Euler integration of the flow: the model's mean behaviour, for evaluation."""
    prompt_ids = model.encode_prompts(prompts)
    x = init_noise.float()
    for k in range(len(sigmas) - 1):
        velocity = model(x, sigmas[k].expand(x.shape[0]), prompt_ids)
        x = x + velocity * (sigmas[k + 1] - sigmas[k])
    return x
