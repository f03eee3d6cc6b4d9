"""GRPO policy loss for language models: per-token clipped surrogate, KL to the reference, entropy bonus.

Advantages come from `dovetail.algo.advantages` (one per sequence); stale samples are corrected with the weight from
`dovetail.algo.grpo.decoupled_old_log_prob`, a rollout engine's log-prob mismatch with `rollout_correction_weight`.
This module only turns those into a loss. The importance ratio the surrogate clips is a registered policy loss
(`POLICY_LOSSES`, `algo.loss`): per token (PPO) or per sequence (GSPO).
"""

from collections.abc import Callable

import torch

AGGREGATIONS = ("token", "sequence", "drgrpo")
KL_ESTIMATORS = ("k1", "k2", "k3")
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")


def ppo_clip_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """log r_t = log pi(y_t) - log pi_old(y_t), per token (PPO, Schulman et al. 2017; GRPO and DAPO clip it)."""
    return torch.where(response, log_probs - old_log_probs, 0.0)


def gspo_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """log s_i = (1 / |y_i|) sum_t (log pi(y_i,t) - log pi_old(y_i,t)) on every token of sequence i, whose gradient is
    that of log s_i (GSPO, Zheng et al. 2025, arXiv 2507.18071; verl `compute_policy_loss_gspo`, TRL
    importance_sampling_level="sequence"): the ratio of the sequence's geometric-mean likelihoods, one value a
    sequence, clipped as one. Written per token as verl does, sg[log s_i] + log pi(y_i,t) - sg[log pi(y_i,t)]: the
    aggregation then weighs it as it weighs any per-token term, and with `sequence` it is GSPO's exactly."""
    per_token = torch.where(response, log_probs - old_log_probs, 0.0)
    lengths = response.sum(dim=-1, keepdim=True).clamp(min=1)
    sequence = (per_token.sum(dim=-1, keepdim=True) / lengths).detach()
    return torch.where(response, sequence + log_probs - log_probs.detach(), 0.0)


