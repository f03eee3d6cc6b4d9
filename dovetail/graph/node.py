"""The sub-stage graph: one `Node` is one piece of work of one pipeline step; a `Graph` is their DAG.

Builders (`graph.flow`, `graph.lm`) expand a pipeline step into nodes; policies decide where and when
each node runs; executors (simulated or real) run them. Nothing here knows about devices or time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple


def sample_key(*parts: int | str) -> int:
    """A stable 63-bit seed from its parts (Python's hash() is salted per process): every random draw of a sample
    (its noise, its environment's waits) is keyed by its `SampleId` and what it draws, never by a process's RNG."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class SampleId(NamedTuple):
    """The `member`-th sample of the group of prompt `prompt` in RL step `step`: the one key of per-sample
    randomness and of the sample ledger, for every kind of pipeline. A tuple, so it crosses Ray as one (its third
    field is not called `index`, which would shadow `tuple.index`)."""

    step: int
    prompt: int
    member: int


class Role(StrEnum):
    """The engine a device holds; a node may only run on a device holding its role."""

    ROLLOUT = "rollout"
    TRAINER = "trainer"
    REWARD = "reward"
    ANY = "any"


class Kind(StrEnum):
    """What a node does. Flow pipelines use generate/score/logprob/train/commit/publish; LM pipelines
    add prefill/decode/migrate, and a multi-turn one env: its trajectories' wait on their environment between two
    model turns, which holds no device (`Node.wait_s`)."""

    GENERATE = "generate"
    PREFILL = "prefill"
    DECODE = "decode"
    MIGRATE = "migrate"
    SCORE = "score"
    LOGPROB = "logprob"
    TRAIN = "train"
    COMMIT = "commit"
    PUBLISH = "publish"
    ENV = "env"


@dataclass(frozen=True)
class Engines:
    """One pipeline's engines on one device, from the cost model: memory held while a device holds a
    role, and the seconds to bring a role's engine up (wake) or put it away (sleep)."""

    resident_gb: Mapping[Role, float]
    wake_s: Mapping[Role, float]
    sleep_s: Mapping[Role, float]


@dataclass(frozen=True, slots=True)
class Node:
    """One piece of work. `cost_s` is device-seconds on one device of the scenario's type (a node spread
    over k devices takes cost_s / k), except for a `collective` node (optimizer step, weight sync) which
    occupies all its devices for cost_s; `fixed_s` is paid besides by each device the node runs on.
    `memory_gb` is working memory on each device it runs on, on top of the engine resident there. `version`
    is the weights version the node's step is trained from: step s trains version s into s + 1."""

    id: str
    pipeline: str
    step: int
    kind: Kind
    role: Role
    deps: tuple[str, ...] = ()
    version: int = 0
    samples: tuple[SampleId, ...] = ()
    timesteps: tuple[int, int] | None = None
    """A flow train node's TSP chunk: positions [start, stop) in each of its samples' lists of trained timesteps
    (positions, not timesteps: each sample looks its own timesteps up, `recipe.sample_timesteps`)."""
    band: tuple[int, int] | None = None
    """An LM decode node's length band: it generates response tokens [low, high) of its samples still running at
    `low` (the migrated tail's band starts at the migration edge)."""
    micro_batch: int | None = None
    """The micro-batch (whole prompt groups) an LM log-prob or train node works on, in the step's micro-batch order."""
    cost_s: float = 0.0
    fixed_s: float = 0.0
    """Seconds each device the node runs on pays whatever its part of `cost_s` (a pass's fixed cost,
    `CostModel.fixed`): spreading a node thinner does not shorten it."""
    memory_gb: float = 0.0
    exclusive: bool = True
    """False: may share a device with other shareable nodes (each gets the `share` its Run decision gives)."""
    collective: bool = False
    tokens: int = 0
    """Tokens this node produces (LM decode) or processes (flow generate), for tokens/s."""
    shard: int | None = None
    """Rollout engine (shard of whole prompt groups) an LM prefill / decode node belongs to; None elsewhere and
    for the migrated tail, which decodes wherever the policy puts it."""
    reference: bool = False
    """A logprob node of the frozen reference model (the KL term), not of the weights being trained."""
    critic: bool = False
    """PPO's critic: a logprob node that is its value pass, a train node that trains it (beside the actor's)."""
    max_width: int | None = None
    """Devices past which the node goes no faster (None: it spreads over any number): an LM prefill / decode node
    runs on one engine of `tensor_parallel` devices, so more devices cannot shorten one response's decode."""
    wait_s: float = 0.0
    """Seconds the node's trajectories wait on their environment (a sandbox, an API). An env node's whole time, on no
    device: it starts as soon as its dependencies finish, without a policy's decision (`plan.state`), and a device it
    leaves idle is another node's to fill. A decode node that rolls trajectories out whole (the Ray runtime's,
    `TurnsSpec.waits_hold_device`) holds its device through its waits, idle: part of its time."""

    @property
    def holds_device(self) -> bool:
        """Whether a policy places the node on devices: every node but an environment's wait."""
        return self.kind is not Kind.ENV

    @property
    def phase(self) -> str:
        """What a trace names the node's work by (its spans' kind, the phases' seconds, a Gantt's colour): its kind,
        or for PPO's critic `values` (its value pass) and `train_critic` (its train), as the reference loop times
        them."""
        if self.critic:
            return "values" if self.kind is Kind.LOGPROB else "train_critic"
        return self.kind.value

    def seconds_on(self, devices: int) -> float:
        """Predicted seconds on `devices` devices: a collective occupies them all for cost_s; other work spreads
        over at most `max_width` of them; each pays `fixed_s` and its waits (`wait_s`) besides. An env node takes
        its wait, on no device."""
        if not self.holds_device:
            return self.wait_s
        if self.collective:
            return self.fixed_s + self.wait_s + self.cost_s
        return self.fixed_s + self.wait_s + self.cost_s / min(devices, self.max_width or devices)

    def __post_init__(self) -> None:
        if min(self.cost_s, self.fixed_s, self.memory_gb, self.wait_s) < 0:
            raise ValueError(
                f"node {self.id}: cost_s, fixed_s, memory_gb and wait_s must be >= 0, got {self.cost_s}, "
                f"{self.fixed_s}, {self.memory_gb}, {self.wait_s}"
            )
        if self.wait_s and self.kind not in (Kind.ENV, Kind.DECODE):
            raise ValueError(f"node {self.id}: only an env or a decode node waits on an environment (wait_s)")
        if self.max_width is not None and self.max_width < 1:
            raise ValueError(f"node {self.id}: max_width must be >= 1, got {self.max_width}")
        for name, span in (("timestep chunk", self.timesteps), ("length band", self.band)):
            if span is not None and not span[0] < span[1]:
                raise ValueError(f"node {self.id}: {name} must be [start, stop) with start < stop, got {span}")


class Graph:
    """Nodes by id with their dependants; checks that every dependency exists and that there is no cycle."""

    def __init__(self, nodes: Iterable[Node]) -> None:
        self.nodes: dict[str, Node] = {}
        self.dependants: dict[str, list[str]] = {}
        for node in nodes:
            if node.id in self.nodes:
                raise ValueError(f"duplicate node id {node.id!r}")
            self.nodes[node.id] = node
            self.dependants[node.id] = []
        for node in self.nodes.values():
            for dep in node.deps:
                if dep not in self.nodes:
                    raise ValueError(f"node {node.id!r} depends on unknown node {dep!r}")
                self.dependants[dep].append(node.id)
        self.order: list[str] = self._topological_order()
        self._by_step: dict[tuple[str, int], list[Node]] = {}
        self._by_kind: dict[tuple[str, int, Kind], list[Node]] = {}
        for node_id in self.order:
            node = self.nodes[node_id]
            self._by_step.setdefault((node.pipeline, node.step), []).append(node)
            self._by_kind.setdefault((node.pipeline, node.step, node.kind), []).append(node)
        self._pipelines = sorted({pipeline for pipeline, _ in self._by_step})
        self._steps = {
            name: sorted(step for pipeline, step in self._by_step if pipeline == name) for name in self._pipelines
        }
        """What `of`, `pipelines` and `steps` answer, kept: policies ask them at every decision, and a graph's nodes
        never change once it is built."""

    def _topological_order(self) -> list[str]:
        missing = {node_id: len(node.deps) for node_id, node in self.nodes.items()}
        order = [node_id for node_id, count in missing.items() if count == 0]
        for node_id in order:
            for child in self.dependants[node_id]:
                missing[child] -= 1
                if missing[child] == 0:
                    order.append(child)
        if len(order) != len(self.nodes):
            stuck = sorted(node_id for node_id, count in missing.items() if count > 0)
            raise ValueError(f"dependency cycle among {stuck[:5]}")
        return order

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, node_id: str) -> Node:
        return self.nodes[node_id]

    def __iter__(self):
        return iter(self.nodes.values())

    def ready(self, finished: Set[str], started: Set[str] = frozenset()) -> list[Node]:
        """Nodes whose dependencies are all finished and that have not started, in topological order."""
        return [
            self.nodes[node_id]
            for node_id in self.order
            if node_id not in finished
            and node_id not in started
            and all(d in finished for d in self.nodes[node_id].deps)
        ]

    def pipelines(self) -> list[str]:
        return list(self._pipelines)

    def steps(self, pipeline: str) -> list[int]:
        return list(self._steps.get(pipeline, ()))

    def of(self, pipeline: str, step: int, kind: Kind | None = None) -> list[Node]:
        """The nodes of one step of one pipeline (optionally of one kind), in topological order."""
        if kind is None:
            return self._by_step.get((pipeline, step), [])
        return list(self._by_kind.get((pipeline, step, kind), ()))
