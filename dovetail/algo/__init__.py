"""Pure math: the SDE step with its log-prob, advantages, the policy loss, timestep choice, a weights' EMA,
DiffusionNFT's forward-process loss."""

from dovetail.algo.advantages import ADVANTAGE_ESTIMATORS, advantages, gae_advantages_returns
from dovetail.algo.ema import WeightEMA
from dovetail.algo.grpo import (
    decoupled_old_log_prob,
    flow_grpo_loss,
    group_advantages,
    select_train_timesteps,
    sliding_window,
    train_timestep_count,
)
from dovetail.algo.lm_grpo import POLICY_LOSSES, clipped_value_loss, lm_grpo_loss, rollout_correction_weight
from dovetail.algo.nft import (
    diffusion_nft_loss,
    forward_timesteps,
    noised,
    old_policy_decay,
    optimality_probability,
    soft_update,
)
from dovetail.algo.sde import SDEStep, gaussian_log_prob, sde_step

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSSES",
    "advantages",
    "clipped_value_loss",
    "gae_advantages_returns",
    "SDEStep",
    "WeightEMA",
    "decoupled_old_log_prob",
    "diffusion_nft_loss",
    "forward_timesteps",
    "noised",
    "old_policy_decay",
    "optimality_probability",
    "soft_update",
    "flow_grpo_loss",
    "gaussian_log_prob",
    "group_advantages",
    "lm_grpo_loss",
    "rollout_correction_weight",
    "sde_step",
    "select_train_timesteps",
    "sliding_window",
    "train_timestep_count",
]
