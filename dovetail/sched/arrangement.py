"""Arrangements a multiplexing policy may choose instead of sharing every device: the split pool and back to back.

* `SPLIT` — each pipeline its own even slice of the pool (`llm_common.split_pool`, what `verl-sync`'s `splits_pool`
  does), run there by its kind's best single-pipeline policy.
* `TURNS` — back to back: the pipelines take the whole pool in turns (in the scenario's order), each running all its
  steps alone under its kind's best single-pipeline policy before the next begins.

An `Arrangement` is the shapes (pipeline -> shape) of one of them, marked with its mode; it travels where a search's
shapes travel (the forecast's `prepare(shapes=...)`, `Setup.shapes`), so the policy built from them carries it out.
`Delegates` carries it out: one single-pipeline policy per pipeline, each deciding from a view of its own pipeline and
devices (`PipelineView`: its nodes only, its devices numbered from 0), its decisions mapped back onto the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import Any

from dovetail.graph.node import Graph
from dovetail.sched.llm_common import split_pool
from dovetail.sched.policy import (
    Begin,
    Decision,
    DeviceIdle,
    Event,
    Migrate,
    NodeFinished,
    NodeReady,
    NodeStarted,
    Policy,
    RoleSwitched,
    Run,
    Setup,
    Shape,
    StartStep,
    StepCommitted,
    SwitchRole,
    VersionPublished,
    View,
)

SPLIT = "split"
TURNS = "turns"


class Arrangement(dict[str, Shape]):
    """Shapes (pipeline -> shape) of the split pool (`SPLIT`) or back to back (`TURNS`): each pipeline's shape cut by
    its kind's best single-pipeline policy for the devices it gets (its slice, or the whole pool)."""

    def __init__(self, mode: str, shapes: Mapping[str, Shape]) -> None:
        super().__init__(shapes)
        if mode not in (SPLIT, TURNS):
            raise ValueError(f"arrangement {mode!r}: not {SPLIT!r} or {TURNS!r}")
        self.mode = mode

    def __repr__(self) -> str:
        return f"Arrangement({self.mode!r}, {dict(self)!r})"


def mode_of(shapes: Mapping[str, object]) -> str | None:
    """The arrangement `shapes` are cut for; None: the multiplexing policy's own (every device shared)."""
    return shapes.mode if isinstance(shapes, Arrangement) else None


def groups_of(mode: str, pipelines: Sequence[str], devices: int) -> dict[str, tuple[int, ...]]:
    """The devices each pipeline runs on: its slice of the pool (`SPLIT`), or all of them (`TURNS`)."""
    if mode == SPLIT:
        return dict(zip(pipelines, split_pool(devices, len(pipelines))))
    return {p: tuple(range(devices)) for p in pipelines}


class _Device:
    """A device of the pool as a delegate sees it: numbered in its own group."""

    def __init__(self, device: Any, index: int) -> None:
        self._device = device
        self.index = index

    def __getattr__(self, name: str) -> Any:
        return getattr(self._device, name)


class PipelineView:
    """The pool's view restricted to one pipeline's nodes and its group of devices (numbered from 0); each part is
    read from the pool's view when first asked for."""

    def __init__(self, view: View, pipeline: str, graph: Graph, ids: frozenset[str], group: tuple[int, ...]) -> None:
        self._view, self._pipeline, self._ids, self._group = view, pipeline, ids, group
        self.now = view.now
        self.graph = graph

    @cached_property
    def devices(self) -> list[_Device]:
        return [_Device(self._view.devices[d], i) for i, d in enumerate(self._group)]

    @cached_property
    def ready(self) -> dict[str, None]:
        return {n: None for n in self._view.ready if n in self._ids}

    @cached_property
    def running(self) -> dict[str, object]:
        """The pipeline's running nodes (what the executor keeps of each, as it gives it: the policies read the ids)."""
        return {n: running for n, running in self._view.running.items() if n in self._ids}

    @cached_property
    def finished(self) -> set[str]:
        return self._view.finished & self._ids

    @cached_property
    def published(self) -> dict[str, int]:
        return {self._pipeline: self._view.published[self._pipeline]}

    @cached_property
    def started(self) -> dict[tuple[str, int], int]:
        return {key: version for key, version in self._view.started.items() if key[0] == self._pipeline}


def _local_event(event: Event, ids: frozenset[str], pipeline: str, local: Mapping[int, int]) -> Event | None:
    """`event` as the delegate of `pipeline` on the devices `local` (pool -> group index) sees it, or None."""
    if isinstance(event, Begin):
        return event
    if isinstance(event, NodeReady):
        return event if event.node in ids else None
    if isinstance(event, NodeStarted):
        return (
            NodeStarted(event.time, event.node, tuple(local[d] for d in event.devices)) if event.node in ids else None
        )
    if isinstance(event, NodeFinished):
        if event.node not in ids:
            return None
        return NodeFinished(event.time, event.node, tuple(local[d] for d in event.devices), event.seconds)
    if isinstance(event, DeviceIdle):
        return DeviceIdle(event.time, local[event.device]) if event.device in local else None
    if isinstance(event, RoleSwitched):
        return RoleSwitched(event.time, local[event.device], event.role) if event.device in local else None
    if isinstance(event, StepCommitted | VersionPublished):
        return event if event.pipeline == pipeline else None
    return None


