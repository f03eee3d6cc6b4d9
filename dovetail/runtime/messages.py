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


@dataclass(frozen=True)
class TrainerWork(Work):
    """Work the trainer engine does (log-probs, a train part). On a sharded trainer the devices of its FSDP group
    (`group`) do a node's work together, each member its own part of it: every forward gathers each block's
    parameters from every member, so each makes the same number of passes (`passes`; a member with fewer groups of
    samples pads with passes that add nothing)."""

    group: tuple[int, ...] = field(default=(), kw_only=True)
    """The sharded trainer's FSDP group (its devices, in rank order); () for a replicated trainer."""
    passes: int = field(default=0, kw_only=True)
    """The passes every member of `group` makes: the most of any member's part."""


# ---------------------------------------------------------------- any pipeline


@dataclass(frozen=True)
class LoadWeights(Work):
    """Switch the rollout engine to weights `version` (between trajectories, never inside one)."""

    version: int
    weights: Any
    """A ref of the exported weights (name -> numpy array)."""
    staged: bool = False
    """The weights come by broadcast (`runtime.publication`): take them from the staging, else from `weights`."""


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
    updates: int = 1
    """Optimizer updates on the step's batch (an LM run's algo.num_iterations): after the first, each device trains
    its parts of the step again on the weights the update before left (`PipelineEngines.train_again`), and the
    devices add and step as for the first."""
    group: tuple[int, ...] = field(default=(), kw_only=True)
    """A sharded trainer's: this device's FSDP group (`PipelineAdapter.fsdp_groups`), which a member that has trained
    nothing yet in the run (a replica group the policy gave no train node of the first step) joins at this commit, so
    that every member commits as a shard; () for a replicated trainer."""


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes a device's process holds, by kind, counted from its tensors (`models.memory.memory_by_kind`):
    the trainer's parameters, its gradients (the train parts' fp64 gradients kept for the commit and the summed
    gradient the optimizer steps with), the optimizer's state (AdamW's moments), the rollout engine's own weights and
    KV cache; and the process's peak (`models.memory.peak_bytes`: resident set on CPU, allocated on a GPU)."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    rollout: int = 0
    peak: int = 0


@dataclass(frozen=True)
class Committed:
    """A `Commit`'s answer: the pre-clip gradient norm (the same on every replica), the lr it stepped at, where the
    replica's commit went: adding the trainer devices' gradients together (the all-reduce, with the wait for the
    slowest), then the clip and the optimizer step; and the device's memory at the commit, where every kind is held
    at once (the step's metrics carry it, with no call of their own)."""

    grad_norm: float
    lr: float
    sync_s: float
    optimizer_s: float
    memory: DeviceMemory = DeviceMemory()
    group: tuple[int, ...] = ()
    """A sharded trainer's member: the devices of its FSDP group (one replica of the trainer); () a replica."""
    further: tuple[FurtherUpdate, ...] = ()
    """The updates after the first (`Commit.updates`), in order."""


@dataclass(frozen=True)
class FurtherUpdate:
    """An update after a commit's first (algo.num_iterations): its pre-clip gradient norm and the answers of this
    device's train parts run again for it (their loss statistics: the ratio now moves away from 1)."""

    grad_norm: float
    trained: list[Trained]


@dataclass(frozen=True)
class Trained:
    """A train part's answer: which (sample, unit) pairs entered the gradient, its loss statistics (sums), and
    how much it adds to the step's loss normaliser (tokens or sequences; 0 when the loss was already normalised)."""

    samples: list[SampleId]
    units: list[int]
    """Flow: positions in every sample's trained timesteps; LM: one unit (the response)."""
    stats: dict[str, float]
    normaliser: float = 0.0


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
    figures: dict[str, np.ndarray] = field(default_factory=dict)
    """Per sample, what the step's metrics report of it besides its rewards (an LM env run's episode figures,
    `pipelines.lm.multiturn.episode_figures`); empty where there are none."""


@dataclass(frozen=True)
class LogProbs:
    samples: list[SampleId]
    log_probs: list[np.ndarray]
    """Per sample: per timestep (flow) or per response token (LM)."""
