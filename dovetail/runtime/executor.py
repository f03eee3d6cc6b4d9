"""RayExecutor: the same policy objects as the simulator, carried out on DeviceWorker actors.

The loop is the simulator's (`plan.loop.settle`) with the wall clock for time: events -> policy.react ->
decisions, each checked and booked by `ClusterState` and launched as actor calls; whenever a call returns, the
finished node's event goes back to the policy. What a node asks of a worker is its pipeline kind's business
(`runtime.pipeline.PipelineAdapter`); commits and publications are the same for every kind and live here. Data moves
as Ray object refs; weights are published as versioned refs that rollout engines load between trajectories, and
where the run's measured setting says so also broadcast to the targets (`runtime.publication`).

An env node (`Kind.ENV`: trajectories waiting on their environment, `env.free_waits`) holds no device: as its wait
begins (`ClusterState.take_waits`, no decision places it) the executor sends the adapter's `wait_work` to the
pipeline's `EnvironmentWorker`, an actor of no device that holds its episodes, and the wait ends when it answers.

Several pipelines may share the devices (a multiplexed run): each has its own workers, weights versions and
trainer state (`PipelineRun`), and a pipeline whose reward fails stops alone after its last committed step.

A worker that dies is restarted by Ray; the executor gives it the last committed trainer state, forms the device
group again, re-runs the train parts whose gradients it held (their results are already booked, so no sample
counts twice) and sends its unfinished parts again. Rollouts and scores live in the object store and survive it.

A sharded trainer (`train.sharding: fsdp`) is one FSDP group of devices: each member holds 1/N of the weights,
gradients and AdamW moments, the group runs each trainer node together (a part per member, in lockstep), and after
each commit every member puts its own shards in the object store (1/N of a replica's state each, never a whole one).
Every member holds a piece of every part's gradient, so a member that dies takes the open step with it: the run goes
on from its last committed step (`StepLost`, the driver's path for a lost device, with every device still there).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias

import ray
from ray.exceptions import ObjectLostError, RayActorError, RayError, RayTaskError

from dovetail.config.multiplex import PipelineConfig
from dovetail.graph.node import Graph, Kind, Node, SampleId
from dovetail.kinds import kind
from dovetail.plan.loop import settle
from dovetail.plan.state import ClusterState
from dovetail.plan.trace import Trace
from dovetail.rewards import RewardError
from dovetail.runtime.messages import Commit, Loaded, LoadWeights, Trained, TrainerWork
from dovetail.runtime.pipeline import Ledger, Part, PipelineAdapter
from dovetail.runtime.publication import Layout, Publication, layout_of, send
from dovetail.runtime.recovery import RECOVERY_DEADLINE_S, Incarnations, LostWatch, StepLost, revive
from dovetail.runtime.worker import ENVIRONMENT_RESTARTS, EnvironmentWorker, WorkerRestarted
from dovetail.sched.policy import Migrate, Policy, Run, Setup, StepCommitted, SwitchRole

MAX_RESENDS = 5
"""Times one part is sent again after its worker died before the run gives up on it."""
OFF_DEVICE = -1
"""The device of a part that runs on no device: an env node's, on its pipeline's `EnvironmentWorker`."""
ENVIRONMENT_ACTOR: Any = EnvironmentWorker
"""`ray.remote` made EnvironmentWorker an actor class (`.remote`), which the type checker cannot see."""
COPY_WAIT_S = 60.0
"""The longest the driver waits for its node's copy of a committed trainer state (`_keep_committed_state`)."""

Held: TypeAlias = "ray.ObjectRef | tuple[ray.ObjectRef, ...]"
"""A trainer state in the object store: a replica's whole, or a sharded trainer's members' shards in rank order."""

Take = Callable[[ray.actor.ActorHandle], tuple[ray.ObjectRef, ray.ObjectRef]]
"""What the driver takes from a trainer replica (a DeviceWorker): refs of a flag that the call succeeded and of the
object it gave."""


