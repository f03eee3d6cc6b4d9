"""DiffusionNFT's old policy (algorithm diffusion_nft): a whole copy of the flow model that samples the rollouts and
gives v_old to the loss, moved towards the trained weights after each optimizer step (`algo.soft_update` with
`algo.old_policy_decay`), as upstream's "old" adapter is. It is kept where the weights step, as eval.ema's average
is (`pipelines.flow.ema`): by the reference loop, and under a Ray policy by every trainer replica; it travels in the
trainer state (SAMPLING_WEIGHTS_KEY), which is also what the Ray runtime publishes to the rollout engines.
"""

from __future__ import annotations

import copy

import torch

from dovetail.algo import old_policy_decay, soft_update
from dovetail.models.training import load_weights, optimizer_steps, weights_of
from dovetail.pipelines.flow.ema import trained_parameters
from dovetail.runtime.pipeline import SAMPLING_WEIGHTS_KEY


def old_policy(config, model) -> torch.nn.Module | None:
    """The run's old policy, starting as a frozen copy of `model` (upstream copies the weights into it before the
    first epoch), or None where the algorithm keeps none."""
    if config.algorithm != "diffusion_nft":
        return None
    return copy.deepcopy(model).requires_grad_(False)


def update_old_policy(config, old: torch.nn.Module | None, model, optimizer: torch.optim.Optimizer) -> None:
    """After a step's optimizer step n (AdamW's count: upstream's global_step after its increment):
    old <- d_n old + (1 - d_n) theta_n for the trained parameters (a LoRA run's adapter alone, as upstream's old
    adapter; the frozen rest is the same in both), d_n = `algo.old_policy_decay`."""
    if old is None:
        return
    nft = config.algo.nft
    decay = old_policy_decay(
        optimizer_steps(optimizer), flat=nft.decay_flat, rate=nft.decay_rate, ceiling=nft.decay_max
    )
    trained = trained_parameters(model)
    soft_update({name: p for name, p in old.named_parameters() if name in trained}, trained, decay)


def with_old_policy(state: dict, old: torch.nn.Module | None) -> dict:
    """A trainer state with the old policy's weights beside the trained ones (as numpy, `weights_of`)."""
    return state if old is None else state | {SAMPLING_WEIGHTS_KEY: weights_of(old)}


def load_old_policy(old: torch.nn.Module | None, weights: dict | None, model) -> None:
    """Set the old policy to `weights`, or where a state or checkpoint has none (a new run's, or a run of another
    algorithm) to `model`'s weights, where a new old policy starts."""
    if old is None:
        return
    load_weights(old, weights if weights is not None else weights_of(model))
