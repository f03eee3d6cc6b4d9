"""What the Ray runtime needs of a kind of pipeline, written down once: a driver-side adapter and worker-side engines.

`PipelineAdapter` (driver) maps a node of the sub-stage graph to typed work on the devices the policy chose and
books the results in the sample ledger; `PipelineEngines` (one per DeviceWorker) holds that pipeline's engines on
the device and does the work. Commit and publish are the same for every kind and live in the executor and the
worker; each kind's adapter and engines (`pipelines.flow.adapter`, `pipelines.flow.engines`; `pipelines.lm.adapter`,
`pipelines.lm.engines`) implement the rest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Generic, Protocol, TypeVar

import numpy as np
import ray
import torch

from dovetail.graph.flow import split
from dovetail.graph.node import Graph, Kind, Node, SampleId
from dovetail.models.memory import memory_by_kind, peak_bytes
from dovetail.models.training import (
    commit,
    flat_gradient,
    load_trainer_state,
    load_weights,
    make_optimizer,
    set_summed_gradient,
    trainable_parameters,
    trainer_state_of,
    weights_of,
)
from dovetail.runtime.messages import DeviceMemory, Work
from dovetail.sched.policy import Shape

UNSHARDED_KINDS = ("train", "optimizer")
"""The kinds of work a sharded run's start-up profile leaves out (`unsharded_works`)."""


SAMPLING_WEIGHTS_KEY = "sampling_weights"
"""A trainer state's entry for the weights the rollouts sample with where they are not the trained ones (DiffusionNFT's
old policy, as numpy by name): the run's first publication takes them, later ones `export_weights`."""


def unsharded_works(works: dict) -> dict:
    """A sharded run's start-up profile without the train and the optimizer step: on a replica they would hold the
    whole model's gradients and AdamW moments on one device, which a sharded run is there to avoid (a 7B model's are
    84 GB). The cost model prices the train from the log-prob passes' measured speed (`with_train_priced`) and the
    optimizer step analytically."""
    return {kind: work for kind, work in works.items() if kind not in UNSHARDED_KINDS}


def with_train_priced(measured: dict, predicted: dict[str, float], suffix: str = "") -> dict:
    """`measured` (a profile's seconds) with a train pass it left out (`unsharded_works`) priced as the analytic
    train time x the measured / analytic time of the log-prob pass over the same responses: a backward is priced as
    the forward runs on this device. `suffix`: the profile's size (an LM profile's `_step_pass`)."""
    if f"train{suffix}" in measured:
        return measured
    return measured | {f"train{suffix}": predicted["train"] * measured[f"logprob{suffix}"] / predicted["logprob"]}


PROFILE_ROUNDS = 3
"""Rounds of the start-up profile. One round's small-pass fit swung with this machine's noise (a fitted half point
of 0 made digen cut 8 fragments where 4 ran 1.4x faster)."""


@dataclass
class Part:
    """One actor call that carries out (part of) a node on one device; kept so it can be re-sent."""

    node: str
    device: int
    work: object
    index: int = 0
    """Position of the part's output among the node's outputs (results are read in this order)."""
    rerun: bool = False
    """A finished train part sent again to a restarted device, to rebuild its gradient."""


