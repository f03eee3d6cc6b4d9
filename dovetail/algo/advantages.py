"""Advantage estimators of outcome rewards (one scalar per response), registered by name: `algo.advantage`.

Each estimator maps the step's rewards (N,), their groups (N,: the prompt each response answers) and their response
lengths in tokens (N,) to one advantage per response, in float64; `advantages` looks one up and clips the result to
+-clip. `whole_batch` says whether an estimator's statistics span every response of the batch (then whoever calls
it must hand it the whole batch, not one micro-batch) or only each response's own group.

`gae` is the one estimator with a critic (`needs_values`): token-level, from each response token's value estimate,
it gives an advantage and a return per token (`gae_advantages_returns`), which the critic learns to predict.

All the others are verl's outcome estimators (verl/trainer/ppo/core_algos.py, `register_adv_est`), which the tests
transcribe and compare on the same tensors. Where verl whitens over the batch it whitens over tokens
(`masked_whiten` of the reward broadcast over each response's tokens): a response weighs its length there, which is
what `lengths` is for.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dovetail.algo.grpo import exact_mean, group_advantages

WHITEN_EPS = 1e-8
"""verl's `masked_whiten`: (x - mean) * rsqrt(var + 1e-8)."""


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    estimate: Callable[..., torch.Tensor]
    """(rewards, group_ids, lengths, *, std_scope) -> advantages, all (N,), float64."""
    whole_batch: bool
    """Its statistics span the whole batch: a micro-batch alone would give other advantages."""
    needs_values: bool = False
    """It reads a critic's value of every response token and gives per-token advantages and returns
    (`gae_advantages_returns`), not one advantage per response: `advantages` cannot call it."""


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage(name: str, *, whole_batch: bool, needs_values: bool = False):
    """Register the decorated function as the estimator `name` (one spelling, one place: this module)."""

    def register(estimate: Callable[..., Any]) -> Callable[..., Any]:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(name, estimate, whole_batch, needs_values)
        return estimate

    return register


