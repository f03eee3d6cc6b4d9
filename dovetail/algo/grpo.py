"""GRPO for flow models: group-relative advantages, the clipped surrogate, and which steps to train."""

import math

import torch

STD_SCOPES = ("group", "global", "none")
TIMESTEP_MODES = ("prefix", "random", "window")


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    std_scope: str = "group",
    eps: float = 1e-4,
    unbiased: bool = False,
    clip: float = 5.0,
) -> torch.Tensor:
    """(r - mean of its group) / (std + eps), clipped to +-clip; a group of one gets 0.

    std_scope: ``group`` (std over the sample's group), ``global`` (std over the whole batch,
    as Flow-GRPO does for small groups) or ``none`` (divide by 1).
    """
    if std_scope not in STD_SCOPES:
        raise ValueError(f"std_scope={std_scope!r} is not one of {STD_SCOPES}")
    rewards = rewards.double()
    group_ids = torch.as_tensor(group_ids)
    advantages = torch.zeros_like(rewards)
    global_std = rewards.std(unbiased=unbiased) if rewards.numel() > 1 else rewards.new_tensor(0.0)
    for group in torch.unique(group_ids):
        members = group_ids == group
        r = rewards[members]
        if r.numel() < 2:
            continue
        if std_scope == "group":
            scale = r.std(unbiased=unbiased) + eps
        elif std_scope == "global":
            scale = global_std + eps
        else:
            scale = 1.0
        advantages[members] = (r - r.mean()) / scale
    return advantages.clamp(-clip, clip).float()


def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    ref_mean: torch.Tensor | None = None,
    mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (mean over the given (sample, timestep) pairs) + beta * KL.

    The KL to the reference policy is the closed form between two Gaussians that share the
    step's std (per sample, shape (B,)): |mean - ref_mean|^2 / (2 std^2), averaged over non-batch dims.
    """
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    kl = torch.zeros((), dtype=loss.dtype)
    if beta > 0:
        if ref_mean is None or mean is None or std is None:
            raise ValueError("beta > 0 needs ref_mean, mean and std for the KL term")
        dims = tuple(range(1, mean.ndim))
        kl = (((mean - ref_mean) ** 2).mean(dim=dims) / (2 * std.reshape(-1) ** 2)).mean()
        loss = loss + beta * kl
    with torch.no_grad():
        log_ratio = log_prob - old_log_prob
        stats = {
            "clip_frac": ((ratio - 1.0).abs() > clip_range).float().mean().item(),
            "approx_kl": 0.5 * (log_ratio**2).mean().item(),
            "ratio_mean": ratio.mean().item(),
            "ratio_min": ratio.min().item(),
            "ratio_max": ratio.max().item(),
            "kl_ref": float(kl),
        }
    return loss, stats


def select_train_timesteps(
    num_steps: int,
    *,
    fraction: float,
    mode: str = "prefix",
    window: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Indices of the denoising steps to train on; the last (lowest-noise) step never is.

    ``prefix`` (Flow-GRPO): the first steps; ``random`` (DanceGRPO): a random subset;
    ``window``: `window` consecutive steps at a random start (the SDE window of Flow-GRPO-Fast).
    """
    if mode not in TIMESTEP_MODES:
        raise ValueError(f"mode={mode!r} is not one of {TIMESTEP_MODES}")
    trainable = num_steps - 1
    if trainable < 1:
        raise ValueError(f"num_steps={num_steps} leaves no trainable step (need at least 2)")
    if mode == "window":
        if window is None or not 1 <= window <= trainable:
            raise ValueError(f"window={window} must be between 1 and num_steps - 1 = {trainable}")
        start = int(torch.randint(0, trainable - window + 1, (1,), generator=generator))
        return list(range(start, start + window))
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction} must be in (0, 1]")
    count = max(1, min(trainable, math.ceil(fraction * trainable - 1e-9)))
    if mode == "prefix":
        return list(range(count))
    return sorted(torch.randperm(trainable, generator=generator)[:count].tolist())