def _pool_decision(decision: Decision, group: tuple[int, ...]) -> Decision:
    if isinstance(decision, Run):
        return Run(decision.node, tuple(group[d] for d in decision.devices), decision.share)
    if isinstance(decision, SwitchRole):
        return SwitchRole(group[decision.device], decision.role, decision.cost_s, decision.resident_gb)
    if isinstance(decision, Migrate):
        return Migrate(decision.node, tuple(group[d] for d in decision.devices), decision.cost_s, decision.share)
    assert isinstance(decision, StartStep)
    return decision


class Delegates:
    """Carries out an arrangement: each pipeline's own single-pipeline policy (`policy_for(pipeline)`) on its group,
    all at once (`SPLIT`) or one after another, each starting once the previous one's every node finished (`TURNS`)."""

    def __init__(self, setup: Setup, mode: str, policy_for: Callable[[str], type[Policy]]) -> None:
        self.mode = mode
        self.pipelines = list(setup.engines)
        self.groups = groups_of(mode, self.pipelines, setup.compute_devices)
        self.local = {p: {d: i for i, d in enumerate(group)} for p, group in self.groups.items()}
        """Each pipeline's devices: pool index -> its own."""
        self.policies: dict[str, Policy] = {}
        for pipeline in self.pipelines:
            shape = setup.shapes[pipeline]
            cls = policy_for(pipeline)
            self.policies[pipeline] = cls(
                Setup(
                    devices=len(self.groups[pipeline]),
                    memory_gb=setup.memory_gb,
                    engines={pipeline: setup.engines[pipeline]},
                    trainer_devices=getattr(shape, "trainer_devices", None),
                    trainer_groups={pipeline: setup.trainer_groups[pipeline]}
                    if pipeline in setup.trainer_groups
                    else {},
                    options=setup.options,
                    priorities={pipeline: setup.priorities.get(pipeline, 1.0)},
                    shapes={pipeline: shape},
                    max_staleness=min(setup.max_staleness, cls.max_staleness),
                    node_size=setup.node_size,
                    slowdown=setup.slowdown,
                )
            )
        self.graphs: dict[str, Graph] = {}
        self.ids: dict[str, frozenset[str]] = {}
        self.last: dict[str, tuple[str, ...]] = {}
        """The nodes of each pipeline's last step."""
        self.active = 0
        """TURNS: index of the pipeline whose turn it is (every pipeline's from the start under SPLIT)."""

    def _graph(self, view: View) -> None:
        if self.graphs:
            return
        for pipeline in self.pipelines:
            steps = view.graph.steps(pipeline)
            nodes = [n for step in steps for n in view.graph.of(pipeline, step)]
            self.graphs[pipeline] = Graph(nodes)
            self.ids[pipeline] = frozenset(n.id for n in nodes)
            self.last[pipeline] = tuple(n.id for n in view.graph.of(pipeline, steps[-1])) if steps else ()

    def _done(self, view: View, pipeline: str) -> bool:
        """Every node of the pipeline finished (or counts as done: a pipeline withdrawn after its reward failed): its
        last step's nodes are, and no node of a step finishes before the step's predecessors' do."""
        return all(n in view.finished for n in self.last[pipeline])

    def decide(self, view: View, events: Sequence[Event]) -> list[Decision]:
        self._graph(view)
        if self.mode == SPLIT:
            return [d for pipeline in self.pipelines for d in self._react(view, pipeline, events)]
        current = self.pipelines[self.active]
        decisions = self._react(view, current, events)
        while self._done(view, current) and self.active < len(self.pipelines) - 1:
            # This turn's pipeline is done: the next one begins now on the whole pool (its weights version 0 was
            # published at the run's start, which its policy did not see).
            self.active += 1
            current = self.pipelines[self.active]
            begin = [Begin(view.now), VersionPublished(view.now, current, view.published[current])]
            decisions += self._react(view, current, begin)
        return decisions

    def _react(self, view: View, pipeline: str, events: Sequence[Event]) -> list[Decision]:
        group, local, ids = self.groups[pipeline], self.local[pipeline], self.ids[pipeline]
        seen = [e for e in (_local_event(event, ids, pipeline, local) for event in events) if e is not None]
        if not seen:  # nothing of its own happened: its view is as it last decided on (its devices are its own)
            return []
        sub = PipelineView(view, pipeline, self.graphs[pipeline], ids, group)
        decisions = self.policies[pipeline].react(sub, seen)
        if self.mode == TURNS:  # its group is the whole pool, numbered as the pool is
            return decisions
        return [_pool_decision(d, group) for d in decisions]
