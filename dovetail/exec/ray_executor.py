"""RayExecutor: the same policy objects as the simulator, carried out on DeviceWorker actors.

The loop is the simulator's with the wall clock for time: events -> policy.react -> decisions, each
checked and booked by `ClusterState` and launched as actor calls; whenever a call returns, the
finished node's event goes back to the policy. Data moves as Ray object refs; weights are published
as versioned refs that rollout engines load between trajectories.

A worker that dies is restarted by Ray; the executor gives it the last committed trainer state, forms
the device group again, re-runs the train parts whose gradients it held (their results are already
booked, so no sample counts twice) and sends its unfinished parts again. Trajectories and scores
live in the object store and survive the worker.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import ray
from ray.exceptions import RayActorError, RayTaskError

from dovetail.config.train import TrainConfig
from dovetail.exec.state import ClusterState
from dovetail.exec.trace import Trace
from dovetail.exec.worker import form_group
from dovetail.graph.flow import split
from dovetail.graph.node import Graph, Kind, Node
from dovetail.models.flow_rl import step_prompts
from dovetail.recipe import step_timesteps
from dovetail.sched.policy import Migrate, Policy, Run, Setup, StepCommitted, SwitchRole

SampleKey = tuple[int, int, int]
RESTART_POLLS = 600


@dataclass
class Part:
    """One actor call that carries out (part of) a node on one device; kept so it can be re-sent."""

    node: str
    device: int
    method: str
    args: tuple
    index: int = 0
    """Position of the part's output among the node's outputs (results are read in this order)."""
    switch: SwitchRole | None = None
    """Set for a role switch, which is no node."""
    rerun: bool = False
    """A finished train part sent again to a restarted device, to rebuild its accumulated gradients."""


@dataclass
class Ledger:
    """Per sample and per weights version: what was generated, scored and trained, and where."""

    generated: dict[SampleKey, list[tuple[int, int]]] = field(default_factory=dict)
    scored: dict[SampleKey, int] = field(default_factory=dict)
    trained: dict[tuple[SampleKey, int], int] = field(default_factory=dict)
    """(sample, timestep) -> times its gradient entered a commit."""
    restarts: list[tuple[float, int, str]] = field(default_factory=list)
    reruns: list[tuple[int, str]] = field(default_factory=list)
    """(device, train node) re-run on a restarted device to rebuild the gradients it held."""

    def problems(self, expected: dict[SampleKey, list[int]]) -> list[str]:
        """Every sample generated once and scored once, every (sample, timestep) trained once."""
        found = []
        for sample, timesteps in expected.items():
            if len(self.generated.get(sample, [])) != 1:
                found.append(f"sample {sample} generated {len(self.generated.get(sample, []))} times")
            if self.scored.get(sample, 0) != 1:
                found.append(f"sample {sample} scored {self.scored.get(sample, 0)} times")
            for k in timesteps:
                if self.trained.get((sample, k), 0) != 1:
                    found.append(f"sample {sample} timestep {k} trained {self.trained.get((sample, k), 0)} times")
        return found

    def to_json(self) -> dict:
        return {
            "generated": [[*s, d, v] for s, uses in sorted(self.generated.items()) for d, v in uses],
            "trained": [[*s, k, n] for (s, k), n in sorted(self.trained.items())],
            "restarts": self.restarts,
            "reruns": self.reruns,
        }


class RayExecutor:
    def __init__(
        self,
        graph: Graph,
        setup: Setup,
        config: TrainConfig,
        workers: list,
        *,
        first_step: int = 0,
        initial_weights: ray.ObjectRef,
        initial_trainer_state: ray.ObjectRef,
        on_commit: Callable[[int, RayExecutor], None] | None = None,
        after_part: Callable[[RayExecutor, Part], None] | None = None,
    ) -> None:
        """`first_step` is the RL step of the graph's step 0 (after a resume); `on_commit(rl_step, self)`
        runs after each optimizer step; `after_part` is a hook for fault-injection tests."""
        self.graph = graph
        self.setup = setup
        self.config = config
        self.workers = workers
        self.first_step = first_step
        self.on_commit = on_commit
        self.after_part = after_part
        self.versions: dict[int, ray.ObjectRef] = {0: initial_weights}
        self.trainer_state = initial_trainer_state
        self.trainer_devices: tuple[int, ...] = ()
        self.outputs: dict[str, list[ray.ObjectRef | None]] = {}
        self.train_pairs: dict[str, dict[int, tuple]] = defaultdict(dict)
        """Train node -> part index -> (sample ids, timesteps), booked when their commit lands."""
        self.uncommitted: dict[int, list[Part]] = defaultdict(list)
        """Device -> train parts whose gradients it holds, not yet consumed by a commit."""
        self._pids = ray.get([worker.ping.remote() for worker in workers])
        self.ledger = Ledger()
        self.publish_bytes = sum(v.nbytes for v in ray.get(initial_weights).values())
        self.publish_seconds: list[float] = []
        self.switch_seconds: list[float] = []
        self._pending: dict[ray.ObjectRef, Part] = {}
        self._left: dict[str, int] = {}
        self._prompts: dict[int, list[str]] = {}
        self._timesteps: dict[int, list[int]] = {}

    # ------------------------------------------------------------ the loop
    def run(self, policy: Policy) -> Trace:
        self.state = state = ClusterState(self.graph, self.setup)
        start = time.perf_counter()
        state.begin()
        while True:
            while True:
                events = state.take_events()
                for event in events:
                    if isinstance(event, StepCommitted) and self.on_commit is not None:
                        self.on_commit(self.first_step + event.step, self)
                        state.now = time.perf_counter() - start  # the driver's logging took wall time too
                decisions = policy.react(state, events)
                if not events and not decisions:
                    break
                for decision in decisions:
                    state.apply(decision)
                    self._launch(decision)
            if state.done:
                return state.trace
            if not self._pending:
                raise RuntimeError(f"policy {policy.name} stalled: {state.stuck_message()}")
            (ref,), _ = ray.wait(list(self._pending), num_returns=1)
            part = self._pending.pop(ref)
            try:
                result = ray.get(ref)
            except RayActorError:
                self._recover(part, time.perf_counter() - start)
                continue
            except RayTaskError:
                if part.method != "commit" or not self.ledger.restarts:
                    raise
                self._submit(part)  # its all-reduce lost a peer that died; the group is formed again
                continue
            state.now = time.perf_counter() - start
            self._complete(part, ref, result)
            if self.after_part is not None:
                self.after_part(self, part)

    def _submit(self, part: Part) -> None:
        ref = getattr(self.workers[part.device], part.method).remote(*part.args)
        self._pending[ref] = part

    def _recover(self, part: Part, now: float) -> None:
        """The worker died: wait for Ray to restart it, give it the committed trainer state, form the
        device group again, rebuild its accumulated gradients, and re-send the part."""
        worker = self.workers[part.device]
        for _ in range(RESTART_POLLS):
            try:
                pid = ray.get(worker.ping.remote(), timeout=30)
                break
            except RayActorError:
                time.sleep(0.1)  # Ray is still restarting the actor
        else:
            raise RuntimeError(f"device {part.device} did not come back after it died running {part.node}")
        if pid != self._pids[part.device]:  # a new incarnation: restore it once
            self._pids[part.device] = pid
            self.ledger.restarts.append((round(now, 3), part.device, part.node))
            ray.get(worker.configure.remote(self.config.model_dump(mode="json"), self.trainer_state))
            form_group(self.workers)
            for lost in self.uncommitted[part.device]:
                self.ledger.reruns.append((part.device, lost.node))
                self._submit(replace(lost, rerun=True))
        self._submit(part)

    # ------------------------------------------------------------ decisions -> actor calls
    def _launch(self, decision) -> None:
        if isinstance(decision, SwitchRole):
            self._submit(
                Part(
                    f"switch to {decision.role.value}",
                    decision.device,
                    "switch_role",
                    (decision.role.value,),
                    switch=decision,
                )
            )
        elif isinstance(decision, Run):
            self._run(self.graph[decision.node], decision.devices)
        elif isinstance(decision, Migrate):
            raise NotImplementedError("flow pipelines do not migrate; migration is for LLM decode")

    def rl_step(self, node: Node) -> int:
        return self.first_step + node.step

    def timesteps_of(self, rl_step: int) -> list[int]:
        if rl_step not in self._timesteps:
            self._timesteps[rl_step] = step_timesteps(self.config, rl_step)
        return self._timesteps[rl_step]

    def _sources(self, node: Node) -> dict[Kind, list[str]]:
        """The generate, score and old log-prob nodes of the node's step that it (transitively) reads."""
        found: dict[Kind, list[str]] = {Kind.GENERATE: [], Kind.SCORE: [], Kind.LOGPROB: []}
        seen: set[str] = set()
        frontier = list(node.deps)
        while frontier:
            dep = self.graph[frontier.pop()]
            if dep.id in seen or dep.step != node.step or dep.kind not in found:
                continue
            seen.add(dep.id)
            found[dep.kind].append(dep.id)
            frontier += dep.deps
        return {kind: sorted(ids) for kind, ids in found.items()}

    def _run(self, node: Node, devices: tuple[int, ...]) -> None:
        step = self.rl_step(node)
        parts: list[Part] = []
        if node.kind == Kind.GENERATE:
            prompts = self._prompts.setdefault(
                step, step_prompts(self.config.seed, step, self.config.algo.prompts_per_step)
            )
            samples = [(step, p, i) for (_, p, i) in node.samples]
            version = self.state.started[(node.pipeline, node.step)]
            for device, rows in zip(devices, split(len(samples), len(devices))):
                ids = [samples[r] for r in rows]
                if ids:
                    parts.append(
                        Part(
                            node.id,
                            device,
                            "generate",
                            (ids, [prompts[p] for _, p, _ in ids], self.first_step + version, [self.versions[version]]),
                        )
                    )
        elif node.kind in (Kind.SCORE, Kind.LOGPROB):
            trajectories = [ref for gen in self._sources(node)[Kind.GENERATE] for ref in self.outputs[gen]]
            method = "score" if node.kind == Kind.SCORE else "old_log_probs"
            leading = () if node.kind == Kind.SCORE else (self.timesteps_of(step),)
            for device, rows in zip(devices, split(len(trajectories), len(devices))):
                if rows:
                    parts.append(Part(node.id, device, method, (*leading, *[trajectories[r] for r in rows])))
        elif node.kind == Kind.TRAIN:
            sources = self._sources(node)
            inputs = [
                [ref for source in sources[kind] for ref in self.outputs[source]]
                for kind in (Kind.GENERATE, Kind.SCORE, Kind.LOGPROB)
            ]
            timesteps = self.timesteps_of(step)
            total_pairs = self.config.algo.prompts_per_step * self.config.algo.group_size * len(timesteps)
            chunk = timesteps[node.chunk[0] : node.chunk[1]]
            counts = tuple(len(refs) for refs in inputs)
            samples = [(step, p, i) for (_, p, i) in node.samples]
            stale = self.state.started[(node.pipeline, node.step)] < node.version
            for device, rows in zip(devices, split(len(samples), len(devices))):
                if rows:
                    parts.append(
                        Part(
                            node.id,
                            device,
                            "train",
                            (
                                [samples[r] for r in rows],
                                chunk,
                                total_pairs,
                                stale,
                                counts,
                                *[r for refs in inputs for r in refs],
                            ),
                        )
                    )
        elif node.kind == Kind.COMMIT:
            parts = [Part(node.id, device, "commit", (tuple(devices),)) for device in devices]
            self.trainer_devices = tuple(devices)
        elif node.kind == Kind.PUBLISH:
            weights = self.workers[self.trainer_devices[0]].export_weights.remote()
            self.versions[node.version + 1] = weights
            version = self.first_step + node.version + 1
            parts = [Part(node.id, device, "load_rollout_weights", (version, [weights])) for device in devices]
        else:
            raise ValueError(f"node {node.id}: the flow runtime does not run {node.kind} nodes")
        self._left[node.id] = len(parts)
        self.outputs[node.id] = [None] * len(parts)
        for index, part in enumerate(parts):
            part.index = index
            self._submit(part)

    # ------------------------------------------------------------ completions
    def _complete(self, part: Part, ref: ray.ObjectRef, result) -> None:
        if part.switch is not None:
            self.switch_seconds.append(result)
            self.state.finish_switch(part.switch.device, part.switch.role, part.switch.resident_gb)
            return
        if part.rerun:
            self.uncommitted[part.device].append(replace(part, rerun=False))
            return
        node = self.graph[part.node]
        self.outputs[node.id][part.index] = ref
        self._book(node, part, result)
        self._left[part.node] -= 1
        if self._left[part.node] == 0:
            if node.kind == Kind.COMMIT:
                self.trainer_state = self.workers[self.trainer_devices[0]].trainer_state.remote()
            self.state.finish_node(part.node)

    def _book(self, node: Node, part: Part, result) -> None:
        """Keep the part's output for the nodes that read it, and account it in the ledger."""
        if node.kind == Kind.GENERATE:
            for sample in result["ids"]:
                self.ledger.generated.setdefault(tuple(sample), []).append((part.device, result["version"]))
        elif node.kind == Kind.SCORE:
            for sample in result["ids"]:
                self.ledger.scored[tuple(sample)] = self.ledger.scored.get(tuple(sample), 0) + 1
        elif node.kind == Kind.TRAIN:
            self.train_pairs[node.id][part.index] = (result["ids"], result["timesteps"])
            self.uncommitted[part.device].append(part)
        elif node.kind == Kind.COMMIT:
            self.uncommitted[part.device] = []
            if part.device != self.trainer_devices[0]:
                return
            for train_id in node.deps:
                for ids, timesteps in self.train_pairs.pop(train_id, {}).values():
                    for sample in ids:
                        for k in timesteps:
                            key = (tuple(sample), k)
                            self.ledger.trained[key] = self.ledger.trained.get(key, 0) + 1
        elif node.kind == Kind.PUBLISH:
            self.publish_seconds.append(result)
