"""eval.ema's average of a flow trainer's weights (`algo.WeightEMA`), kept where the weights step: by the reference
loop in this process (`local.FlowLocal`), and under a Ray policy by every trainer replica beside its weights
(`engines.FlowEngines`), updated after each commit. It travels in the trainer state (`with_ema`, key EMA_KEY) as the
weights do, so a restarted replica, a run that goes on without a lost device, the driver's evaluation and checkpoint,
and a resumed run all read the average the trainers hold. A sharded trainer's members each keep the average of their
own shards (`FlowEngines.shard_trainer`), joined in the committed state as the weights' shards are.
"""

from __future__ import annotations

import torch

from dovetail.algo import WeightEMA
from dovetail.models.training import optimizer_steps, tensors_of

EMA_KEY = "ema"
"""The trainer state's entry for the EMA: the trained parameters' averages by name, as numpy."""


def trained_parameters(model) -> dict[str, torch.Tensor]:
    """The parameters that train (a LoRA run's adapter alone), by name: what eval.ema averages."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def weight_ema(config, model) -> WeightEMA | None:
    """The run's EMA of `model`'s trained weights (starting at them), or None where the config keeps none."""
    ema = config.eval.ema
    return None if ema is None else WeightEMA(trained_parameters(model), ema.decay, ema.every)


def update_ema(ema: WeightEMA | None, model, optimizer: torch.optim.Optimizer) -> None:
    """After a commit: average the weights it left in, as optimizer step n, the count AdamW keeps (1 after the
    run's first; a resumed or restarted trainer's optimizer state carries it on)."""
    if ema is not None:
        ema.update(trained_parameters(model), optimizer_steps(optimizer))


def with_ema(state: dict, ema: WeightEMA | None) -> dict:
    """A trainer state (`models.training.trainer_state_of`) with the EMA's averages beside the weights."""
    if ema is None:
        return state
    return state | {EMA_KEY: {name: t.detach().cpu().numpy().copy() for name, t in ema.shadow.items()}}


def load_ema(ema: WeightEMA | None, averages: dict | None, model) -> None:
    """Set the EMA to `averages` (numpy or tensors by name), or where there are none (a state or checkpoint of a
    run without an EMA) to `model`'s trained weights, which is where a new EMA starts."""
    if ema is None:
        return
    source = trained_parameters(model) if averages is None else tensors_of(averages)
    ema.shadow = {name: source[name].detach().to(t.device, copy=True) for name, t in ema.shadow.items()}
