"""`digen`: DigenRL's schedule for FlowGRPO / DanceGRPO on a rollout pool and a trainer pool.

* GAP — the batch is cut into M fragments of whole groups; each fragment is scored and trained as
  soon as it is generated, gradients accumulate, and one optimizer step commits the batch. Rollout and
  trainer hold the same weights version, so the rollout's log-probs are the old log-probs: no recompute.
* TSP — a train node covers a chunk of trained timesteps, batched into one forward/backward.
* TAG — while the trainer pool would wait for data, its devices generate fragments; a bounded,
  memoized search over the predicted makespan (switch costs included) decides how many, and only
  where it shortens the step. `Setup.options["tag"] = False` turns it off (for ablations and `plan`).
* TCSS (opt-in) — once every fragment of step s has started, the rollout pool starts step s + 1 on
  weights s (staleness 1, never more, one version per step so no group or trajectory mixes versions).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

from dovetail.graph.flow import FlowShape, build_flow, engines
from dovetail.graph.node import Kind, Node, Role
from dovetail.graph.spec import FlowSpec, PipelineSpec
from dovetail.sched.colocated import flow_only
from dovetail.sched.disaggregated import split_pools
from dovetail.sched.policy import (
    Begin, Decision, Event, NodeStarted, Policy, Run, Setup, StartStep, SwitchRole, all_idle, idle_devices,
    open_steps_on_publish, ready_of,
)

TAG_MIN_GAIN = 0.01
"""TAG must shorten the predicted step by at least this fraction; otherwise switching is not worth it."""


@lru_cache(maxsize=65536)
def predict_makespan(
    rollout_free: tuple[float, ...],
    pending: int,
    arrivals: tuple[float, ...],
    trainer_free: float,
    generate_s: float,
    score_s: float,
    train_s: float,
    tail_s: float,
    tag: int = 0,
    tag_in_s: float = 0.0,
    tag_out_s: float = 0.0,
    now: float = 0.0,
) -> float:
    """End of the step under GAP: `pending` fragments go to the earliest-free rollout device, `tag` of
    them to trainer devices (each pays `tag_in_s`, generates, pays `tag_out_s`, holding the trainer group
    until all are back); the trainer group trains fragments in arrival order, then `tail_s`."""
    free = list(rollout_free)
    heapq.heapify(free)
    landed = list(arrivals)
    trainer = trainer_free
    if tag:
        landed += [now + tag_in_s + generate_s + score_s] * tag
        trainer = max(trainer, now + tag_in_s + generate_s + tag_out_s)
    for _ in range(pending - tag):
        done = heapq.heappop(free) + generate_s
        landed.append(done + score_s)
        heapq.heappush(free, done)
    for arrival in sorted(landed):
        trainer = max(trainer, arrival) + train_s
    return trainer + tail_s


def _step_costs(nodes: Sequence[Node], fragments: int, trainer_devices: int) -> tuple[float, float, float, float]:
    """Per-fragment generate, score and (trainer-group wall) train seconds — reference forwards
    included — and the step's tail."""
    total = {kind: sum(n.cost_s for n in nodes if n.kind == kind) for kind in Kind}
    return (
        total[Kind.GENERATE] / fragments,
        total[Kind.SCORE] / fragments,
        (total[Kind.TRAIN] + total[Kind.LOGPROB]) / fragments / trainer_devices,
        total[Kind.COMMIT] + total[Kind.PUBLISH],
    )