@dataclass
class Ledger:
    """Per sample and per weights version: what was generated, scored and trained, and where."""

    generated: dict[SampleId, list[tuple[int, int]]] = field(default_factory=dict)
    scored: dict[SampleId, int] = field(default_factory=dict)
    trained: dict[tuple[SampleId, int], int] = field(default_factory=dict)
    """(sample, unit) -> times its gradient entered a commit (unit: a timestep, or 0 for an LM response)."""
    migrated: list[tuple[int, int, int]] = field(default_factory=list)
    """(RL step, responses, destination device) of each tail migration."""
    restarts: list[tuple[float, int, str]] = field(default_factory=list)
    reruns: list[tuple[int, str]] = field(default_factory=list)
    """(device, train node) re-run on a restarted device to rebuild the gradients it held."""
    went_on: list[tuple[int, int, str]] = field(default_factory=list)
    """(RL step, devices, why) each time the run went on from its last committed step without a lost node's work."""

    def problems(self, expected: dict[SampleId, list[int]]) -> list[str]:
        """Every sample generated once and scored once, every (sample, unit) trained once."""
        found = []
        for sample, units in expected.items():
            if len(self.generated.get(sample, [])) != 1:
                found.append(f"sample {sample} generated {len(self.generated.get(sample, []))} times")
            if self.scored.get(sample, 0) != 1:
                found.append(f"sample {sample} scored {self.scored.get(sample, 0)} times")
            for unit in units:
                if self.trained.get((sample, unit), 0) != 1:
                    found.append(f"sample {sample} unit {unit} trained {self.trained.get((sample, unit), 0)} times")
        return found

    def before(self, step: int) -> Ledger:
        """What was booked of the RL steps before `step` (a run that goes on from `step` without a lost device does
        that step again), and every restart and migration."""
        return replace(
            self,
            generated={sample: uses for sample, uses in self.generated.items() if sample.step < step},
            scored={sample: times for sample, times in self.scored.items() if sample.step < step},
            trained={key: times for key, times in self.trained.items() if key[0].step < step},
        )

    def with_restarts(self, restarts: list[tuple[float, int, str]]) -> Ledger:
        return replace(self, restarts=self.restarts + list(restarts))

    def to_json(self) -> dict:
        """ledger.json: each row a record whose keys name its fields, so the file reads without this class."""
        return {
            "generated": [
                {"step": s.step, "prompt": s.prompt, "member": s.member, "device": d, "version": v}
                for s, uses in sorted(self.generated.items())
                for d, v in uses
            ],
            "trained": [
                {"step": s.step, "prompt": s.prompt, "member": s.member, "unit": k, "times": n}
                for (s, k), n in sorted(self.trained.items())
            ],
            "migrated": [{"step": s, "responses": n, "device": d} for s, n, d in self.migrated],
            "restarts": [{"time": t, "device": d, "during": what} for t, d, what in self.restarts],
            "reruns": [{"device": d, "node": node} for d, node in self.reruns],
            "went_on": [{"step": s, "devices": d, "why": why} for s, d, why in self.went_on],
        }


def memory_figures(memory: list[DeviceMemory | None]) -> dict:
    """`memory_bytes_per_device`: each device's bytes by kind (`DeviceMemory`'s fields; None where a device did
    not answer), and `memory_peak_bytes`: the largest peak among them, the device the run must fit."""
    answered = [m for m in memory if m is not None]
    return {
        "memory_bytes_per_device": [asdict(m) if m is not None else None for m in memory],
        "memory_peak_bytes": max((m.peak for m in answered), default=0),
    }


class RunContext(Protocol):
    """What an adapter may ask of the executor running its pipeline, and nothing more (the `RayExecutor` answers):
    the graph, which weights a step's rollouts use, the results of finished nodes, and the step's shape."""

    graph: Graph

    def rollout_version(self, pipeline: str, step: int) -> int:
        """The weights version the pipeline's graph step `step` opened on (its rollouts' version)."""

    def weights(self, pipeline: str, version: int) -> ray.ObjectRef:
        """The published weights of a version."""

    def outputs_of(self, node_ids: Sequence[str]) -> list:
        """The result refs of finished nodes, in the given order."""

    def sources(self, node: Node, kinds: Sequence[Kind]) -> dict[Kind, list]:
        """Result refs of the nodes of `kinds` of the node's step that it (transitively) reads."""

    def shape_of(self, pipeline: str) -> Shape:
        """The shape the pipeline's steps were cut with (`graph.lm.LMShape`, `graph.flow.FlowShape`)."""

    def off_device(self, pipeline: str, work: Work) -> ray.ObjectRef:
        """A ref of what the pipeline's off-device worker (`runtime.worker.EnvironmentWorker`: its environments'
        episodes) answers to `work`, asked now."""


