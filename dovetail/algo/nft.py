"""DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117; NVlabs/DiffusionNFT scripts/train_nft_sd3.py): reinforcement on
the forward process. No likelihood: a clean sample x0 of the rollout is noised afresh, x_t = (1 - t) x0 + t eps, and
the velocity is trained by flow matching towards v = eps - x0 through two implicit policies that share the trained
velocity v_theta and the old (sampling) policy's v_old, weighted by the sample's optimality probability r."""

import torch

ADAPTIVE_WEIGHT_FLOOR = 1e-5
"""The least adaptive weight a sample's loss divides by (upstream's `.clip(min=0.00001)`)."""


def optimality_probability(advantages: torch.Tensor, clip: float) -> torch.Tensor:
    """r in [0, 1] from the group advantages, as upstream maps them (adv_mode "all"):

    r = clamp(clamp(A, -clip, clip) / clip / 2 + 1/2, 0, 1)

    so A = 0 is r = 1/2 (the two implicit policies weigh the same), A = clip is r = 1 (only the positive one)."""
    clipped = advantages.clamp(-clip, clip)
    return (clipped / clip / 2.0 + 0.5).clamp(0.0, 1.0)


def noised(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The forward process at t (per sample, (B,)): x_t = (1 - t) x0 + t eps, the rectified flow's interpolation
    whose velocity d x_t / d t is eps - x0 (the velocity dovetail's flow models predict, `algo.sde_step`)."""
    t = t.reshape(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)
    return (1 - t) * x0 + t * noise


def diffusion_nft_loss(
    velocity: torch.Tensor,
    old_velocity: torch.Tensor,
    x0: torch.Tensor,
    xt: torch.Tensor,
    t: torch.Tensor,
    advantages: torch.Tensor,
    *,
    beta: float,
    adv_clip: float,
    ref_velocity: torch.Tensor | None = None,
    kl_beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DiffusionNFT's loss, the mean over the given (sample, timestep) pairs, as train_nft_sd3.py writes it.

    With v_old the old policy's velocity (no gradient) and `beta` NFT's guidance strength (config.beta):

        v+ = beta v_theta + (1 - beta) v_old          (the implicit positive policy)
        v- = (1 + beta) v_old - beta v_theta          (the implicit negative policy)
        x0± = x_t - t v±                              (their clean-sample predictions)
        L± = mean((x0± - x0)^2) / sg(max(mean|x0± - x0|, 1e-5))    (adaptive weighting, per sample)
        loss = adv_clip * mean(r L+ / beta + (1 - r) L- / beta) + kl_beta * mean(mean((v_theta - v_ref)^2))

    r = `optimality_probability(advantages, adv_clip)`. Since x0± - x0 = -t (v± - (eps - x0)), L± is t |v± - v|^2
    over the mean |v± - v|: flow matching of each implicit policy towards the target, self-normalised per sample.
    Upstream multiplies by adv_clip_max (its train.adv_clip_max, 5) so that the loss's scale is the advantage's; the
    KL term (its train.beta, 1e-4 for SD3.5) is to the frozen reference's velocity, `ref_velocity`."""
    dims = tuple(range(1, x0.ndim))
    t = t.reshape(-1, *([1] * (x0.ndim - 1))).to(xt.dtype)
    old_velocity = old_velocity.detach()
    positive = beta * velocity + (1 - beta) * old_velocity
    negative = (1.0 + beta) * old_velocity - beta * velocity
    r = optimality_probability(advantages, adv_clip)

    def weighted_error(prediction: torch.Tensor) -> torch.Tensor:
        x0_prediction = xt - t * prediction
        with torch.no_grad():
            weight = (x0_prediction.double() - x0.double()).abs().mean(dim=dims, keepdim=True)
            weight = weight.clip(min=ADAPTIVE_WEIGHT_FLOOR)
        return ((x0_prediction - x0) ** 2 / weight).mean(dim=dims)

    per_pair = r * weighted_error(positive) / beta + (1.0 - r) * weighted_error(negative) / beta
    loss = (per_pair * adv_clip).mean()
    kl = torch.zeros((), dtype=loss.dtype, device=loss.device)
    if kl_beta > 0:
        if ref_velocity is None:
            raise ValueError("kl_beta > 0 needs the reference's velocity")
        kl = ((velocity - ref_velocity) ** 2).mean(dim=dims).mean()
        loss = loss + kl_beta * kl
    with torch.no_grad():
        stats = {
            "optimality_mean": r.float().mean().item(),
            "old_deviation": ((velocity - old_velocity) ** 2).float().mean().item(),
            "kl_ref": float(kl),
        }
    return loss, stats


def old_policy_decay(step: int, *, flat: int, rate: float, ceiling: float) -> float:
    """The old policy's decay after optimizer step `step` (upstream's `return_decay`): 0 for the first `flat` steps,
    then (step - flat) * rate, at most `ceiling`. Upstream's decay_type 0 is (0, 0, 0): the old policy is the
    weights; type 1 (its default) (0, 0.001, 0.5); type 2 (its OCR run) (75, 0.0075, 0.999)."""
    if step < flat:
        return 0.0
    return min((step - flat) * rate, ceiling)


@torch.no_grad()
def soft_update(old: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], decay: float) -> None:
    """old <- decay * old + (1 - decay) * weights, in place: the old (sampling) policy after a step (upstream, at the
    end of each epoch, `tgt * decay + src * (1 - decay)`)."""
    for name, tensor in old.items():
        tensor.copy_(tensor * decay + weights[name].detach().to(tensor.device) * (1.0 - decay))


def forward_timesteps(num_steps: int, count: int, generator: torch.Generator) -> list[int]:
    """`count` of the schedule's `num_steps` sigmas (indices 0..K-1, sigma_0 = 1 included), drawn without replacement:
    upstream trains each sample at the first int(K * timestep_fraction) of a random permutation of the sampler's own
    timesteps (t = timestep / 1000 = sigma), not at t ~ U(0, 1). Sorted: the order does not change the step's sum."""
    if not 1 <= count <= num_steps:
        raise ValueError(f"count={count} must be between 1 and num_steps={num_steps}")
    return sorted(torch.randperm(num_steps, generator=generator)[:count].tolist())