class Digen(Policy):
    name = "digen"
    tcss = False

    @classmethod
    def shape(cls, spec: PipelineSpec, devices: int, trainer_devices: int | None, cost) -> FlowShape:
        """The best of `candidates`."""
        return cls.candidates(spec, devices, trainer_devices, cost)[0][1]

    @classmethod
    def candidates(cls, spec: PipelineSpec, devices: int, trainer_devices: int | None, cost) -> list[tuple[float, FlowShape]]:
        """(predicted step seconds, shape) for every trainer pool, fragment count and TSP chunk that fits in
        memory, best first (ties: the larger chunk). The scenario's own choices are kept when given."""
        spec = flow_only(cls.name, spec)
        capacity = cost.device.memory_bytes / 1e9
        pools = [trainer_devices] if trainer_devices else range(1, devices)
        ranked: list[tuple[float, int, FlowShape]] = []
        for trainers in pools:
            rollout = devices - trainers
            held = engines(spec, cost, trainers).resident_gb
            for fragments in cls._fragment_choices(spec, rollout):
                for chunk in cls._chunk_choices(spec):
                    shape = FlowShape(fragments, chunk, False, trainers)
                    nodes = build_flow(spec, 1, shape, cost)
                    if max(n.memory_gb for n in nodes if n.kind == Kind.TRAIN) + held[Role.TRAINER] > capacity:
                        continue
                    generate_s, score_s, train_s, tail_s = _step_costs(nodes, fragments, trainers)
                    if cls.tcss:
                        # Steps overlap: the slower of the two pools sets the pace.
                        predicted = max(-(-fragments // rollout) * (generate_s + score_s), fragments * train_s + tail_s)
                    else:
                        predicted = min(
                            predict_makespan((0.0,) * rollout, fragments, (), 0.0, generate_s, score_s, train_s, tail_s, tag)
                            for tag in range(0, min(trainers, fragments) + 1)
                        )
                    ranked.append((predicted, -chunk, shape))
        if not ranked:
            raise ValueError(f"{spec.name}: no digen shape fits in {capacity:.0f} GB per device; enable offload or use a smaller tsp_chunk")
        ranked.sort(key=lambda r: r[:2])
        return [(predicted, shape) for predicted, _, shape in ranked]

    @staticmethod
    def _fragment_choices(spec: FlowSpec, rollout: int) -> list[int]:
        if spec.fragments:
            return [spec.fragments]
        choices = {min(spec.prompts, k * rollout) for k in (1, 2, 4, 8)}
        return sorted({max(spec.mini_batches, m - m % spec.mini_batches) for m in choices})

    @staticmethod
    def _chunk_choices(spec: FlowSpec) -> list[int]:
        if spec.tsp_chunk:
            return [spec.tsp_chunk]
        return sorted({min(c, spec.trained_timesteps) for c in (1, 2, 4, 8, spec.trained_timesteps)})

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        if len(setup.engines) != 1:
            raise ValueError(f"policy digen runs one pipeline, got {sorted(setup.engines)}")
        (self.pipeline,) = setup.engines
        self.rollout_pool, self.trainer_pool = split_pools(setup.devices, setup.trainer_devices)
        self.everyone = tuple(range(setup.devices))
        held = setup.engines[self.pipeline].resident_gb
        self.tag_resident_gb = held[Role.TRAINER] + held[Role.ROLLOUT]
        self.tag_reserved: dict[int, str] = {}
        self.started_at: dict[str, float] = {}
        self.tag_decisions: list[tuple[float, int]] = []
        """(time, fragments) of every TAG insertion, for the run's log."""

    # ------------------------------------------------------------ decisions
    def decide(self, view, events: Sequence[Event]) -> list[Decision]:
        decisions: list[Decision] = []
        for event in events:
            if isinstance(event, Begin):
                decisions += [self.setup.switch(d, self.pipeline, None, Role.ROLLOUT) for d in self.rollout_pool]
                decisions += [self.setup.switch(d, self.pipeline, None, Role.TRAINER) for d in self.trainer_pool]
        decisions += open_steps_on_publish(view, events)
        if any(isinstance(d, SwitchRole) for d in decisions):
            return decisions
        if self.tcss:
            decisions += self._early_start(view, decisions)
        taken: set[int] = set()

        publish = ready_of(view, Kind.PUBLISH)
        if publish:
            if all_idle(view, self.everyone):
                decisions.append(Run(publish[0].id, self.everyone))
            return decisions

        decisions += self._trainer_group(view, taken)
        decisions += self._tag_devices(view, taken)
        decisions += self._rollout(view, taken)
        return decisions

    def _early_start(self, view, decided: list[Decision]) -> list[Decision]:
        """TCSS: when every fragment of the newest step has started, open the next on the latest weights."""
        opening = {(d.pipeline, d.step) for d in decided if isinstance(d, StartStep)}
        started = [s for (p, s) in view.started if p == self.pipeline] + [s for (_, s) in opening]
        if not started:
            return []
        newest = max(started)
        following = newest + 1
        if following not in view.graph.steps(self.pipeline) or (self.pipeline, newest) in opening:
            return []
        if any(node.id in view.ready for node in view.graph.of(self.pipeline, newest, Kind.GENERATE)):
            return []
        version = view.published[self.pipeline]
        if following - version > 1:
            return []
        return [StartStep(self.pipeline, following, version)]

    def _trainer_group(self, view, taken: set[int]) -> list[Decision]:
        group = self.trainer_pool
        if not all_idle(view, group) or any(view.devices[d].role != Role.TRAINER for d in group):
            return []
        for kind in (Kind.COMMIT, Kind.TRAIN, Kind.LOGPROB):
            nodes = ready_of(view, kind, self.pipeline)
            if nodes:
                node = min(nodes, key=lambda n: n.step)
                taken.update(group)
                return [Run(node.id, group)]
        return self._consider_tag(view, taken)

    def _consider_tag(self, view, taken: set[int]) -> list[Decision]:
        """The trainer group is idle with nothing to train: let k of its devices generate fragments if
        the predicted makespan of the step drops by more than TAG_MIN_GAIN."""
        if not self.setup.options.get("tag", True) or self.tag_resident_gb > self.setup.memory_gb:
            return []
        unclaimed = [n for n in ready_of(view, Kind.GENERATE, self.pipeline) if n.id not in self.tag_reserved.values()]
        rollout_idle = idle_devices(view, self.rollout_pool, Role.ROLLOUT)
        waiting = unclaimed[len(rollout_idle):]
        if not waiting:
            return []
        nodes = view.graph.of(self.pipeline, waiting[0].step)
        generate_s, score_s, train_s, tail_s = (
            self.costs.seconds(n) for n in self._typical(nodes)
        )
        train_s /= len(self.trainer_pool)
        arrivals, rollout_free = [], []
        for d in self.rollout_pool:
            remaining = 0.0
            for node_id in view.devices[d].running:
                remaining = max(remaining, self._remaining(view, node_id))
                arrivals.append(view.now + remaining + score_s)
            rollout_free.append(view.now + remaining)
        engines_ = self.setup.engines[self.pipeline]
        tag_in = engines_.wake_s[Role.ROLLOUT]
        tag_out = engines_.sleep_s[Role.ROLLOUT]
        backlog = sum(self.costs.seconds(n, len(self.trainer_pool)) for n in ready_of(view, Kind.TRAIN, self.pipeline))
        pending = len(unclaimed)
        args = (
            tuple(round(t, 2) for t in rollout_free), pending, tuple(round(t, 2) for t in arrivals),
            round(view.now + backlog, 2), round(generate_s, 2), round(score_s, 2), round(train_s, 2), round(tail_s, 2),
        )
        baseline = predict_makespan(*args)
        best_k, best = 0, baseline
        for k in range(1, min(len(self.trainer_pool), len(waiting)) + 1):
            predicted = predict_makespan(*args, k, round(tag_in, 2), round(tag_out, 2), round(view.now, 2))
            if predicted < best:
                best_k, best = k, predicted
        if best_k == 0 or baseline - best < TAG_MIN_GAIN * (baseline - view.now):
            return []
        chosen = self.trainer_pool[:best_k]
        for device, node in zip(chosen, reversed(waiting)):
            self.tag_reserved[device] = node.id
        self.tag_decisions.append((view.now, best_k))
        taken.update(self.trainer_pool)
        return [SwitchRole(d, Role.ROLLOUT, tag_in, self.tag_resident_gb) for d in chosen]

    def _typical(self, nodes: Sequence[Node]) -> tuple[Node, Node, Node, Node]:
        """One generate, score and train node of a step (the cost of one fragment) and its commit."""
        first = {}
        for node in nodes:
            first.setdefault(node.kind, node)
        train_per_fragment = sum(
            n.cost_s for n in nodes if n.kind in (Kind.TRAIN, Kind.LOGPROB) and n.samples == first[Kind.TRAIN].samples
        )
        train = replace(first[Kind.TRAIN], cost_s=train_per_fragment)
        tail = replace(first[Kind.COMMIT], cost_s=first[Kind.COMMIT].cost_s + first[Kind.PUBLISH].cost_s)
        return first[Kind.GENERATE], first[Kind.SCORE], train, tail

    def _remaining(self, view, node_id: str) -> float:
        node = view.graph[node_id]
        return max(0.0, self.costs.seconds(node) - (view.now - self.started_at.get(node_id, view.now)))

    def _tag_devices(self, view, taken: set[int]) -> list[Decision]:
        """Trainer devices lent to generation: run the reserved fragment, then switch back."""
        decisions: list[Decision] = []
        for device in self.trainer_pool:
            state = view.devices[device]
            if device in taken or not state.idle or state.role != Role.ROLLOUT:
                continue
            node_id = self.tag_reserved.get(device)
            if node_id is not None and node_id in view.ready:
                decisions.append(Run(node_id, (device,)))
            else:
                self.tag_reserved.pop(device, None)
                held = self.setup.engines[self.pipeline]
                decisions.append(SwitchRole(device, Role.TRAINER, held.sleep_s[Role.ROLLOUT], held.resident_gb[Role.TRAINER]))
            taken.add(device)
        return decisions

    def _rollout(self, view, taken: set[int]) -> list[Decision]:
        """Scores first (they unblock the trainer), then fragments, oldest step first."""
        devices = [d for d in idle_devices(view, self.rollout_pool, Role.ROLLOUT) if d not in taken]
        reserved = set(self.tag_reserved.values())
        work = ready_of(view, Kind.SCORE, self.pipeline) + sorted(
            (n for n in ready_of(view, Kind.GENERATE, self.pipeline) if n.id not in reserved), key=lambda n: n.step
        )
        return [Run(node.id, (device,)) for node, device in zip(work, devices)]

    def observe(self, view, events: Sequence[Event]) -> None:
        super().observe(view, events)
        for event in events:
            if isinstance(event, NodeStarted):
                self.started_at[event.node] = event.time


class DigenTCSS(Digen):
    """digen with one-step bounded asynchrony (TCSS) on."""

    name = "digen+tcss"
    tcss = True