class PipelineAdapter(ABC):
    """The driver side of one pipeline kind."""

    def __init__(self, config, first_step: int) -> None:
        self.config = config
        self.first_step = first_step

    def rl_step(self, node: Node) -> int:
        """The RL step of a node (the graph counts from 0 at the run's first step, e.g. after a resume)."""
        return self.first_step + node.step

    @abstractmethod
    def parts(self, node: Node, devices: tuple[int, ...], run: RunContext) -> list[Part]:
        """The actor calls that carry out `node` on `devices` (not commit / publish, which the executor does)."""

    def wait_work(self, node: Node, run: RunContext) -> Work:
        """What the pipeline's off-device worker does for an env node (`Kind.ENV`: its trajectories' environment
        steps and waits, on no device); only a kind whose steps wait on environments has such nodes."""
        raise NotImplementedError(f"node {node.id}: pipeline kind {self.config.kind} has no environment waits")

    @abstractmethod
    def book(self, node: Node, part: Part, result, ledger: Ledger) -> None:
        """Account a finished part's result in the ledger (generated, scored); training is booked at the commit."""

    @abstractmethod
    def units_of(self, sample: SampleId) -> list[int] | None:
        """What training a sample consists of (the ledger's units): its trained timesteps, or [0]; [] where it trains
        nowhere (a group dynamic sampling dropped), None where its step never drew it (a draw it did not need)."""

    def trained_scores(self, scores: list) -> list:
        """The scores of a committed step's samples that trained (its score nodes' answers, `scores`): all of them,
        unless the kind's steps score samples they do not train (dynamic sampling's dropped groups)."""
        return scores

    @abstractmethod
    def step_metrics(self, scores: list, trained: list) -> dict:
        """The pipeline's own figures of a committed step (rewards, loss statistics) from its score and train
        results; the driver adds throughput, efficiency and staleness."""

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates the commit takes on each step's batch (`runtime.messages.Commit.updates`): one."""
        return 1

    def further_metrics(self, further: list[list]) -> dict:
        """Figures of the updates after a step's first (per trainer device that answered, its
        `runtime.messages.FurtherUpdate`s in order); none where the kind takes one update a step."""
        return {}

    def fsdp_groups(self, run: RunContext, pipeline: str, devices: tuple[int, ...]) -> list[tuple[int, ...]]:
        """A sharded trainer's FSDP groups over `devices` (a trainer node's or a commit's), each in rank order: one
        over them all; a flow shape's HYBRID groups of a node (`FlowAdapter`)."""
        return [tuple(sorted(devices))]

    def commit_scale(self, trained: list) -> float:
        """What the commit multiplies the summed gradients by, given the step's train results: 1 when each part's
        loss was already divided by the step's normaliser, else 1 / the sum of their contributions."""
        return 1.0

    @staticmethod
    def spread(items: list, devices: tuple[int, ...]) -> list[tuple[int, list]]:
        """`items` dealt to `devices` in contiguous runs (sizes differ by at most one); an empty share is dropped."""
        runs = zip(devices, split(len(items), len(devices)))
        return [(device, [items[r] for r in rows]) for device, rows in runs if rows]


def shard_in_place(
    model: torch.nn.Module,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh,
    train,
    optimized,
    pending_optimizer: dict | None,
) -> torch.optim.Optimizer:
    """Shard `model` over `mesh` through `module` (the model itself, or the module inside whose state dict keeps the
    replica's names: `models.sharding.shard`, per transformer block, in `train`'s precision, activation
    checkpointing and offload, gradients summed) and return its optimizer made anew over the shards (`optimized`:
    the section its lr and schedule come from), holding this member's shards of the weights and AdamW moments as
    they stood (the moments `pending_optimizer` gives in their place: a resumed run's, never whole on the device).
    `models.sharding` is imported by a sharded run alone: its torch.distributed modules take 1.4 s to import."""
    from dovetail.models.sharding import load_local_state, local_of_full, shard

    whole = trainer_state_of(model, optimizer)
    if pending_optimizer is not None:
        whole["optimizer"] = pending_optimizer
    shard(
        module,
        mesh,
        precision=train.precision,
        activation_checkpointing=train.activation_checkpointing,
        sum_gradients=True,
        cpu_offload=train.cpu_offload,
    )
    sharded_optimizer = make_optimizer(model, optimized)
    load_local_state(module, sharded_optimizer, local_of_full(module, sharded_optimizer, whole))
    return sharded_optimizer


Rollout = TypeVar("Rollout")
"""A pipeline kind's rollout engine: a flow model's copy, a language model's `models.engine.Engine`."""


