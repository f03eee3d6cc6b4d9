"""The typed messages that cross the actor boundary: what the driver asks a DeviceWorker to do, and what it answers.

A `Work` names its pipeline, so a worker can hold the engines of several; its fields are plain Python, numpy, or
Ray object refs of earlier results (the worker fetches those: a nested ref is not resolved by Ray). Results are
what the object store keeps for the nodes that read them, and what the driver books in the sample ledger.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dovetail.graph.node import SampleId


@dataclass(frozen=True)
class Work:
    pipeline: str


# ---------------------------------------------------------------- any pipeline


@dataclass(frozen=True)
class LoadWeights(Work):
    """Switch the rollout engine to weights `version` (between trajectories, never inside one)."""

    version: int
    weights: Any
    """A ref of the exported weights (name -> numpy array)."""
    staged: bool = False
    """The weights come by broadcast (`exec.publication`): take them from the staging, else from `weights`."""


@dataclass(frozen=True)
class Loaded:
    """A `LoadWeights`' answer: its seconds, and the path its weights came by (`object_store`, or `collective` when
    a broadcast staged them)."""

    seconds: float
    path: str


@dataclass(frozen=True)
class Commit(Work):
    """Sum the step's train parts' gradients over the trainer devices `ranks` (the same bits wherever each part ran:
    in the order of the parts' keys, or in any order where that gives the same bits), scale the sum by `scale`
    (1 / the loss normaliser when the train parts summed their losses) and take one optimizer step."""

    ranks: tuple[int, ...]
    scale: float = 1.0


@dataclass(frozen=True)
class Committed:
    """A `Commit`'s answer: the pre-clip gradient norm (the same on every replica) and where the replica's commit
    went: adding the trainer devices' gradients together (the all-reduce, with the wait for the slowest),
    then the clip and the optimizer step."""

    grad_norm: float
    sync_s: float
    optimizer_s: float


@dataclass(frozen=True)
class Trained:
    """A train part's answer: which (sample, unit) pairs entered the gradient, its loss statistics (sums), and
    how much it adds to the step's loss normaliser (tokens or sequences; 0 when the loss was already normalised)."""

    samples: list[SampleId]
    units: list[int]
    """Flow: positions in every sample's trained timesteps; LM: one unit (the response)."""
    stats: dict[str, float]
    normaliser: float = 0.0


# ---------------------------------------------------------------- flow pipelines


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
class Score(Work):
    """Score the samples of the given rollout results (flow `Trajectories`, LM `Responses`): `samples`, or all."""

    rollouts: list[Any]
    samples: list[SampleId] | None = None


@dataclass(frozen=True)
class Scores:
    samples: list[SampleId]
    scores: dict[str, np.ndarray]
    """Each reward's values and their weighted sum under "total"."""
    response_tokens: np.ndarray | None = None
    """A language model's: each sample's response length, what its training costs (the driver balances the trainer
    devices' shares by it, `lm_adapter.balanced`); None for a flow pipeline, whose samples cost alike."""


@dataclass(frozen=True)
class FlowLogProbs(Work):
    """Recompute the log-probs of the taken steps under the trainer's weights (the colocated baselines)."""

    units: list[int]
    """Positions in each sample's trained timesteps (`recipe.sample_timesteps`)."""
    trajectories: list[Any]


@dataclass(frozen=True)
class LogProbs:
    samples: list[SampleId]
    log_probs: list[np.ndarray]
    """Per sample: per timestep (flow) or per response token (LM)."""


@dataclass(frozen=True)
class FlowTrain(Work):
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


# ---------------------------------------------------------------- language-model pipelines


@dataclass(frozen=True)
class Prefill(Work):
    """Start the responses of `samples` (their prompts' token ids in `prompts`) on weights `version`."""

    samples: list[SampleId]
    prompts: list[list[int]]
    version: int
    weights: Any


@dataclass(frozen=True)
class Decode(Work):
    """Continue every unfinished response of `rollouts` until it finishes or has `until` tokens. An engine
    that paused them continues from its cache; any other (a migration, a restarted device) re-prefills."""

    rollouts: list[Any]
    until: int
    weights: Any
    """The ref of the rollouts' weights version: an engine that holds another version reloads it (and re-prefills)."""
    running_only: bool = False
    """Answer the unfinished responses alone: a migration moves the tail and leaves the finished ones where they are."""


@dataclass(frozen=True)
class Responses:
    """Responses of one shard so far: finished and paused ones (an engine's exported requests)."""

    version: int
    samples: list[SampleId]
    prompts: list[list[int]]
    tokens: list[list[int]]
    log_probs: list[list[float]]
    finished: list[bool]


@dataclass(frozen=True)
class LMLogProbs(Work):
    """Per-token log-probs of the responses of `samples` under the trainer (`reference`: the base model)."""

    samples: list[SampleId]
    rollouts: list[Any]
    reference: bool


@dataclass(frozen=True)
class LMTrain(Work):
    """The summed GRPO loss gradient of the responses of `samples` (whole groups); `stale` ones (generated by
    older weights) get the decoupled correction. The driver divides by the step's normaliser at the commit."""

    samples: list[SampleId]
    stale: bool
    rollouts: list[Any]
    scores: list[Any]
    old_log_probs: list[Any] = field(default_factory=list)
    ref_log_probs: list[Any] = field(default_factory=list)