def advantages(
    name: str,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    lengths: torch.Tensor,
    *,
    std_scope: str = "group",
    clip: float = 5.0,
) -> torch.Tensor:
    """The advantages (N,) of estimator `name`, clipped to +-clip, as float32."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage={name!r} is not one of {tuple(ADVANTAGE_ESTIMATORS)}")
    if ADVANTAGE_ESTIMATORS[name].needs_values:
        raise ValueError(f"advantage={name!r} reads a critic's values per token: call gae_advantages_returns")
    if not rewards.shape == group_ids.shape == lengths.shape or rewards.ndim != 1:
        raise ValueError(
            f"rewards, group_ids and lengths must be (N,) alike, got {tuple(rewards.shape)}, "
            f"{tuple(group_ids.shape)}, {tuple(lengths.shape)}"
        )
    estimate = ADVANTAGE_ESTIMATORS[name].estimate
    raw = estimate(rewards.double(), torch.as_tensor(group_ids), lengths.double(), std_scope=std_scope)
    return raw.clamp(-clip, clip).float()


@register_advantage("grpo", whole_batch=False)
def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor, *, std_scope: str) -> torch.Tensor:
    """A_i = (r_i - mean_g r) / (std_g r + 1e-4) (std_scope ``none``, Dr. GRPO: r_i - mean_g r), population std;
    `group_advantages` (DeepSeekMath, arXiv 2402.03300; verl `compute_grpo_outcome_advantage`, which uses the
    sample std and eps 1e-6)."""
    return group_advantages(rewards, group_ids, std_scope=std_scope, clip=float("inf")).double()


@register_advantage("rloo", whole_batch=False)
def rloo(rewards: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor, *, std_scope: str) -> torch.Tensor:
    """A_i = r_i - mean_{j != i in g} r_j = (r_i - mean_g r) * G / (G - 1): each response's baseline is the mean of
    the others in its group, so it does not depend on the response itself (REINFORCE Leave-One-Out, Ahmadian et al.
    2024, arXiv 2402.14740; verl `compute_rloo_outcome_advantage`). The advantages of a group sum to 0. A group of
    one has no other response: 0 (verl leaves its raw reward)."""
    out = torch.zeros_like(rewards)
    for group in torch.unique(group_ids):
        members = group_ids == group
        size = int(members.sum())
        if size > 1:
            r = rewards[members]
            out[members] = (r - exact_mean(r)) * size / (size - 1)
    return out


@register_advantage("reinforce_plus_plus", whole_batch=True)
def reinforce_plus_plus(
    rewards: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor, *, std_scope: str
) -> torch.Tensor:
    """A_i = whiten(r)_i over the whole batch, no per-prompt baseline: the outcome return (gamma = 1, the reward on
    the last token) whitened over every response token of the batch (REINFORCE++, Hu 2025, arXiv 2501.03262; verl
    `compute_reinforce_plus_plus_outcome_advantage`, see `token_whiten`)."""
    return token_whiten(rewards, lengths)


@register_advantage("reinforce_plus_plus_baseline", whole_batch=True)
def reinforce_plus_plus_baseline(
    rewards: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor, *, std_scope: str
) -> torch.Tensor:
    """A_i = whiten(r - mean_g r)_i: the group mean subtracted, then whitened over the batch's tokens (REINFORCE++
    with baseline, arXiv 2501.03262; verl `compute_reinforce_plus_plus_baseline_outcome_advantage`). A group of one
    is its own mean here (0 before whitening; verl subtracts 0 from it)."""
    centred = torch.zeros_like(rewards)
    for group in torch.unique(group_ids):
        members = group_ids == group
        centred[members] = rewards[members] - exact_mean(rewards[members])
    return token_whiten(centred, lengths)


def token_whiten(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(v_i - m) / sqrt(s^2 + 1e-8), m and s^2 the mean and the sample variance (T / (T - 1)) of v over the batch's T
    response tokens, each response's value repeated on each of its tokens: verl's `masked_whiten`. Equal values give
    exactly 0; fewer than two tokens, no spread to whiten by: 0."""
    tokens = lengths.sum()
    if tokens < 2 or bool((values == values[0]).all()):
        return torch.zeros_like(values)
    mean = (values * lengths).sum() / tokens
    variance = (((values - mean) ** 2) * lengths).sum() / tokens * tokens / (tokens - 1)
    return (values - mean) * torch.rsqrt(variance + WHITEN_EPS)


@register_advantage("gae", whole_batch=True, needs_values=True)
def gae_advantages_returns(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438) per response token, as verl's
    `compute_gae_advantage_return` (verl/trainer/ppo/core_algos.py, `adv_estimator: gae`) computes it, all (B, T):

        delta_t = r_t + gamma * V_{t+1} - V_t,    A_t = delta_t + gamma * lam * A_{t+1},    R_t = A_t + V_t,

    V_{t+1} the value of the next token that `mask` holds (0 past the last), so the tokens outside the mask (padding,
    a multi-turn trajectory's observations) neither carry a TD error nor break the chain across them. The returns R
    are the critic's targets; the advantages are then whitened over every masked token of the batch (`token_whiten`,
    verl's `masked_whiten`), which makes the estimator whole-batch. gamma = lam = 1 gives A_t = sum_{k>=t} r_k - V_t
    before whitening: the reward-to-go less the value. An outcome reward sits on each response's last token.

    Returns (advantages, returns), 0 outside `mask`."""
    if not token_rewards.shape == values.shape == mask.shape or token_rewards.ndim != 2:
        raise ValueError(
            f"token_rewards, values and mask must be (B, T) alike, got {tuple(token_rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(mask.shape)}"
        )
    kept = mask.to(values.dtype)
    next_values = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    reversed_advantages = []
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_values - values[:, t]
        advantage = delta + gamma * lam * running
        next_values = values[:, t] * kept[:, t] + (1 - kept[:, t]) * next_values
        running = advantage * kept[:, t] + (1 - kept[:, t]) * running
        reversed_advantages.append(running)
    raw = torch.stack(reversed_advantages[::-1], dim=1)
    returns = (raw + values) * kept
    tokens = mask.bool()
    whitened = torch.zeros_like(raw)
    whitened[tokens] = token_whiten(raw[tokens], torch.ones_like(raw[tokens]))
    return whitened, returns