def take_trainer_state(worker: ray.actor.ActorHandle) -> tuple[ray.ObjectRef, ray.ObjectRef]:
    return worker.taken_trainer_state.remote()


def take_weights(worker: ray.actor.ActorHandle) -> tuple[ray.ObjectRef, ray.ObjectRef]:
    return worker.taken_weights.remote()


def fetched(held: Held) -> dict:
    """A trainer state from the object store, whole: a sharded trainer's members' shards joined (`merged_state`)."""
    if isinstance(held, tuple):
        from dovetail.models.sharding import merged_state  # a sharded run's: its imports take 1.4 s

        return merged_state(ray.get(list(held)))
    return ray.get(held)


class TrainersLost(RuntimeError):
    """Every trainer replica of a pipeline died before the driver had what it asked of them."""


@dataclass
class PipelineRun:
    """One pipeline's side of a run: its config, driver adapter and DeviceWorkers (one per device: a multiplexed
    pipeline has a worker process of its own on every device), its published weights versions, its last committed
    trainer state and its sample ledger. Pipelines share the devices and nothing else."""

    name: str
    config: PipelineConfig
    workers: list
    incarnations: Incarnations
    """The process of each worker now (a new one is a restart: `recovery.revive`) and their group."""
    first_step: int
    versions: dict[int, ray.ObjectRef]
    """Published weights by graph version (0: the run's initial weights)."""
    trainer_state: Held
    state_of_commit: str | None = None
    """The commit node whose new state `trainer_state` already holds: once one trainer replica finished a commit,
    its state is the step's, for every replica (a restarted one takes it and has nothing left to commit)."""
    recorded_state: Held = field(init=False)
    """The trainer state after the pipeline's recorded steps (`committed_steps`): `trainer_state` runs ahead of it
    from the moment one replica finished a commit until the commit's last replica has, and a run that goes on
    without a lost device in between goes on from the recorded step, so from this state. The object store holds
    both states in that window (a commit's length), one otherwise."""
    adapter: PipelineAdapter = field(init=False)
    ledger: Ledger = field(default_factory=Ledger)
    trainer_devices: tuple[int, ...] = ()
    uncommitted: dict[int, list[Part]] = field(default_factory=lambda: defaultdict(list))
    """Device -> train parts whose gradients its worker holds, not yet consumed by a commit."""
    publication: Publication = Publication("object_store", "object_store")
    """How publications reach the rollout devices (`cluster.publication`, measured at start-up under `auto`)."""
    publish_bytes: int = 0
    publish_seconds: list[float] = field(default_factory=list)
    loads: Counter = field(default_factory=Counter)
    """Rollout devices' weight loads by the path their weights came (`object_store`, `collective`)."""
    layout: Layout = ()
    shards: dict[int, ray.ObjectRef] = field(default_factory=dict)
    """A sharded trainer's commit under way: the shards of the members that finished it, by device."""

    @property
    def sharded(self) -> bool:
        return self.config.train.sharding == "fsdp"

    def __post_init__(self) -> None:
        self.adapter = kind(self.config.kind).load("adapter")(self.config, self.first_step)
        self.recorded_state = self.trainer_state
        initial = ray.get(self.versions[0])
        self.publish_bytes = sum(v.nbytes for v in initial.values())
        self.layout = layout_of(initial)


@dataclass
class Switching:
    """A device's role switch under way: its workers (one per pipeline) still switching, and the longest round trip
    of those done (they switch side by side: the device's switch takes the longest)."""

    workers: int = 0
    longest_s: float = 0.0


def _discard(ref: ray.ObjectRef) -> None:
    """Read and drop an answer nothing waits for. Ray prints a failed task's error nobody read, Ray's traceback and
    all, once its ref is freed: the other devices' failures of a reward that failed on every device would follow the
    run's one-line message so."""
    try:
        ray.get(ref)
    except RayError:
        pass


