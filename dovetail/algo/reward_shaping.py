"""What is added to a response's reward before its advantage is estimated: DAPO's overlong penalty and verl's KL
penalty in the reward."""

import torch

from dovetail.algo.lm_grpo import kl_estimate


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13; verl's DAPO reward manager), per
    response of `lengths` tokens: 0 up to max_new_tokens - buffer, then falling linearly to -factor at
    max_new_tokens, -factor beyond: min(0, -(L - (max_new_tokens - buffer)) / buffer * factor). A response cut at the
    budget is thus told apart from one that ended just before it. buffer = 0: off (all 0)."""
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float64)
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"overlong_buffer={buffer} must be in [0, max_new_tokens={max_new_tokens}]")
    exceeding = lengths.double() - (max_new_tokens - buffer)
    return (-exceeding / buffer * factor).clamp(min=-factor, max=0.0)


def sequence_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, estimator: str) -> float:
    """sum_t kl_estimate(log pi_old(y_t), log pi_ref(y_t)) over a response's tokens (1-d, `mask` the sampled ones):
    what verl's use_kl_in_reward charges a response (`apply_kl_penalty` puts beta * the per-token estimate on each
    token, and an outcome estimator reads the tokens' sum), estimated at the log-probs of the policy that sampled it,
    not under grad."""
    mask = mask.bool()
    return float(kl_estimate(log_probs[mask].double(), ref_log_probs[mask].double(), estimator).sum())
