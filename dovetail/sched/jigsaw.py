"""`jigsaw`: JigsawRL's pipeline multiplexing for LLM GRPO, and `jigsaw-greedy`, its ablation.

Several RL pipelines share one pool. Every device holds every pipeline's rollout engine (with a reduced
KV-cache budget) and FSDP trainer shard (role ANY), so nothing is ever put to sleep. Each step is the
sub-stage graph of `graph.llm` with shareable nodes: a pipeline's rollout runs on all devices as one
engine per `tensor_parallel` devices, its trainer work on the whole pool. Complementary sub-stages of
different pipelines — bandwidth-bound decode beside compute-bound log-prob / training — share devices
(share `SHARE` each) and slow each other down by the calibrated interference table. Long-tail responses
migrate at `migrate_at` tokens (re-prefill counted) onto the least-loaded engine, freeing the others.
Steps stay on-policy (staleness 0).

The one real choice is which pipelines' trainer work runs when several want the (compute-bound) pool:
`jigsaw` rolls a stage-level model of the pool forward over each pipeline's current and next step
(the same interference table; memoized) for every candidate set and takes the one with the earliest
mean completion; `jigsaw-greedy` starts everything that fits now, the locally best action.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from itertools import combinations

from dovetail.graph.llm import LLMShape, response_lengths, stage
from dovetail.graph.node import Kind, Node, Role
from dovetail.graph.spec import PipelineSpec
from dovetail.sched.calibration import DEFAULT
from dovetail.sched.llm_common import (
    StagedLLMPolicy, engine_devices, llm_only, rollout_engines, rollout_seconds, shard_of, tensor_parallel, trainer_seconds,
)
from dovetail.sched.policy import Begin, Decision, Event, Run, Setup, SwitchRole, View, open_steps_on_publish

ROLLOUT_MEMORY = 0.3
"""Device fraction of each pipeline's rollout engine (weights + KV cache): two pipelines' engines take
half of every device, their FSDP trainer shards and activations the rest."""
TAIL_ENGINE = 4
"""The long tail migrates onto an engine this many times wider than the home engines: each device holds
the full weights already, and a wider engine reads fewer weight and KV bytes per device per token."""
SHARE = 0.475
"""Share of a device a rollout or trainer node reserves: two fit side by side ..."""
SCORE_SHARE = 0.05
"""... with room left for a rule reward."""
EPS = 1e-9


def tail_width(devices: int, tensor_parallel: int) -> int:
    return min(devices, TAIL_ENGINE * tensor_parallel)


def tail_edge(spec, shards: int) -> int | None:
    """The first length-band edge past which at most one engine's fair share of the step's responses is
    still running (or the last edge): where the long tail migrates. None without bands."""
    lengths = response_lengths(spec, 0, 0)
    fair = len(lengths) / shards
    for edge in spec.length_bands:
        if edge < spec.max_length and sum(n > edge for n in lengths) <= fair:
            return edge
    edges = [e for e in spec.length_bands if e < spec.max_length]
    return edges[-1] if edges else None


@lru_cache(maxsize=65536)
def predict_completion(phases: tuple[tuple[tuple[str, float], ...], ...], running: frozenset[int]) -> float:
    """Mean time at which each pipeline finishes its list of (class, seconds) phases, where "decode"
    phases always run, "train" phases run one pipeline at a time (first come, first served) except the
    pipelines in `running`, which are in a train phase now; co-running phases slow each other down by
    the interference table."""
    position = [0] * len(phases)
    left = [p[0][1] if p else 0.0 for p in phases]
    training = set(running)
    queue = [i for i, p in enumerate(phases) if p and p[0][0] == "train" and i not in training]
    now, finished = 0.0, [0.0] * len(phases)
    while True:
        if not training and queue:
            training.add(queue.pop(0))
        active = [i for i in range(len(phases)) if position[i] < len(phases[i]) and (phases[i][position[i]][0] == "decode" or i in training)]
        if not active:
            return sum(finished) / len(phases)
        speed = {}
        for i in active:
            mine = phases[i][position[i]][0]
            others = [phases[j][position[j]][0] for j in active if j != i]
            speed[i] = 1.0 / max((DEFAULT.slowdown(mine, o) for o in others), default=1.0)
        step = min(left[i] / speed[i] for i in active)
        now += step
        for i in active:
            left[i] -= step * speed[i]
            if left[i] <= EPS:
                training.discard(i)
                position[i] += 1
                if position[i] == len(phases[i]):
                    finished[i] = now
                    continue
                left[i] = phases[i][position[i]][1]
                if phases[i][position[i]][0] == "train":
                    queue.append(i)


class Jigsaw(StagedLLMPolicy):
    name = "jigsaw"
    look_ahead = True

    @classmethod
    def shape(cls, spec: PipelineSpec, devices: int, trainer_devices: int | None, cost) -> LLMShape:
        spec = llm_only(cls.name, spec)
        shards = rollout_engines(spec, devices)
        return LLMShape(
            shards, devices, tail_edge(spec, shards), shared=True, rollout_memory=ROLLOUT_MEMORY,
            tail_parallel=tail_width(devices, spec.tensor_parallel),
        )

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        held = [gb for engines in setup.engines.values() for role, gb in engines.resident_gb.items() if role in (Role.ROLLOUT, Role.TRAINER)]
        self.resident_gb = sum(held)
        if self.resident_gb > setup.memory_gb:
            raise ValueError(
                f"{self.name}: every pipeline's engines together need {self.resident_gb:.0f} GB per device, more than "
                f"{setup.memory_gb:.0f} GB; multiplex fewer or smaller pipelines, or raise tensor_parallel"
            )
        self.wake_s = sum(s for engines in setup.engines.values() for role, s in engines.wake_s.items() if role in (Role.ROLLOUT, Role.TRAINER))
        self.everyone = tuple(range(setup.devices))
        self.tail_on: dict[tuple[str, int], tuple[int, ...]] = {}
        self.choices: list[tuple[float, tuple[str, ...]]] = []
        """(time, pipelines started) of every look-ahead choice among several, for the run's log."""

    def decide(self, view: View, events: Sequence[Event]) -> list[Decision]:
        decisions: list[Decision] = open_steps_on_publish(view, events)
        if any(isinstance(e, Begin) for e in events):
            return decisions + [SwitchRole(d, Role.ANY, self.wake_s, self.resident_gb) for d in self.everyone]
        self.free = {d: view.devices[d].free_share for d in self.everyone}
        self.memory = {d: view.devices[d].memory_gb for d in self.everyone}
        for pipeline in view.graph.pipelines():
            decisions += self._rollout(view, pipeline)
        decisions += self._trainer(view)
        for node in (view.graph[n] for n in view.ready):
            if node.kind == Kind.SCORE and (device := self._roomiest(node, SCORE_SHARE)) is not None:
                decisions.append(self._take(node, (device,), SCORE_SHARE))
        return decisions

    # ------------------------------------------------------------ placement
    def _fits(self, node: Node, devices: Sequence[int], share: float) -> bool:
        return all(self.free[d] >= share - EPS and self.memory[d] + node.memory_gb <= self.setup.memory_gb + EPS for d in devices)

    def _take(self, node: Node, devices: tuple[int, ...], share: float) -> Run:
        for d in devices:
            self.free[d] -= share
            self.memory[d] += node.memory_gb
        return Run(node.id, devices, share)

    def _roomiest(self, node: Node, share: float) -> int | None:
        fitting = [d for d in self.everyone if self._fits(node, (d,), share)]
        return max(fitting, key=lambda d: (self.free[d], -d), default=None)

    def _rollout(self, view: View, pipeline: str) -> list[Decision]:
        """Home shards on their engines; the migrated tail on the least-loaded engine, then decoded there."""
        decisions: list[Decision] = []
        tp = tensor_parallel(view, pipeline, self.everyone)
        for node in self.ready_nodes(view, pipeline):
            if stage(node) != "rollout":
                continue
            shard = shard_of(node)
            if shard is not None:
                devices = engine_devices(self.everyone, shard, tp)
            elif node.kind == Kind.MIGRATE:
                width = tail_width(len(self.everyone), tp)
                engines = [engine_devices(self.everyone, k, width) for k in range(len(self.everyone) // width)]
                devices = max(engines, key=lambda e: (min(self.free[d] for d in e), -e[0]))
            else:
                devices = self.tail_on[(pipeline, node.step)]
            if self._fits(node, devices, SHARE):
                self.tail_on[(pipeline, node.step)] = devices
                decisions.append(self._take(node, devices, SHARE))
        return decisions

    def _trainer(self, view: View) -> list[Decision]:
        """Each pipeline's next trainer node on the whole pool, one at a time per pipeline; which of the
        waiting pipelines start now is the look-ahead's (or the greedy) choice."""
        busy = {view.graph[n].pipeline for n in view.running if view.graph[n].role == Role.TRAINER}
        waiting: dict[str, Node] = {}
        for node_id in view.ready:
            node = view.graph[node_id]
            if node.role == Role.TRAINER and node.pipeline not in busy and node.pipeline not in waiting:
                waiting[node.pipeline] = node
        candidates = [
            group for size in range(len(waiting), -1, -1) for group in combinations(sorted(waiting), size)
            if self._fits_all([waiting[p] for p in group]) and (group or busy)
        ]
        if not candidates:
            return []
        chosen = candidates[0] if not self.look_ahead or len(candidates) == 1 else self._look_ahead(view, candidates, busy)
        if len(candidates) > 1:
            self.choices.append((view.now, chosen))
        return [self._take(waiting[p], self.everyone, SHARE) for p in chosen]

    def _fits_all(self, nodes: list[Node]) -> bool:
        return all(self.free[d] >= SHARE * len(nodes) - EPS for d in self.everyone) and all(
            self.memory[d] + sum(n.memory_gb for n in nodes) <= self.setup.memory_gb + EPS for d in self.everyone
        )

    # ------------------------------------------------------------ look-ahead
    def _look_ahead(self, view: View, candidates: list[tuple[str, ...]], busy: set[str]) -> tuple[str, ...]:
        pipelines = view.graph.pipelines()
        phases = tuple(self._phases(view, p) for p in pipelines)
        index = {p: i for i, p in enumerate(pipelines)}
        scored = [
            (predict_completion(phases, frozenset(index[p] for p in (*group, *busy))), -len(group), group)
            for group in candidates
        ]
        return min(scored)[2]

    def _phases(self, view: View, pipeline: str) -> tuple[tuple[str, float], ...]:
        """What is left of the pipeline's open step and its next one, as (class, seconds on the pool)."""
        opened = [s for (p, s) in view.started if p == pipeline]
        if not opened:
            return ()
        step = max(opened)
        tp = tensor_parallel(view, pipeline, self.everyone)
        phases: list[tuple[str, float]] = []
        for s in (step, step + 1):
            nodes = [n for n in view.graph.of(pipeline, s) if n.id not in view.finished]
            rollout = rollout_seconds(nodes, tp)
            if rollout > 0:
                phases.append(("decode", round(rollout, 1)))
            train = trainer_seconds(nodes, len(self.everyone))
            if train > 0:
                phases.append(("train", round(train, 1)))
        return tuple(phases)


class JigsawGreedy(Jigsaw):
    name = "jigsaw-greedy"
    look_ahead = False
