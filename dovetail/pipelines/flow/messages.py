"""What a flow pipeline's driver asks its device workers (`runtime.messages.Work`) and what they answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dovetail.graph.node import SampleId
from dovetail.runtime.messages import TrainerWork, Work


@dataclass(frozen=True)
class Generate(Work):
    samples: list[SampleId]
    prompts: list[str]
    version: int
    weights: Any


@dataclass(frozen=True)
class Trajectories:
    """SDE rollouts as numpy arrays (Ray moves numpy views ~10x faster than pickled tensors)."""

    samples: list[SampleId]
    version: int
    prompts: list[str]
    prompt_ids: np.ndarray
    latents: np.ndarray
    log_probs: np.ndarray


@dataclass(frozen=True)
class FlowLogProbs(TrainerWork):
    """Recompute the log-probs of the taken steps under the trainer's weights (the colocated baselines)."""

    units: list[int]
    """Positions in each sample's trained timesteps (`recipe.sample_timesteps`)."""
    trajectories: list[Any]
    samples: list[SampleId] | None = None
    """The samples of `trajectories` whose log-probs a member of a sharded trainer's group recomputes (each member
    reads the node's every trajectory); None: all of them."""


@dataclass(frozen=True)
class FlowTrain(TrainerWork):
    """The GRPO gradient of `samples` over their trained timesteps at positions `units` (of each sample's own
    `recipe.sample_timesteps`); `stale` samples (TCSS) get the decoupled correction. The inputs hold whole groups,
    over which the advantages are computed."""

    samples: list[SampleId]
    units: list[int]
    total_pairs: int
    stale: bool
    trajectories: list[Any]
    scores: list[Any]
    old_log_probs: list[Any] = field(default_factory=list)