class RayExecutor:
    def __init__(
        self,
        graph: Graph,
        setup: Setup,
        pipelines: dict[str, PipelineRun],
        *,
        lost: Callable[[], LostWatch],
        nodes: Callable[[], list[str | None]],
        on_commit: Callable[[str, int, RayExecutor], None] | None = None,
        after_part: Callable[[RayExecutor, Part], None] | None = None,
    ) -> None:
        """`on_commit(pipeline, rl_step, self)` runs after each optimizer step; `after_part` is a hook for
        fault-injection tests; a worker that dies must be back within `RECOVERY_DEADLINE_S`, unless `lost()` (a new
        watch of the pool's devices) finds its device lost: then `run` raises `StepLost`, as it does when a node took
        what the open step needs with it. `nodes()`: the node each device is on now (where a publication crosses
        nodes)."""
        self.lost = lost
        self.nodes = nodes
        self.graph = graph
        self.setup = setup
        self.pipelines = pipelines
        self.on_commit = on_commit
        self.after_part = after_part
        self.outputs: dict[str, list[ray.ObjectRef | None]] = {}
        self.results: dict[str, list] = {}
        """Train node -> its parts' `Trained` results, booked in the ledger when their commit lands."""
        self.switch_seconds: list[float] = []
        self.stopped: dict[str, RewardError] = {}
        """Pipelines whose reward failed, with the error; they stopped after their last committed step."""
        self._pending: dict[ray.ObjectRef, Part | SwitchRole] = {}
        self._switching: dict[ray.ObjectRef, str] = {}
        """A role switch's pending refs -> the pipeline whose worker switches: every pipeline on the device does."""
        self._switches: dict[int, Switching] = {}
        """Device -> its role switch under way."""
        self._resent: dict[tuple[str, int, int], int] = {}
        self._left: dict[str, int] = {}
        self.environments: dict[str, ray.actor.ActorHandle] = {}
        """Pipeline -> its `EnvironmentWorker`, where its graph's trajectories wait on their environment off the
        devices (env nodes)."""

    def run_of(self, node_id: str) -> PipelineRun:
        return self.pipelines[self.graph[node_id].pipeline]

    # ------------------------------------------------------------ what adapters ask (runtime.pipeline.RunContext)
    def weights(self, pipeline: str, version: int) -> ray.ObjectRef:
        """The published weights a pipeline's step opened on."""
        return self.pipelines[pipeline].versions[version]

    def rollout_version(self, pipeline: str, step: int) -> int:
        return self.state.started[(pipeline, step)]

    def shape_of(self, pipeline: str):
        return self.setup.shapes[pipeline]

    # ------------------------------------------------------------ the loop
    def run(self, policy: Policy) -> Trace:
        try:
            return self._run_policy(policy)
        finally:
            self._close_environments()

    def _run_policy(self, policy: Policy) -> Trace:
        self._start_environments()
        self.state = state = ClusterState(self.graph, self.setup)
        start = time.perf_counter()

        def log_commits(events) -> None:
            for event in events:
                if isinstance(event, StepCommitted) and self.on_commit is not None:
                    run = self.pipelines[event.pipeline]
                    self.on_commit(event.pipeline, run.first_step + event.step, self)
                    state.now = time.perf_counter() - start  # reading the step's metrics took wall time too

        state.begin()
        while True:
            settle(state, policy, self._launch, log_commits)
            self._start_waits()
            if state.done:
                self._drain()
                return state.trace
            if not self._pending:
                raise RuntimeError(f"policy {policy.name} stalled: {state.stuck_message()}")
            (ref,), _ = ray.wait(list(self._pending), num_returns=1)
            part = self._pending.pop(ref)
            switching = self._switching.pop(ref, None)
            if isinstance(part, Part) and self.graph[part.node].pipeline in self.stopped:
                _discard(ref)  # the answer of a pipeline that stopped: nothing waits for it
                continue
            try:
                result = ray.get(ref)
            except ObjectLostError:  # what it read was on a node that is gone: the step is done again
                raise StepLost(
                    f"a node of the run was lost with step {self.graph[part.node].step} in flight"
                    if isinstance(part, Part)
                    else "a node of the run was lost"
                ) from None
            except RayActorError:
                if isinstance(part, Part) and part.device == OFF_DEVICE:
                    raise RuntimeError(
                        f"pipeline {self.graph[part.node].pipeline}'s environment worker died during {part.node} "
                        f"after {ENVIRONMENT_RESTARTS} restarts; resume from the last checkpoint with --resume RUN_DIR"
                    ) from None
                self._recover(part, time.perf_counter() - start, switching)
                continue
            except RayTaskError as error:
                cause = error.cause
                if isinstance(cause, RewardError) and isinstance(part, Part):  # the worker's own error: one line,
                    self._stop(part, cause)  # without Ray's traceback (a reward runs in a part, never a switch)
                    continue
                if isinstance(error, WorkerRestarted):  # sent before the executor saw the death
                    self._recover(part, time.perf_counter() - start, switching)
                    continue
                if not (isinstance(part, Part) and self._lost_a_peer(part, time.perf_counter() - start)):
                    raise
                self._submit(part)  # its all-reduce lost a peer that died; the group is formed again
                continue
            state.now = time.perf_counter() - start
            if isinstance(part, SwitchRole):
                self._switched(part, result)
                continue
            self._complete(part, ref, result)
            if self.after_part is not None:
                self.after_part(self, part)

    def _drain(self) -> None:
        """The parts still in flight once the run is done (a stopped pipeline's: its other devices scoring with the
        reward that failed) are waited for and discarded, so that none of their errors is printed after the run's
        one line; a part that will not end within RECOVERY_DEADLINE_S is left behind."""
        if self._pending:
            ended, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=RECOVERY_DEADLINE_S)
            for ref in ended:
                _discard(ref)
        self._pending.clear()

    def _stop(self, part: Part, error: RewardError) -> None:
        """A pipeline's reward failed: it stops after its last committed step (its trainer state stays that
        step's), the others go on. The driver saves the stopped pipeline and says so."""
        pipeline = self.graph[part.node].pipeline
        self.stopped[pipeline] = error
        self.state.stop(pipeline)

    def held_engines(self) -> dict[str, list[list[str]]]:
        """The engines each pipeline's devices hold, its workers brought back first if one died after the last step."""
        for run in self.pipelines.values():
            self._revive(run, self.state.now, "end")
        return {name: ray.get([w.held_engines.remote() for w in run.workers]) for name, run in self.pipelines.items()}

    def committed_steps(self, pipeline: str) -> int:
        return sum(1 for record in self.state.trace.steps if record.pipeline == pipeline)

    def _lost_a_peer(self, part: Part, now: float) -> bool:
        """Whether a failed part is a commit whose all-reduce lost a peer that died: then the pipeline's workers are
        brought back (the dead one's parts rebuilt before its commit is sent again) and the commit may be re-sent."""
        run = self.run_of(part.node)
        if not (isinstance(part.work, Commit) or (run.sharded and isinstance(part.work, TrainerWork))):
            return False
        self._revive(run, now, part.node)  # a sharded trainer's member that restarted ends the step there
        self._count_resend(part)
        return bool(run.ledger.restarts) and not run.sharded

    def worker_of(self, part: Part):
        """The DeviceWorker that carries out a part."""
        return self.run_of(part.node).workers[part.device]

    def _submit(self, part: Part) -> None:
        if part.device == OFF_DEVICE:
            ref = self._environments_of(self.graph[part.node].pipeline).run.remote(part.work)
        else:
            ref = self.worker_of(part).run.remote(part.work, (part.node, part.index))
        self._pending[ref] = part

    # ------------------------------------------------------------ environment waits, off the devices
    def off_device(self, pipeline: str, work) -> ray.ObjectRef:
        """What the pipeline's environment worker answers to `work` (an adapter's, `RunContext.off_device`)."""
        return self._environments_of(pipeline).run.remote(work)

    def _environments_of(self, pipeline: str):
        """The pipeline's `EnvironmentWorker` (`_start_environments`): its episodes live there for the run."""
        return self.environments[pipeline]

    def _start_environments(self) -> None:
        """An `EnvironmentWorker` for each pipeline whose graph waits on environments off the devices, ready before
        the run's clock starts, as its DeviceWorkers are: a worker starting (its imports, the environment's
        process) would hold up the first step's rollouts by seconds."""
        waiting = {node.pipeline for node in self.graph if not node.holds_device}
        for pipeline in sorted(waiting - set(self.environments)):
            config = self.pipelines[pipeline].config.model_dump(mode="json")
            self.environments[pipeline] = ENVIRONMENT_ACTOR.remote(config)
        ray.get([actor.ready.remote() for actor in self.environments.values()])

    def _start_waits(self) -> None:
        """The env nodes whose wait began (`ClusterState.take_waits`: no decision places them), each sent to its
        pipeline's environment worker, which steps its trajectories' episodes and answers once their waits have
        passed; their devices are the policy's meanwhile."""
        for node_id, _ in self.state.take_waits():
            node = self.graph[node_id]
            self._left[node_id] = 1
            self.outputs[node_id] = [None]
            self._submit(Part(node_id, OFF_DEVICE, self.run_of(node_id).adapter.wait_work(node, self)))

    def _close_environments(self) -> None:
        """Stop the environments' processes with their workers at the end of a run (or its failure)."""
        for actor in self.environments.values():
            try:
                ray.get(actor.stop.remote(), timeout=RECOVERY_DEADLINE_S)
            except (RayError, TimeoutError):
                pass
            ray.kill(actor)
        self.environments.clear()

    def _switch(self, switch: SwitchRole, pipelines: Sequence[str]) -> None:
        """Switch the device's workers of `pipelines` (all of them, for a decision: a device holds an engine per
        pipeline, and each rollout engine must sleep while the device trains, whichever pipeline trains)."""
        under_way = self._switches.setdefault(switch.device, Switching())
        for name in pipelines:
            ref = self.pipelines[name].workers[switch.device].switch_role.remote(switch.role.value)
            self._pending[ref] = switch
            self._switching[ref] = name
            under_way.workers += 1

    def _switched(self, switch: SwitchRole, seconds: float) -> None:
        """One worker of the device switched; once all have, the device has (they switched side by side: the
        switch took the longest round trip)."""
        under_way = self._switches[switch.device]
        under_way.workers -= 1
        under_way.longest_s = max(under_way.longest_s, seconds)
        if not under_way.workers:
            del self._switches[switch.device]
            self.switch_seconds.append(under_way.longest_s)
            self.state.finish_switch(switch.device, switch.role, switch.resident_gb)

    def _recover(self, part: Part | SwitchRole, now: float, switching: str | None) -> None:
        """A worker died (or answered from a new, bare incarnation): bring its pipeline back, send the part again
        (at most MAX_RESENDS times: a part that fails again and again is a bug, not a fault, and must not spin).
        `switching`: the pipeline whose worker a failed role switch was sent to."""
        self._count_resend(part)
        if isinstance(part, SwitchRole):
            assert switching is not None
            self._switches[part.device].workers -= 1
            self._revive(self.pipelines[switching], now, "switch")
            self._switch(part, [switching])
            return
        run = self.run_of(part.node)
        self._revive(run, now, part.node)
        if part.node == run.state_of_commit:
            # another replica finished this commit and its state is the one just restored here: nothing to redo
            done = next(ref for ref in self.outputs[part.node] if ref is not None)
            self._complete(part, done, None)
            return
        if isinstance(part.work, LoadWeights):  # a new incarnation has nothing staged
            part = replace(part, work=replace(part.work, staged=False))
        self._submit(part)

    def _count_resend(self, part: Part | SwitchRole) -> None:
        key = (part.node, part.device, part.index) if isinstance(part, Part) else ("switch", part.device, 0)
        self._resent[key] = self._resent.get(key, 0) + 1
        if self._resent[key] > MAX_RESENDS:
            raise RuntimeError(f"{key[0]} on device {part.device} failed {MAX_RESENDS} times after restarts; giving up")

    def committed_state(self, pipeline: str) -> dict:
        """The pipeline's trainer state (weights + optimizer) after its recorded steps, `committed_steps`: what its
        log records, checkpoints and a run that goes on without a lost device starts from."""
        run = self.pipelines[pipeline]
        if run.recorded_state is run.trainer_state:
            return self._newest_state(run)
        try:
            return fetched(run.recorded_state)
        except ObjectLostError:
            raise TrainersLost(
                f"pipeline {pipeline}: its last recorded state was on a node that is gone, and every trainer replica "
                "has gone on to the next commit; resume from the last checkpoint with --resume RUN_DIR"
            ) from None

    def _newest_state(self, run: PipelineRun) -> dict:
        """The pipeline's newest trainer state, its step committed or still committing on some replica: in the object
        store since the commit (`_keep_committed_state`), which outlives the workers; if it was on a node that is
        gone, from a trainer replica that holds it still (each holds it; a restarted one is passed over)."""
        try:
            return fetched(run.trainer_state)
        except ObjectLostError:
            if run.sharded:  # each member holds its shards of the step after this one's commit, or none
                raise TrainersLost(
                    f"pipeline {run.name}: a shard of its committed state was on a node that is gone; resume from "
                    "the last checkpoint with --resume RUN_DIR"
                ) from None
            recorded = run.recorded_state is run.trainer_state
            try:
                _, run.trainer_state = self._from_a_trainer(run, take_trainer_state, run.trainer_devices)
            except TrainersLost:
                raise TrainersLost(
                    f"pipeline {run.name}: its committed state was on a node that is gone, with every trainer "
                    "replica; resume from the last checkpoint with --resume RUN_DIR"
                ) from None
            if recorded:
                run.recorded_state = run.trainer_state
            return fetched(run.trainer_state)

    def _revive(self, run: PipelineRun, now: float, during: str) -> None:
        """Bring the pipeline's workers back with its committed trainer state and group (`recovery.revive`) and
        rebuild the gradients of the restarted devices' train parts of the open step (sent before anything else)."""
        config = run.config.model_dump(mode="json")

        def state() -> ray.ObjectRef:  # asked only where a worker restarted (a sharded trainer's is joined for it)
            return ray.put(self._newest_state(run))

        restarted = revive(run.workers, run.incarnations, config, state, RECOVERY_DEADLINE_S, self.lost())
        run.ledger.restarts += [(round(now, 3), device, during) for device in restarted]
        if run.sharded and restarted:
            # every member holds a piece of each part's gradient: the open step is lost with any of them, and the
            # run goes on from its last committed step on every device (the dead ones are back)
            raise StepLost(
                f"device {', '.join(map(str, restarted))} of pipeline {run.name}'s sharded trainer restarted"
            )
        for device in restarted:
            for lost in run.uncommitted[device]:
                run.ledger.reruns.append((device, lost.node))
                self._submit(replace(lost, rerun=True))

    # ------------------------------------------------------------ decisions -> actor calls
    def _launch(self, decision) -> None:
        if isinstance(decision, SwitchRole):
            self._switch(decision, list(self.pipelines))
        elif isinstance(decision, Run):
            self._run(self.graph[decision.node], decision.devices)
        elif isinstance(decision, Migrate):
            raise NotImplementedError("the runtime does not migrate running nodes yet")

    def _run(self, node: Node, devices: tuple[int, ...]) -> None:
        run = self.pipelines[node.pipeline]
        if node.kind == Kind.COMMIT:
            trained = [result for train in node.deps for result in self.results.get(train, [])]
            scale = run.adapter.commit_scale(trained)
            updates = run.adapter.updates_per_step
            groups = run.adapter.fsdp_groups(self, node.pipeline, tuple(devices)) if run.sharded else []
            group_of = {d: group for group in groups for d in group}
            parts = [
                Part(node.id, d, Commit(node.pipeline, tuple(devices), scale, updates, group=group_of.get(d, ())))
                for d in devices
            ]
            run.trainer_devices = tuple(devices)
        elif node.kind == Kind.PUBLISH:
            sender, weights = self._published_weights(run)
            run.versions[node.version + 1] = weights
            version = run.first_step + node.version + 1
            group = run.publication.receivers(sender, tuple(devices), self.nodes)
            if group:
                send(run.workers, group, run.incarnations.publication_prefix(group), version, run.layout, weights)
            parts = [Part(node.id, d, LoadWeights(node.pipeline, version, weights, d in group[1:])) for d in devices]
        else:
            parts = run.adapter.parts(node, devices, self)
        self._left[node.id] = len(parts)
        self.outputs[node.id] = [None] * len(parts)
        for index, part in enumerate(parts):
            part.index = index
            self._submit(part)

    def outputs_of(self, node_ids: Sequence[str]) -> list[ray.ObjectRef]:
        """The result refs of finished nodes, in the given order."""
        return [ref for node_id in node_ids for ref in self.outputs[node_id]]

    def sources(self, node: Node, kinds: Sequence[Kind]) -> dict[Kind, list[ray.ObjectRef]]:
        """Result refs of the nodes of `kinds` of the node's step that it (transitively) reads, by node id."""
        found: dict[Kind, list[str]] = {kind: [] for kind in kinds}
        seen: set[str] = set()
        frontier = list(node.deps)
        while frontier:
            dep = self.graph[frontier.pop()]
            if dep.id in seen or dep.step != node.step or dep.kind not in found:
                continue
            seen.add(dep.id)
            found[dep.kind].append(dep.id)
            frontier += dep.deps
        return {kind: self.outputs_of(sorted(ids)) for kind, ids in found.items()}

    # ------------------------------------------------------------ completions
    def _complete(self, part: Part, ref: ray.ObjectRef, result) -> None:
        run = self.run_of(part.node)
        if part.rerun:
            run.uncommitted[part.device].append(replace(part, rerun=False))
            return
        node = self.graph[part.node]
        self.outputs[node.id][part.index] = ref
        if isinstance(result, Trained):
            self.results.setdefault(node.id, []).append(result)
            run.uncommitted[part.device].append(part)
        elif node.kind == Kind.COMMIT:
            if run.sharded:
                self._keep_shard(run, node.id, part.device, result.group)
            elif run.state_of_commit != node.id:
                self._keep_committed_state(run, node.id, part.device)
            if part.device == run.trainer_devices[0]:
                self._book_training(run, node)
        elif node.kind == Kind.PUBLISH:
            loaded: Loaded = result
            run.publish_seconds.append(loaded.seconds)
            run.loads[loaded.path] += 1
            if (
                isinstance(part.work, LoadWeights) and part.work.staged and loaded.path != "collective"
            ):  # its broadcast failed: the next forms a new group
                run.incarnations.drop_publishing()
        else:
            run.adapter.book(node, part, result, run.ledger)
        self._left[part.node] -= 1
        if self._left[part.node] == 0 and not node.holds_device:
            self.state.finish_wait(part.node)
        elif self._left[part.node] == 0:
            recorded = len(self.state.trace.steps)
            self.state.finish_node(part.node)
            if len(self.state.trace.steps) > recorded:  # the pipeline's step is recorded, its state with it
                run.recorded_state = run.trainer_state

    def _keep_committed_state(self, run: PipelineRun, commit: str, device: int) -> None:
        """The new trainer state, taken into the object store from the first replica that finished the commit
        (`device`): the object store outlives the workers, so a replica that dies from now on, still committing or
        not, comes back with this step's state, and the step's gradients are spent.

        The object lives on that replica's node, and a run that loses the node goes on from it: the other replicas
        hold it in their processes, but a process may die with the node (a torch.distributed peer of a dead process
        may) and a replica's queue may hold the next step's work ahead of a request for it. So the driver's node
        pulls a copy before the commit counts as done: Ray recovers a lost object from a copy on a node that is still
        there, and the driver's node is the one whose loss ends the run anyway. A replicated trainer is a model small
        enough to replicate, so the pull is short; on the driver's node there is nothing to pull. (Ray may evict the
        copy under memory pressure, or the pull may not finish in COPY_WAIT_S: then the replicas are asked, as
        before.)"""
        others = [d for d in run.trainer_devices if d != device]
        _, run.trainer_state = self._from_a_trainer(run, take_trainer_state, [device, *others])
        ray.wait([run.trainer_state], fetch_local=True, timeout=COPY_WAIT_S)
        run.state_of_commit = commit
        run.uncommitted.clear()

    def _keep_shard(self, run: PipelineRun, commit: str, device: int, group: tuple[int, ...]) -> None:
        """A member of a sharded trainer finished the commit. The members of one FSDP group — the first trainer
        device's: under HYBRID every group holds the same trainer — put their new shards into the object store; once
        that group's are all there, they are the pipeline's committed state and the step's gradients are spent."""
        if min(run.trainer_devices) not in group:
            return
        try:
            _, run.shards[device] = self._from_a_trainer(run, take_trainer_state, [device])
        except TrainersLost:  # its shards of this commit went with it, and with them the step
            self._revive(run, self.state.now, commit)
            raise
        if run.shards.keys() == set(group):
            run.trainer_state = tuple(run.shards[d] for d in sorted(group))
            run.shards = {}
            run.state_of_commit = commit
            run.uncommitted.clear()

    def _published_weights(self, run: PipelineRun) -> tuple[int, ray.ObjectRef]:
        """The committed weights, for a publish, and the trainer replica that exported them: the first that answers,
        or, if every one died since the commit (its state already in the object store), one brought back with that
        state."""
        if run.sharded:  # every member gathers each tensor with the others; the first keeps them
            members = sorted(run.trainer_devices)
            taken = [take_weights(run.workers[d]) for d in members]
            try:
                ray.get([succeeded for succeeded, _ in taken])
            except (RayActorError, RayTaskError):
                self._revive(run, self.state.now, "publish")  # a member restarted: the step is lost
                raise
            return members[0], taken[0][1]
        try:
            return self._from_a_trainer(run, take_weights, run.trainer_devices)
        except TrainersLost:
            self._revive(run, self.state.now, "publish")
            return self._from_a_trainer(run, take_weights, run.trainer_devices)

    def _from_a_trainer(self, run: PipelineRun, take: Take, devices: Sequence[int]) -> tuple[int, ray.ObjectRef]:
        """The first of `devices` (trainer replicas) that answers, and a ref of what it gives (`take_trainer_state`,
        `take_weights`), known to hold the answer: a replica that died since the commit is passed over for the next
        (a replica still committing answers once its commit is done: they reach the same state); a ref that held an
        error would poison every part that reads it."""
        for device in devices:
            succeeded, payload = take(run.workers[device])
            try:
                ray.get(succeeded)
                return device, payload
            except (RayActorError, RayTaskError):
                continue
        raise TrainersLost(
            f"pipeline {run.name}: every trainer device died right after its commit; resume from a checkpoint"
        )

    def _book_training(self, run: PipelineRun, commit: Node) -> None:
        for train_id in commit.deps:
            for result in self.results.pop(train_id, []):
                for sample in result.samples:
                    for unit in result.units:
                        key = (SampleId(*sample), unit)
                        run.ledger.trained[key] = run.ledger.trained.get(key, 0) + 1

    def expected_samples(self, pipeline: str) -> dict[SampleId, list[int]]:
        """Every sample of the pipeline's committed steps that was drawn, with the units training it must cover (all
        its steps, unless it stopped)."""
        run = self.pipelines[pipeline]
        committed = self.committed_steps(pipeline)
        creating = kind(run.config.kind).creates_samples
        samples = {
            SampleId(run.first_step + s, p, i)
            for node in self.graph
            if node.pipeline == pipeline and node.kind in creating and node.step < committed
            for (s, p, i) in node.samples
        }
        units = {sample: run.adapter.units_of(sample) for sample in sorted(samples)}
        return {sample: unit for sample, unit in units.items() if unit is not None}