POLICY_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "ppo_clip": ppo_clip_log_ratio,
    "gspo": gspo_log_ratio,
}
"""`algo.loss`: the log importance ratio (B, T) the clipped surrogate uses, from (log_probs, old_log_probs, response
mask), 0 on padding."""


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's log-probs, d = log pi_ref - log pi (Schulman,
    "Approximating KL divergence", 2020; verl `kl_penalty`): ``k1`` -d ("kl"; unbiased, of either sign), ``k2``
    d^2 / 2 ("mse"; biased, >= 0, its gradient that of the true KL's second-order term), ``k3`` exp(d) - d - 1
    ("low_var_kl"; unbiased, >= 0, lower variance; verl also clamps it to [-10, 10])."""
    d = ref_log_probs - log_probs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d**2
    return torch.exp(d) - d - 1.0


def rollout_correction_weight(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mode: str, cap: float
) -> torch.Tensor:
    """Per-token weight for the mismatch between the rollout engine's sampling distribution and the trainer's
    (vLLM's kernels are not the trainer's), w = pi_old(trainer) / pi_rollout, detached:

    * ``tis``: min(w, cap), truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
      brings you off-policy RL training"; TRL vllm_importance_sampling_correction / _cap, verl rollout_is);
    * ``mis``: w where w <= cap, else 0: masked importance sampling (TRL's token_mask mode), the tokens the trainer
      finds far likelier than the engine did are left out of the surrogate instead of down-weighted to the cap;
    * ``none``: 1.

    Where the two log-probs are the same numbers (an engine that matches the trainer) w = exp(0) = 1 exactly."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout_correction={mode!r} is not one of {ROLLOUT_CORRECTIONS}")
    if not cap >= 1:
        raise ValueError(f"rollout_correction_cap={cap} must be >= 1")
    ratio = torch.exp(old_log_probs.detach() - rollout_log_probs.detach())
    if mode == "tis":
        return ratio.clamp(max=cap)
    if mode == "mis":
        return torch.where(ratio <= cap, ratio, 0.0)
    return torch.ones_like(ratio)


def lm_grpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    policy_loss: str = "ppo_clip",
    aggregation: str = "token",
    max_tokens: int | None = None,
    ref_log_probs: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    importance_weight: torch.Tensor | None = None,
    loss_scale: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate over response tokens (+ beta * KL to the reference - entropy_coef * entropy).

    Shapes: `log_probs`, `old_log_probs`, `mask` and the optional `ref_log_probs`, `entropy`,
    `importance_weight` are (B, T), padded, `mask` 1 on response tokens and 0 elsewhere;
    `advantages` is (B,), one per sequence, shared by all its tokens, or (B, T), one per token (GAE's). `old_log_probs`,
    `ref_log_probs` and `importance_weight` are constants (detached). Padding never reaches the
    loss or its gradient, whatever values it holds. The math runs in fp32 at least (bf16 is upcast).

    `policy_loss` (`POLICY_LOSSES`) names the ratio: ``ppo_clip`` per token, ``gspo`` per sequence (the
    geometric mean of its tokens' ratios, clipped as one; GSPO clips it far tighter, 3e-4 / 4e-4).

    Clip-higher (DAPO): the ratio is clipped to [1 - clip_low, 1 + clip_high] with
    clip_high > clip_low, so low-probability tokens with positive advantage can grow further before
    the clip stops them, which keeps entropy from collapsing.

    `aggregation` turns per-token terms into a scalar (the surrogate, the KL and the entropy alike):

    * ``token`` (DAPO, default): sum over all response tokens of the batch / their number, so every
      token weighs the same and long answers are not diluted.
    * ``sequence`` (original GRPO): mean over each sequence's tokens, then mean over the B
      sequences (a sequence with no response token contributes 0 but still counts).
    * ``drgrpo`` (Dr. GRPO): sum over tokens / (B * max_tokens), a constant normaliser (the
      generation budget): no 1/length weighting as in ``sequence``, which favours long wrong answers,
      and no dependence on how many tokens the batch happens to hold as in ``token``.

    `loss_scale` replaces that denominator when the batch is cut into micro-batches whose
    gradients are summed: pass the denominator of the WHOLE batch, and the micro-batch losses
    (and gradients) add up to the whole-batch ones:

    * ``token``: the number of response tokens in the whole batch (sum of every micro-batch's mask);
    * ``sequence``: the number of sequences in the whole batch;
    * ``drgrpo``: sequences in the whole batch * max_tokens.

    `kl_estimator` for the KL to the reference policy, per token: `kl_estimate` (k1, k2, k3).

    `importance_weight` multiplies each token's surrogate: the decoupled PPO correction (AReaL) for
    samples generated by older weights (`decoupled_old_log_prob`), the rollout engine's correction
    (`rollout_correction_weight`), or their product.

    Stats are plain per-token means over this call's response tokens, whatever the aggregation and
    `loss_scale`, so micro-batches combine by weighting with ``tokens``:
    ``clip_frac`` is the share of tokens the clip silences -- the clipped side is the active one:
    ratio > 1 + clip_high with advantage > 0, or ratio < 1 - clip_low with advantage < 0 (their
    surrogate gradient is zero); ``approx_kl`` is 0.5 * mean (log_probs - old_log_probs)^2;
    ``ratio_mean/min/max``; ``kl_ref`` (mean per-token KL estimate, 0 without `ref_log_probs`);
    ``entropy`` (0 without `entropy`); ``tokens`` (number of response tokens).
    """
    _check_tensors(
        log_probs,
        advantages,
        mask,
        old_log_probs=old_log_probs,
        ref_log_probs=ref_log_probs,
        entropy=entropy,
        importance_weight=importance_weight,
    )
    _check_settings(
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        policy_loss=policy_loss,
        aggregation=aggregation,
        max_tokens=max_tokens,
        has_ref=ref_log_probs is not None,
        beta=beta,
        kl_estimator=kl_estimator,
        has_entropy=entropy is not None,
        entropy_coef=entropy_coef,
        loss_scale=loss_scale,
    )
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    response = mask.bool()
    tokens = int(response.sum())

    def aggregate(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate_tokens(per_token, response, aggregation, max_tokens, loss_scale)

    # Padding is replaced by 0 before exp, so a garbage pad cannot turn into inf/nan in the gradient.
    log_ratio = POLICY_LOSSES[policy_loss](log_probs.to(dtype), old_log_probs.detach().to(dtype), response)
    ratio = torch.exp(log_ratio)
    token_advantages = advantages.detach().to(dtype)
    if token_advantages.ndim == 1:  # one per sequence, shared by its tokens
        token_advantages = token_advantages.unsqueeze(-1).expand_as(ratio)
    unclipped = -token_advantages * ratio
    clipped = -token_advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.maximum(unclipped, clipped)
    if importance_weight is not None:
        surrogate = surrogate * importance_weight.detach().to(dtype)
    loss = aggregate(surrogate)

    kl = None
    if ref_log_probs is not None:
        # Padding is 0 on both sides before the estimate, as before exp above.
        policy = torch.where(response, log_probs.to(dtype), 0.0)
        kl = kl_estimate(policy, torch.where(response, ref_log_probs.detach().to(dtype), 0.0), kl_estimator)
        if beta > 0:
            loss = loss + beta * aggregate(kl)
    if entropy is not None and entropy_coef != 0:
        loss = loss - entropy_coef * aggregate(entropy.to(dtype))

    with torch.no_grad():
        ratios = ratio[response]
        clipped_above = (token_advantages > 0) & (ratio > 1.0 + clip_high)
        clipped_below = (token_advantages < 0) & (ratio < 1.0 - clip_low)
        silenced = clipped_above | clipped_below
        stats = {
            "clip_frac": silenced[response].sum().item() / tokens,
            "approx_kl": 0.5 * ((log_probs - old_log_probs).to(dtype)[response] ** 2).mean().item(),
            "ratio_mean": ratios.mean().item(),
            "ratio_min": ratios.min().item(),
            "ratio_max": ratios.max().item(),
            "kl_ref": kl[response].mean().item() if kl is not None else 0.0,
            "entropy": entropy[response].float().mean().item() if entropy is not None else 0.0,
            "tokens": float(tokens),
        }
    return loss, stats


def aggregate_tokens(
    per_token: torch.Tensor, response: torch.Tensor, aggregation: str, max_tokens: int | None, loss_scale: float | None
) -> torch.Tensor:
    """Per-token terms (B, T) to the scalar `aggregation` makes of them over the `response` tokens (`lm_grpo_loss`
    says how), divided by `loss_scale` where given, else by the aggregation's own normaliser."""
    masked = torch.where(response, per_token, 0.0)
    if aggregation == "sequence":
        lengths = response.sum(dim=-1).clamp(min=1)
        total, default_scale = (masked.sum(dim=-1) / lengths).sum(), response.shape[0]
    elif aggregation == "token":
        total, default_scale = masked.sum(), int(response.sum())
    else:
        assert max_tokens is not None  # drgrpo is refused without it
        total, default_scale = masked.sum(), response.shape[0] * max_tokens
    return total / (loss_scale if loss_scale is not None else default_scale)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    cliprange_value: float,
    aggregation: str = "token",
    max_tokens: int | None = None,
    loss_scale: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss for the critic (verl's `compute_value_loss`, `critic.cliprange_value`; OpenRLHF's
    `ValueLoss`), all (B, T):

        V_clip = old_V + clip(V - old_V, -c, c),    loss = 0.5 * agg(max((V - R)^2, (V_clip - R)^2)),

    V the critic's values under grad, old_V the values it gave the rollout (the step's value pass, detached), R the
    GAE returns (detached), c = `cliprange_value`: a value can move at most c from the one the advantages were
    estimated with before its loss stops pulling it further. Aggregated over `mask` as the policy loss is
    (`aggregate_tokens`; verl's `agg_loss` with the critic's `loss_agg_mode`), so the critic's gradient shares the
    actor's normaliser at the commit. Stats: `vf_loss` (the loss), `vf_clipfrac` (share of tokens whose clipped
    error is the larger), `vpred_mean` (mean value), `tokens`."""
    if not values.shape == old_values.shape == returns.shape == mask.shape or values.ndim != 2:
        raise ValueError(
            f"values, old_values, returns and mask must be (B, T) alike, got {tuple(values.shape)}, "
            f"{tuple(old_values.shape)}, {tuple(returns.shape)}, {tuple(mask.shape)}"
        )
    if not cliprange_value > 0:
        raise ValueError(f"cliprange_value={cliprange_value} must be > 0")
    dtype = torch.promote_types(values.dtype, torch.float32)
    response = mask.bool()
    values, old, target = values.to(dtype), old_values.detach().to(dtype), returns.detach().to(dtype)
    clipped = old + (values - old).clamp(-cliprange_value, cliprange_value)
    unclipped_error = (values - target) ** 2
    clipped_error = (clipped - target) ** 2
    loss = 0.5 * aggregate_tokens(
        torch.maximum(unclipped_error, clipped_error), response, aggregation, max_tokens, loss_scale
    )
    with torch.no_grad():
        stats = {
            "vf_loss": loss.item(),
            "vf_clipfrac": (clipped_error > unclipped_error)[response].double().mean().item(),
            "vpred_mean": values[response].mean().item(),
            "tokens": float(response.sum()),
        }
    return loss, stats


def _check_tensors(
    log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, **per_token: torch.Tensor | None
) -> None:
    """Raise ValueError naming the tensor whose shape or content does not fit `lm_grpo_loss`."""
    if log_probs.ndim != 2:
        raise ValueError(f"log_probs must be (B, T), got shape {tuple(log_probs.shape)}")
    for name, tensor in {"mask": mask, **per_token}.items():
        if tensor is not None and tensor.shape != log_probs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, log_probs has {tuple(log_probs.shape)}")
    if advantages.shape not in (log_probs.shape[:1], log_probs.shape):
        raise ValueError(
            f"advantages must be (B,) = {tuple(log_probs.shape[:1])} or (B, T) = {tuple(log_probs.shape)}, got "
            f"{tuple(advantages.shape)}"
        )
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask must hold only 0 and 1")
    if not mask.any():
        raise ValueError("mask has no response token")


def _check_settings(
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    policy_loss: str,
    aggregation: str,
    max_tokens: int | None,
    has_ref: bool,
    beta: float,
    kl_estimator: str,
    has_entropy: bool,
    entropy_coef: float,
    loss_scale: float | None,
) -> None:
    """Raise ValueError naming the first setting of `lm_grpo_loss` that is out of range or inconsistent."""
    if policy_loss not in POLICY_LOSSES:
        raise ValueError(f"policy_loss={policy_loss!r} is not one of {tuple(POLICY_LOSSES)}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r} is not one of {AGGREGATIONS}")
    if aggregation == "drgrpo":
        if max_tokens is None or max_tokens < 1:
            raise ValueError(f"aggregation='drgrpo' needs max_tokens (the generation budget), got {max_tokens}")
        longest = int(mask.sum(dim=-1).max())
        if longest > max_tokens:
            raise ValueError(f"max_tokens={max_tokens} is shorter than a response of {longest} tokens")
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low={clip_low} must be in [0, 1)")
    if clip_high < 0:
        raise ValueError(f"clip_high={clip_high} must be >= 0")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={kl_estimator!r} is not one of {KL_ESTIMATORS}")
    if beta < 0:
        raise ValueError(f"beta={beta} must be >= 0")
    if beta > 0 and not has_ref:
        raise ValueError("beta > 0 needs ref_log_probs for the KL term")
    if entropy_coef != 0 and not has_entropy:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy, the per-token entropy (B, T)")
    if loss_scale is not None and not loss_scale > 0:
        raise ValueError(f"loss_scale={loss_scale} must be > 0")