class PipelineEngines(ABC, Generic[Rollout]):
    """The worker side of one pipeline kind: its engines on one device. `trainer` / `optimizer` / `rollout` are None
    on a device that holds no policy engine (a reward device)."""

    def __init__(self, config, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.trainer: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.reference: torch.nn.Module | None = None
        self.rollout: Rollout | None = None
        self.rollout_version: int | None = None
        self.sharded_group: tuple[int, ...] | None = None
        """The devices of the FSDP group the trainer is sharded over (`shard_trainer`); None while it is a replica."""
        self.pending_optimizer: dict | None = None
        """A sharded run's optimizer state given at configure (a resumed run's AdamW moments, numpy on the host),
        loaded into this member's shards by `shard_trainer`: never whole on the device."""

    @abstractmethod
    def run(self, work: Work):
        """Do one piece of work and return its result message (a train's gradient is then `part_gradient()`)."""

    def part_gradient(self) -> torch.Tensor:
        """The flat gradient of the train work just run, in fp64, the precision the commit adds parts in
        (`worker.reduce_parts`); the trainer's own gradients are cleared. By default what backpropagation accumulated
        in the trainer."""
        trainer, _ = self.held_trainer()
        gradient = flat_gradient(trainer).double()
        trainer.zero_grad(set_to_none=True)
        return gradient

    def gradient_size(self) -> int:
        """The length of a part's flat gradient (`part_gradient`): by default the trainer's trainable parameters."""
        trainer, _ = self.held_trainer()
        return sum(p.numel() for p in trainable_parameters(trainer))

    def set_step_gradient(self, parts: list[torch.Tensor], scale: float) -> None:
        """The step's gradient, the flat `parts` added and times `scale`, into the trainer's parameters
        (`models.training.set_summed_gradient`); a kind whose parts carry more than the trainer's (a critic's)
        splits them here."""
        trainer, _ = self.held_trainer()
        set_summed_gradient(trainer, parts, scale)

    def step_optimizers(self, updates_per_step: int = 1) -> float:
        """The commit's optimizer step (`models.training.commit`, at the lr of the RL step: `updates_per_step` updates
        a step, algo.num_iterations); returns the trainer's pre-clip gradient norm."""
        trainer, optimizer = self.held_trainer()
        return commit(trainer, optimizer, self.config.train, updates_per_step)

    def held_trainer(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The trainer engine and its optimizer, on a device that holds them (trainer work goes only there)."""
        if self.trainer is None or self.optimizer is None:
            raise RuntimeError("this device holds no trainer engine (a reward device)")
        return self.trainer, self.optimizer

    def state_module(self) -> torch.nn.Module:
        """The trainer's module whose state dict is what `weights_of` gives (a user's model wrapped in `CausalLM`:
        the transformers model inside): the one FSDP shards, so that sharded states keep the replica's names."""
        trainer, _ = self.held_trainer()
        return trainer

    def shard_trainer(self, group: tuple[int, ...], mesh) -> None:
        """Split the trainer over `mesh` (the FSDP group of devices `group`: `models.sharding.shard`, per transformer
        block, in `train.precision`, gradients summed): its weights and AdamW moments as they stand (a replica's
        until now: the run's state given at configure, the profile's work put back) are cut into this member's
        shards, and the optimizer is made anew over them (`shard_in_place`). The rollout engine keeps its own copy of
        the weights."""
        trainer, optimizer = self.held_trainer()
        pending, self.pending_optimizer = self.pending_optimizer, None
        self.optimizer = shard_in_place(
            trainer, self.state_module(), optimizer, mesh, self.config.train, self.config.train, pending
        )
        self.sharded_group = group

    def trained_modules(self) -> list[torch.nn.Module]:
        """The models the commit steps, whose gradients a sharded trainer's members hold shards of: the trainer, and
        whatever a kind trains beside it (a PPO run's critic)."""
        trainer, _ = self.held_trainer()
        return [trainer]

    def trainer_state(self) -> dict:
        """The trainer's state as numpy: a replica's whole (`trainer_state_of`), a sharded member's own shards
        (`models.sharding.local_state`, joined by `merged_state`)."""
        trainer, optimizer = self.held_trainer()
        if self.sharded_group is None:
            return trainer_state_of(trainer, optimizer)
        from dovetail.models.sharding import local_state  # a sharded run's (`shard_trainer` says why here)

        return local_state(self.state_module(), optimizer)

    def export_weights(self, keep: bool = True) -> dict:
        """The trained weights as numpy, for a publication: a replica's own. On a sharded trainer every member calls
        this at once (each tensor is gathered from all of them, one at a time); one member `keep`s them, the others
        drop each as it comes and answer nothing."""
        trainer, _ = self.held_trainer()
        if self.sharded_group is None:
            return weights_of(trainer)
        from dovetail.models.sharding import full_weights  # a sharded run's (`shard_trainer` says why here)

        gathered = {}
        for name, tensor in full_weights(self.state_module()):
            if keep:
                gathered[name] = tensor.numpy().copy()
        return gathered

    def held_rollout(self) -> Rollout:
        """The rollout engine, on a device that holds one (rollout work goes only there)."""
        if self.rollout is None:
            raise RuntimeError("this device holds no rollout engine (a reward device)")
        return self.rollout

    def hold(self, role: str) -> None:
        """The device switched to `role` (a policy's `SwitchRole`: `rollout`, `trainer` or `any`); by default every
        engine stays resident and awake (the models are small here)."""
        return None

    def train_again(self, work: Work):
        """A train part of the open step run again, for an update after the commit's first (`Commit.updates`): its
        gradient on the weights now, the old log-probs the first update's. A kind whose adapter asks one update a
        step (`PipelineAdapter.updates_per_step`) is never asked."""
        raise NotImplementedError(f"{type(self).__name__} takes one update a step")

    def after_commit(self) -> None:
        """The trainer's optimizer step just ran (a commit): what a kind keeps beside the weights follows them (a
        flow run's eval.ema). By default nothing."""
        return None

    @abstractmethod
    def load_rollout(self, weights: dict[str, np.ndarray]) -> None:
        """Put published weights into the rollout engine."""

    @abstractmethod
    def profile(self, samples: int, carry: Callable[[dict], dict]) -> dict[str, float]:
        """Measured seconds of each kind of work here, for the cost model the policy plans with."""

    @abstractmethod
    def time_kind(
        self, kind: str, samples: int, repeats: int, carry: Callable[[dict], dict]
    ) -> list[tuple[float, float]]:
        """(start, end) of each of `repeats` runs of one kind of the profile's work here
        (`runtime.interference.time_work`: what the interference table is measured with), the trainer left as it was."""

    @abstractmethod
    def rollout_bytes(self) -> int:
        """Bytes the rollout engine holds of its own (its copy of the weights, its KV cache), where it holds one."""

    def memory(self, gradient_parts: Iterable[torch.Tensor] = ()) -> DeviceMemory:
        """This device's bytes by kind now, counted from the tensors held (`DeviceMemory`); `gradient_parts`: the
        flat gradients the worker keeps for the commit beside the trainer's own."""
        held = memory_by_kind(self.trainer, self.optimizer) if self.trainer is not None else {}
        return DeviceMemory(
            parameters=held.get("parameters", 0),
            gradients=held.get("gradients", 0) + sum(t.numel() * t.element_size() for t in gradient_parts),
            optimizer=held.get("optimizer", 0),
            rollout=self.rollout_bytes() if self.rollout is not None else 0,
            peak=peak_bytes(self.device),
        )

    def held(self) -> list[str]:
        engines = {"trainer": self.trainer, "rollout": self.rollout, "reference": self.reference}
        return [name for name, engine in engines.items() if engine is not None] + ["reward"]

    def load_rollout_weights(self, version: int, weights) -> None:
        """Switch the rollout engine to `version` (between trajectories, never inside one)."""
        if self.rollout_version != version:
            self.load_rollout(weights if isinstance(weights, dict) else ray.get(weights))
            self.rollout_version = version

    @property
    def shards(self) -> bool:
        """Whether the run shards its trainer (`train.sharding: fsdp`): it stays a replica until `shard_trainer`,
        whose work alone ever holds gradients or AdamW moments (the start-up profile neither trains nor steps it)."""
        return self.config.train.sharding == "fsdp"

    def load_trainer_state(self, state: dict) -> None:
        """Take over another replica's committed state (after a restart, or to join the trainer pool). A sharded
        run's replica takes the weights and keeps the optimizer state for its shards (`pending_optimizer`)."""
        trainer, optimizer = self.held_trainer()
        if self.shards:
            assert self.sharded_group is None, "a sharded trainer takes its state as it is sharded"
            load_weights(trainer, state["weights"])
            self.pending_optimizer = state["optimizer"]
            return
        load_trainer_state(trainer, optimizer, state)
        optimizer.zero_grad(set_to_none=True)

    @staticmethod
    def fetch(refs: list) -> list:
        """Results of earlier nodes: a message's refs are not resolved by Ray, the worker gets them; a result
        that is no ref is itself (the LM reference loop runs the workers' work in-process)."""
        return [ray.get(r) if isinstance(r, ray.ObjectRef) else r for r in refs]
