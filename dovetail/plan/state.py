"""ClusterState: the bookkeeping both executors share. It is the `View` a policy reads, it checks every
decision (roles, exclusivity, memory, staleness) and it records the Trace. An executor only adds time:
the simulator from predicted costs, the Ray runtime from real devices."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dovetail.graph.node import Graph, Kind, Role
from dovetail.plan.trace import Span, StepRecord, Switch, Trace, Wait
from dovetail.sched.policy import (
    Begin,
    Decision,
    DeviceIdle,
    Event,
    Migrate,
    NodeFinished,
    NodeReady,
    NodeStarted,
    RoleSwitched,
    Run,
    Setup,
    StartStep,
    StepCommitted,
    SwitchRole,
    VersionPublished,
    can_run,
)

EPS = 1e-9
ROLLOUT_KINDS = (Kind.GENERATE, Kind.PREFILL, Kind.DECODE, Kind.MIGRATE)


class DecisionError(ValueError):
    """A policy asked for something the cluster cannot do; the message names the decision and why."""


@dataclass(slots=True)
class DeviceState:
    """One device's bookkeeping. `idle` and `free_share` are read for every device at nearly every decision, so they
    are kept as the device changes (`ClusterState._occupy`, `ClusterState._release`, `set_switching`), not derived
    at each read. The node's taking and leaving are written out in those two loops over a node's devices, not called
    per device: a trainer node holds a whole pool of up to 256."""

    index: int
    capacity_gb: float
    role: Role | None = None
    resident_gb: float = 0.0
    running: dict[str, float] = field(default_factory=dict)
    """Node -> the share of the device it takes (`taken_share` is their sum)."""
    working_gb: float = 0.0
    switching: bool = False
    """Set through `set_switching`."""
    taken_share: float = 0.0
    idle: bool = True
    """Runs nothing and is not switching."""
    free_share: float = 1.0
    """What a decision may still place here: none while switching, else what the running nodes leave."""

    @property
    def memory_gb(self) -> float:
        return self.resident_gb + self.working_gb

    def set_switching(self, switching: bool) -> None:
        self.switching = switching
        self.idle = not self.running and not switching
        self.free_share = 0.0 if switching else 1.0 - self.taken_share


@dataclass
class Running:
    devices: tuple[int, ...]
    share: float
    start: float
    """Start of the current segment (a migrated node has several)."""
    work_left: float
    """Device-seconds of work not yet done at `start` (the node's cost, less what earlier segments did)."""
    first_start: float
    delay: float = 0.0
    """Seconds at the start of the segment that do no node work: the node's fixed cost (`Node.fixed_s`) and its
    waits on its environment (`Node.wait_s`, a whole-trajectory decode's) as it starts, a migration's re-prefill (in
    place of what is left of the fixed cost) as it moves."""
    speed: float = 1.0
    """Fraction of full speed the node runs at now: its share, or 1 / interference slowdown."""
    pace: float = 1.0
    """Noise multiplier of the segment's durations (the simulator's; 1 on real devices)."""
    progress_at: float = 0.0
    """Time up to which `work_left` is accounted (moves when the speed changes)."""
    work_done: float = 0.0
    """Exclusive seconds of node work done on each device in this segment (for `Span.work`)."""


class ClusterState:
    """Implements `sched.policy.View`. Call `begin`, then `apply` the policy's decisions and report
    completions with `finish_node` / `finish_switch`; collect the resulting events with `take_events`."""

    def __init__(self, graph: Graph, setup: Setup, slowdown: Callable[[str, str], float] | None = None) -> None:
        """`slowdown(kind, alongside_kind)`: the interference model. With it, `share` only admits nodes onto a
        device (shares sum to <= 1) and a shareable node runs at 1 / (its worst slowdown beside the nodes
        sharing its devices), 1 alone, re-timed whenever a neighbour comes or goes. Without it, a node runs
        at its share (time slicing)."""
        self.graph = graph
        self.setup = setup
        self.slowdown = slowdown
        self._retimed: dict[str, None] = {}
        self.now = 0.0
        self.devices = [DeviceState(i, setup.memory_gb) for i in range(setup.devices)]
        self.ready: dict[str, None] = {}
        self.ready_by_kind: dict[Kind, dict[str, None]] = {kind: {} for kind in Kind}
        """`ready` split by node kind, each in the order its nodes became ready: what a policy asks at every decision
        (`sched.policy.ready_of`), kept rather than filtered out of every ready node each time."""
        self.running: dict[str, Running] = {}
        self.finished: set[str] = set()
        self.published: dict[str, int] = {p: 0 for p in graph.pipelines()}
        self.started: dict[tuple[str, int], int] = {}
        self.trace = Trace(devices=setup.devices, peak_memory_gb=[0.0] * setup.devices)
        self._missing = {node.id: len(node.deps) for node in graph}
        self._last_commit: dict[tuple[str, int], str] = {}
        for node_id in graph.order:
            node = graph[node_id]
            if node.kind == Kind.COMMIT:
                self._last_commit[(node.pipeline, node.step)] = node_id
        self._step_start: dict[tuple[str, int], float] = {}
        self._events: list[Event] = []
        self.stopped: set[str] = set()
        """Pipelines withdrawn from the run (`stop`): their unfinished nodes count as done and never run."""
        self.waiting: dict[str, float] = {}
        """Env node -> when its wait began: trajectories waiting on their environment, on no device (`Node.wait_s`)."""
        self._new_waits: list[str] = []

    # ------------------------------------------------------------ events
    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def begin(self) -> None:
        self._events.append(Begin(0.0))
        for pipeline in self.published:
            self._events.append(VersionPublished(0.0, pipeline, 0))

    # ------------------------------------------------------------ decisions
    def apply(self, decision: Decision) -> None:
        if isinstance(decision, Run):
            self._run(decision)
        elif isinstance(decision, SwitchRole):
            self._switch(decision)
        elif isinstance(decision, StartStep):
            self._start_step(decision)
        elif isinstance(decision, Migrate):
            self._migrate(decision)
        else:
            raise DecisionError(f"unknown decision {decision!r}")

    def remaining(self, node_id: str) -> float:
        """Predicted seconds until a running node finishes at its current speed."""
        running = self.running[node_id]
        delay_left = max(0.0, running.start + running.delay * running.pace - self.now)
        return delay_left + running.work_left * running.pace / (self._width(node_id) * running.speed)

    def set_pace(self, node_id: str, pace: float) -> None:
        """Stretch the current segment of a running node by `pace` (the simulator's duration noise)."""
        self._progress(node_id)
        self.running[node_id].pace = pace
        self._retimed[node_id] = None

    def take_waits(self) -> list[tuple[str, float]]:
        """Env nodes whose wait began since the last call, with its seconds: the executor ends each after them
        (`finish_wait`)."""
        started, self._new_waits = self._new_waits, []
        return [(node_id, self.graph[node_id].wait_s) for node_id in started if node_id in self.waiting]

    def take_retimed(self) -> list[str]:
        """Running nodes whose finish time changed (started, migrated, or sped up / slowed by neighbours)."""
        retimed, self._retimed = [n for n in self._retimed if n in self.running], {}
        return retimed

    def _width(self, node_id: str) -> int:
        """Devices the node's work spreads over (a collective's cost_s is its wall time already)."""
        node, devices = self.graph[node_id], len(self.running[node_id].devices)
        return 1 if node.collective else min(devices, node.max_width or devices)

    def _progress(self, node_id: str) -> None:
        """Account the work done since `progress_at` at the current speed."""
        running = self.running[node_id]
        working_since = max(running.progress_at, running.start + running.delay * running.pace)
        done = min(
            running.work_left, max(0.0, self.now - working_since) * self._width(node_id) * running.speed / running.pace
        )
        running.work_left -= done
        running.work_done += done * running.pace / self._width(node_id)
        running.progress_at = self.now

    def _speed(self, node_id: str) -> float:
        running = self.running[node_id]
        if self.slowdown is None:
            return running.share
        node = self.graph[node_id]
        if node.exclusive:  # nothing runs beside it (`_check_devices`): full speed, without looking at its devices
            return 1.0
        kind = node.kind.value
        return 1.0 / max((self.slowdown(kind, other) for other in self.alongside(node_id)), default=1.0)

    def _retime_around(self, devices: Sequence[int]) -> None:
        """Re-time the nodes on `devices` after a neighbour came or went, in the order of the devices and of the nodes
        on each (a set's order would change from one process to the next with the strings' hash seed, and with it
        the order of completions at one instant: the same seed must give the same trace)."""
        nearby: dict[str, float] = {}
        for index in devices:  # `update` keeps a node where it first came: the devices' order, then each device's
            running = self.devices[index].running
            if running:  # a device the node left is mostly empty now
                nearby.update(running)
        for node_id in nearby:
            speed = self._speed(node_id)
            if speed != self.running[node_id].speed:
                self._progress(node_id)
                self.running[node_id].speed = speed
                self._retimed[node_id] = None

    def alongside(self, node_id: str) -> set[str]:
        """Kinds of the other nodes sharing a device with `node_id` now. A device running the node alone, the common
        case, is passed over without looking at its nodes."""
        nodes, states, kinds = self.graph.nodes, self.devices, set()
        for index in self.running[node_id].devices:
            running = states[index].running
            if len(running) == 1 and node_id in running:
                continue
            for other in running:
                if other != node_id:
                    kinds.add(nodes[other].kind.value)
        return kinds

    def _start_step(self, d: StartStep) -> None:
        key = (d.pipeline, d.step)
        if key in self.started:
            raise DecisionError(f"{d}: step already started")
        if d.pipeline not in self.published:
            raise DecisionError(f"{d}: unknown pipeline {d.pipeline!r}")
        if d.pipeline in self.stopped:  # its steps all count as done, so a policy may open the next: nothing runs
            self.started[key] = d.version
            return
        if d.version > self.published[d.pipeline]:
            raise DecisionError(f"{d}: version {d.version} not published yet (latest {self.published[d.pipeline]})")
        if not 0 <= d.step - d.version <= self.setup.max_staleness:
            raise DecisionError(f"{d}: staleness must be 0..{self.setup.max_staleness}, got {d.step - d.version}")
        self.started[key] = d.version
        for node in self.graph.of(d.pipeline, d.step):
            if self._missing[node.id] == 0:
                self._make_ready(node.id)

    def stop(self, pipeline: str) -> None:
        """Withdraw a pipeline (its reward failed): its ready and running nodes leave their devices, and every node
        of it not finished counts as done without running, so the other pipelines go on and the run can end. A
        policy that opens one of its steps after this (they look done) opens nothing: no staleness bound applies to
        steps that never run, and its last committed step stays the last."""
        self.stopped.add(pipeline)
        for node_id in [n for n in self.ready if self.graph[n].pipeline == pipeline]:
            del self.ready[node_id]
            del self.ready_by_kind[self.graph[node_id].kind][node_id]
        for node_id in [n for n in self.waiting if self.graph[n].pipeline == pipeline]:
            del self.waiting[node_id]
        for node_id in [n for n in self.running if self.graph[n].pipeline == pipeline]:
            running = self.running.pop(node_id)
            self._release(node_id, running.devices)
            self._retime_around(running.devices)
        self.finished |= {node.id for node in self.graph if node.pipeline == pipeline}

    def _make_ready(self, node_id: str) -> None:
        if self.graph[node_id].pipeline in self.stopped:
            return
        if not self.graph[node_id].holds_device:  # an environment's wait: no decision places it
            self.waiting[node_id] = self.now
            self._new_waits.append(node_id)
            return
        self.ready[node_id] = None
        self.ready_by_kind[self.graph[node_id].kind][node_id] = None
        self._events.append(NodeReady(self.now, node_id))

    def _check_devices(self, what: object, node_id: str, devices: Sequence[int], share: float) -> None:
        node = self.graph[node_id]
        if not devices or len(set(devices)) != len(devices):
            raise DecisionError(f"{what}: devices must be distinct and non-empty")
        if not 0 < share <= 1 or (node.exclusive and share != 1):
            raise DecisionError(f"{what}: share must be in (0, 1] and exactly 1 for an exclusive node")
        nodes, states = self.graph.nodes, self.devices
        # The roles a device may hold to run it (`can_run`), None for any: a reward or multiplexed node runs whatever
        # a device holds. Tested per device as `can_run` would, without a call per device of a whole trainer pool.
        roles = None if can_run(node, None) else (node.role, Role.ANY)
        memory_gb, exclusive, count = node.memory_gb, node.exclusive, len(states)
        for index in devices:
            if not 0 <= index < count:
                raise DecisionError(f"{what}: no device {index}")
            device = states[index]
            if device.switching:
                raise DecisionError(f"{what}: device {index} is switching role")
            if roles is not None and device.role not in roles:
                raise DecisionError(f"{what}: device {index} holds {device.role}, node needs {node.role}")
            if device.running and (exclusive or any(nodes[other].exclusive for other in device.running)):
                raise DecisionError(f"{what}: device {index} is running {list(device.running)}")
            if share > device.free_share + EPS:
                raise DecisionError(f"{what}: device {index} has only {device.free_share:.3f} share free")
            if device.resident_gb + device.working_gb + memory_gb > device.capacity_gb + EPS:
                raise DecisionError(
                    f"{what}: device {index} would hold {device.memory_gb + memory_gb:.1f} GB "
                    f"of {device.capacity_gb:.1f} GB"
                )

    def _occupy(self, node_id: str, devices: Sequence[int], share: float) -> None:
        """The node takes `share` of each device and its working memory there (the device's figures kept)."""
        memory_gb, states, peak = self.graph[node_id].memory_gb, self.devices, self.trace.peak_memory_gb
        for index in devices:
            device = states[index]
            running = device.running
            running[node_id] = share
            # `sum` of one share is that share (0 + share): a device running one node, the common case, skips it.
            device.taken_share = taken = share if len(running) == 1 else sum(running.values())
            device.working_gb += memory_gb
            device.idle = False
            device.free_share = 0.0 if device.switching else 1.0 - taken
            held = device.resident_gb + device.working_gb
            if held > peak[index]:
                peak[index] = held

    def _release(self, node_id: str, devices: Sequence[int]) -> None:
        """The node leaves each device (the device's figures kept); a device left idle says so."""
        memory_gb, states, events, now = self.graph[node_id].memory_gb, self.devices, self._events, self.now
        for index in devices:
            device = states[index]
            running = device.running
            del running[node_id]
            device.working_gb -= memory_gb
            if running:  # still shared: what the others take
                device.taken_share = taken = sum(running.values())
                device.free_share = 0.0 if device.switching else 1.0 - taken
                device.idle = False
            else:  # the common case (a device runs one node): nothing taken, idle unless switching
                device.taken_share = 0
                if device.switching:
                    device.free_share = 0.0
                    device.idle = False
                else:
                    device.free_share = 1.0
                    device.idle = True
                    events.append(DeviceIdle(now, index))

    def _run(self, d: Run) -> None:
        if d.node not in self.ready:
            raise DecisionError(f"{d}: node is not ready")
        self._check_devices(d, d.node, d.devices, d.share)
        node = self.graph[d.node]
        del self.ready[d.node]
        del self.ready_by_kind[node.kind][d.node]
        self._occupy(d.node, d.devices, d.share)
        self.running[d.node] = Running(
            tuple(d.devices),
            d.share,
            self.now,
            node.cost_s,
            self.now,
            delay=node.fixed_s + node.wait_s,
            progress_at=self.now,
        )
        self._started_segment(d.node)
        self._step_start.setdefault((node.pipeline, node.step), self.now)
        self._events.append(NodeStarted(self.now, d.node, tuple(d.devices)))

    def _migrate(self, d: Migrate) -> None:
        if d.node not in self.running:
            raise DecisionError(f"{d}: node is not running")
        self._progress(d.node)
        running = self.running[d.node]
        self._record(d.node, running, self.now)
        self._release(d.node, running.devices)
        self._check_devices(d, d.node, d.devices, d.share)
        self._occupy(d.node, d.devices, d.share)
        self.running[d.node] = Running(
            tuple(d.devices), d.share, self.now, running.work_left, running.first_start, d.cost_s, progress_at=self.now
        )
        self._retime_around(running.devices)
        self._started_segment(d.node)

    def _started_segment(self, node_id: str) -> None:
        self.running[node_id].speed = self._speed(node_id)
        self._retimed[node_id] = None
        self._retime_around(self.running[node_id].devices)

    def _switch(self, d: SwitchRole) -> None:
        if not 0 <= d.device < len(self.devices):
            raise DecisionError(f"{d}: no device {d.device}")
        device = self.devices[d.device]
        if not device.idle:
            raise DecisionError(f"{d}: device is not idle (running {list(device.running)})")
        if d.resident_gb > device.capacity_gb + EPS:
            raise DecisionError(f"{d}: {d.resident_gb:.1f} GB does not fit in {device.capacity_gb:.1f} GB")
        device.set_switching(True)
        device.resident_gb = max(device.resident_gb, d.resident_gb)
        self.trace.peak_memory_gb[d.device] = max(self.trace.peak_memory_gb[d.device], device.memory_gb)
        device.role = None
        self.trace.switches.append(Switch(d.device, self.now, self.now + d.cost_s, d.role.value))

    # ------------------------------------------------------------ completions
    def finish_switch(self, device_index: int, role: Role, resident_gb: float) -> None:
        device = self.devices[device_index]
        device.set_switching(False)
        device.role = role
        device.resident_gb = resident_gb
        self._events.append(RoleSwitched(self.now, device_index, role))
        self._events.append(DeviceIdle(self.now, device_index))

    def _version_used(self, node_id: str) -> int:
        node = self.graph[node_id]
        if node.kind in ROLLOUT_KINDS:
            return self.started[(node.pipeline, node.step)]
        return node.version

    def _record(self, node_id: str, running: Running, end: float) -> None:
        node = self.graph[node_id]
        version = self._version_used(node_id)
        pipeline, step, phase, start, share, work = (
            node.pipeline,
            node.step,
            node.phase,
            running.start,
            running.share,
            running.work_done,
        )
        self.trace.spans += [
            Span(node_id, pipeline, step, phase, index, start, end, share, version, work) for index in running.devices
        ]

    def finish_node(self, node_id: str) -> None:
        self._progress(node_id)
        running = self.running.pop(node_id)
        node = self.graph[node_id]
        self._record(node_id, running, self.now)
        self.finished.add(node_id)
        self._release(node_id, running.devices)
        self._retime_around(running.devices)
        self._events.append(NodeFinished(self.now, node_id, running.devices, self.now - running.first_start))
        if self._last_commit.get((node.pipeline, node.step)) == node_id:
            self._commit(node.pipeline, node.step)
        if node.kind == Kind.PUBLISH:
            version = node.version + 1
            self.published[node.pipeline] = max(self.published[node.pipeline], version)
            self._events.append(VersionPublished(self.now, node.pipeline, version))
        self._release_dependants(node_id)

    def finish_wait(self, node_id: str) -> None:
        """An env node's wait is over: its trajectories' next turn may run."""
        if node_id not in self.waiting:  # its pipeline was withdrawn meanwhile
            return
        node = self.graph[node_id]
        self.trace.waits.append(Wait(node_id, node.pipeline, node.step, self.waiting.pop(node_id), self.now))
        self.finished.add(node_id)
        self._release_dependants(node_id)

    def _release_dependants(self, node_id: str) -> None:
        for child in self.graph.dependants[node_id]:
            self._missing[child] -= 1
            child_node = self.graph[child]
            if self._missing[child] == 0 and (child_node.pipeline, child_node.step) in self.started:
                self._make_ready(child)

    def _commit(self, pipeline: str, step: int) -> None:
        nodes = self.graph.of(pipeline, step)
        samples = {sample for node in nodes for sample in node.samples}
        tokens = sum(node.tokens for node in nodes)
        self.trace.steps.append(
            StepRecord(
                pipeline,
                step,
                self.started[(pipeline, step)],
                self._step_start[(pipeline, step)],
                self.now,
                len(samples),
                tokens,
            )
        )
        self._events.append(StepCommitted(self.now, pipeline, step, step + 1))

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.graph)

    def stuck_message(self) -> str:
        waiting = [nid for nid in self.graph.order if nid not in self.finished][:5]
        return (
            f"no node running and {len(self.graph) - len(self.finished)} unfinished at t={self.now:.2f}s "
            f"(ready: {list(self.ready)[:5]}, first unfinished: {waiting}, started steps: {sorted(self.started)})"
        )
