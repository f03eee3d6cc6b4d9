"""The Ray side of `dovetail train`: run the policy on DeviceWorkers, log each optimizer step, and
leave the run's trace, Gantt chart, sample ledger and profiled costs in the run directory."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import ray
from ray.exceptions import RayError

from dovetail.config.common import AUTO, ConfigError
from dovetail.config.load import parse_config
from dovetail.config.multiplex import TrainConfig
from dovetail.cost.calibration import DEFAULT
from dovetail.graph.node import Kind, SampleId
from dovetail.plan.metrics import summarize, time_per_step
from dovetail.plan.trace import Segment, Trace
from dovetail.request import RunRequest
from dovetail.rewards import RewardError
from dovetail.run_dir import RunDir
from dovetail.runtime.executor import RayExecutor
from dovetail.runtime.launch import Choice, device_pool, make_executor, prepare_run, start_workers
from dovetail.runtime.messages import Committed, DeviceMemory
from dovetail.runtime.pipeline import Ledger, memory_figures
from dovetail.runtime.ray_start import start_ray
from dovetail.runtime.recovery import StepLost
from dovetail.trackers import RunProgress


def window_occupancy(executor: RayExecutor, start: float, end: float) -> list[float]:
    """Each device's occupancy between two commits, from the trace: the time-weighted share of it that running
    nodes reserved (a node holding half a device for the whole window: 0.5)."""
    busy = [0.0] * executor.setup.devices
    for span in executor.state.trace.spans:
        overlap = min(span.end, end) - max(span.start, start)
        if overlap > 0:
            busy[span.device] += overlap * span.share
    return [b / (end - start) for b in busy]


class StepMetrics:
    """Turns the executor's state at a pipeline's commit into the step's line of its metrics.jsonl."""

    def __init__(self, policy, pipeline: str):
        self.policy = policy
        self.pipeline = pipeline
        self.last_commit_time: float | None = None
        """The pipeline's previous commit; before its first, the step's window opens as its first node starts (a
        pipeline may start after others: jigsaw's turns)."""
        self.tag_seen = 0

    def __call__(self, executor: RayExecutor, graph_step: int) -> dict:
        graph, now, run = executor.graph, executor.state.now, executor.pipelines[self.pipeline]
        scores = ray.get(executor.outputs_of([n.id for n in graph.of(self.pipeline, graph_step, Kind.SCORE)]))
        trained = ray.get(executor.outputs_of([n.id for n in graph.of(self.pipeline, graph_step, Kind.TRAIN)]))
        commits = answers(executor.outputs_of([n.id for n in graph.of(self.pipeline, graph_step, Kind.COMMIT)]))
        opened = self.last_commit_time
        if opened is None:
            opened = min(span.start for span in executor.state.trace.spans if span.pipeline == self.pipeline)
        window = now - opened
        occupancy = window_occupancy(executor, opened, now)
        tag = self.policy.tag_decisions
        metrics = run.adapter.step_metrics(scores, trained)
        metrics |= run.adapter.further_metrics([list(c.further) for c in commits if c is not None])
        scores = run.adapter.trained_scores(scores)
        metrics |= {  # every reward of the samples trained, as the reference path logs them
            f"reward/{name}": float(np.concatenate([s.scores[name] for s in scores]).mean())
            for name in scores[0].scores
        }
        metrics |= phase_seconds(executor, self.pipeline, graph_step) | {
            **commit_figures(commits),
            "samples_per_s": sum(len(s.samples) for s in scores) / window,
            "step_s": window,
            "occupancy": float(np.mean(occupancy)),
            "occupancy_per_device": [round(o, 4) for o in occupancy],
            "staleness": graph_step - executor.state.started[(self.pipeline, graph_step)],
            "publish_bytes": run.publish_bytes,
            "publish_s": run.publish_seconds[-1] if run.publish_seconds else 0.0,
        }
        metrics |= memory_figures(device_memory(run.workers, run.trainer_devices, commits))
        if self.policy.assists_generation:
            metrics["tag_decisions"] = [k for _, k in tag[self.tag_seen :]]
        self.last_commit_time, self.tag_seen = now, len(tag)
        return metrics


def answers(commit_refs: list) -> list[Committed | None]:
    """Each trainer replica's answer to the step's commit (`Committed`), fetched once; None for a replica that died
    after committing (its ref holds the error)."""
    committed: list[Committed | None] = []
    for ref in commit_refs:
        try:
            committed.append(ray.get(ref))
        except RayError:
            committed.append(None)
    return committed


def commit_figures(commits: list[Committed | None]) -> dict[str, float]:
    """The step's commit as its first trainer replica that answered tells it: the pre-clip gradient norm (every
    replica's is the same), the lr it stepped at, and the seconds it spent adding the devices' gradients and stepping
    the optimizer (NaN if none answered)."""
    for committed in commits:
        if committed is not None:
            return {
                "grad_norm": float(committed.grad_norm),
                "learning_rate": committed.lr,
                "commit_sync_s": committed.sync_s,
                "commit_optimizer_s": committed.optimizer_s,
            }
    return {
        "grad_norm": float("nan"),
        "learning_rate": float("nan"),
        "commit_sync_s": float("nan"),
        "commit_optimizer_s": float("nan"),
    }


MEMORY_WAIT_S = 2.0
"""How long a step's metrics wait for the memory of the devices outside its commit (answered on a thread of their
own at once); a device restarting meanwhile is reported as None."""


def device_memory(
    workers: list, trainer_devices: tuple[int, ...], commits: list[Committed | None]
) -> list[DeviceMemory | None]:
    """Each device's memory at the step's end: a trainer device's from its commit's answer (`Committed.memory`),
    every other device's by one small call (`DeviceWorker.memory`); None for a device that answered neither."""
    memory: list[DeviceMemory | None] = [None] * len(workers)
    for device, committed in zip(trainer_devices, commits):
        if committed is not None:
            memory[device] = committed.memory
    asked = {workers[d].memory.remote(): d for d in range(len(workers)) if memory[d] is None}
    ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=MEMORY_WAIT_S) if asked else ([], [])
    for ref in ready:
        try:
            memory[asked[ref]] = ray.get(ref)
        except RayError:
            continue
    return memory


def phase_seconds(executor: RayExecutor, pipeline: str, graph_step: int) -> dict[str, float]:
    """`{kind}_s`: the seconds devices spent on the step's nodes of each kind, summed over devices (the reference
    path's phase timings are the same on its one device)."""
    seconds: dict[str, float] = {}
    for span in executor.state.trace.spans:  # a step's publish follows its commit: `publish_s` is another figure
        if span.pipeline == pipeline and span.step == graph_step and span.kind != Kind.PUBLISH:
            seconds[f"{span.kind}_s"] = seconds.get(f"{span.kind}_s", 0.0) + span.end - span.start
    return dict(sorted(seconds.items()))


class StopRequest(Protocol):
    @property
    def requested(self) -> int | None:
        """The signal that asked the run to stop after the step in flight, if one did."""


class RunLog(Protocol):
    """What the driver reads and calls of a pipeline's log of its steps (`runner.StepLog`): the model and optimizer
    it records with, where it writes, and its record of each step."""

    @property
    def config(self) -> Any: ...

    @property
    def run(self) -> RunDir: ...

    @property
    def model(self) -> Any: ...

    @property
    def optimizer(self) -> Any: ...

    @property
    def progress(self) -> RunProgress: ...

    @property
    def interrupt(self) -> StopRequest: ...

    holds: int
    """The step whose weights `model` holds (the driver sets it when it loads a step's state into the model)."""
    last_step: int
    """The pipeline's last step (the driver ends it early when its reward failed)."""

    def needs_weights(self, done: int) -> bool: ...

    def trainer_state(self) -> dict:
        """The state the pipeline's trainers start from: `model` and `optimizer`'s, and what else its trainer holds
        (an LM run's critic, a flow run's EMA)."""
        ...

    def load_trainer_state(self, state: dict) -> None:
        """A committed trainer state into `model`, `optimizer` and the rest (`trainer_state`)."""
        ...

    def record(self, done: int, metrics: dict, checkpoint_extra: dict | None = None) -> None: ...

    def checkpoint(self, done: int, extra: dict | None = None) -> Path: ...


def train_on_ray(
    request: RunRequest,
    logs: Mapping[str, RunLog],
    first_steps: dict[str, int],
    after_record: Callable[[], None],
    devices_starting: Future | None = None,
) -> dict:
    """Train every pipeline of the run from its first step up to `request.steps` under its policy, each step
    recorded in its log and `after_record()` run after it (an exception it raises ends the run there). Returns
    run-level figures for the summary. `devices_starting`: Ray and the device workers being started on another
    thread (`ray_start.start_devices_in_background`), waited for first.

    A run is one or more segments, each on one set of devices: `RayRun.start` brings up Ray and the pool,
    `run_segment` starts the workers, profiles, plans and runs the executor; when a step's inputs went with a lost
    device (`StepLost`), `go_on_without` books what was committed and re-plans on the devices left."""
    run = RayRun.start(request, logs, first_steps, devices_starting)
    while True:
        try:
            trace = run.run_segment(after_record)
            break
        except StepLost as lost:
            if run.complete_before(lost):
                trace = run.ended_with_loss(lost)
                break
            run.go_on_without(lost)
    return run.finish(trace)


class RayRun:
    """One run on Ray across its segments: what carries from one set of devices to the next (the config, the pool,
    each pipeline's committed trainer state and first step, what earlier segments did)."""

    def __init__(self, request: RunRequest, logs: Mapping[str, RunLog], first_steps: dict[str, int], pool, states):
        self.request, self.logs = request, logs
        self.config = request.config
        """The run's config on its current devices: `auto` resolved, and after a lost device its new shape."""
        self.pool = pool
        self.states = states
        """Each pipeline's trainer state (weights + optimizer) the next segment's workers start from."""
        self.first_steps = dict(first_steps)
        """Each pipeline's first step of the next segment: moves on when the run goes on without a lost device."""
        self.earlier = Earlier(run_devices=pool.bundles, run_first_step=next(iter(first_steps.values())))
        self.label = f"began on {len(pool.bundles)} devices"
        self.startup_s: float | None = None
        self.lost_at_end = False
        self.executor: RayExecutor | None = None
        self.began = 0.0

    @classmethod
    def start(
        cls, request: RunRequest, logs: Mapping[str, RunLog], first_steps: dict[str, int], devices_starting
    ) -> RayRun:
        """Ray and the run's device pool up, each pipeline's trainer state taken from its log's model."""
        if len({request.steps - first for first in first_steps.values()}) != 1:
            raise ValueError(f"every pipeline of a run resumes from the same step; got {first_steps}")
        for name, log in logs.items():
            log.progress.phase(name, "starting Ray")
        if devices_starting is not None:
            devices_starting.result()
        start_ray(request.config)
        states = {name: log.trainer_state() for name, log in logs.items()}
        return cls(request, logs, first_steps, device_pool(request.config), states)

    def phase(self, what: str) -> None:
        for name, log in self.logs.items():
            log.progress.phase(name, what)

    def note(self, line: str) -> None:
        next(iter(self.logs.values())).progress.note(line)

    def run_segment(self, after_record: Callable[[], None]) -> Trace:
        """Start the workers on the pool, profile the devices, plan, and run the executor to the run's last step (or
        until a step is lost, `StepLost`)."""
        self.executor = None
        self.phase(f"starting {len(self.pool.bundles)} device workers")
        self.started = start_workers(self.config, self.pool, self.states)
        if self.request.hooks.after_start is not None:
            self.request.hooks.after_start(self.started)
        self.phase("profiling the devices and planning the step")
        steps_left = self.request.steps - min(self.first_steps.values())
        self.costs, self.prepared, self.choice, publications = prepare_run(
            self.config, steps_left, self.started, self.pool.nodes(), self.request.reprofile
        )
        if self.choice is not None:  # policy=auto: from here on the run is the chosen policy's, and says so once
            self.config = self.config.model_copy(update={"policy": self.choice.policy})
            self.note(self.choice.line())
        for name, publication in publications.items():  # `auto` measured both paths: it says which it keeps
            if publication.collective_s is not None:
                self.note(publication.line(name if len(self.logs) > 1 else None))
        self.phase("first step")
        on_commit = Recorder(self.logs, self.first_steps, self.prepared.policy, self.config.policy, after_record)
        hooks = {"on_commit": on_commit, "after_part": self.request.hooks.after_part}
        self.executor = make_executor(
            self.config,
            self.prepared,
            self.started,
            self.first_steps,
            self.pool,
            self.earlier.ledgers,
            publications,
            **hooks,
        )
        if self.startup_s is None:
            self.startup_s = time.perf_counter() - self.request.began
        self.began = time.perf_counter()
        try:
            return self.executor.run(self.prepared.policy)
        finally:  # every step the executor committed is in its log before the run ends or goes on
            on_commit.close()

    def complete_before(self, lost: StepLost) -> bool:
        """Whether every step was committed (and saved) before the loss: nothing is left to go on with."""
        executor = self.executor
        return executor is not None and all(
            self.first_steps[name] + executor.committed_steps(name) >= self.request.steps for name in self.logs
        )

    def ended_with_loss(self, lost: StepLost) -> Trace:
        assert self.executor is not None  # `complete_before` held
        self.earlier.lost += len(lost.devices)
        self.note(f"{lost.why} after the last step; the run is complete")
        self.lost_at_end = True
        return self.executor.state.trace

    def go_on_without(self, lost: StepLost) -> None:
        """After `lost`: keep what the segment committed, and carry on from the last step every pipeline committed
        on the devices left, re-planned (the same policy and pools where they fit, `on_fewer_devices`)."""
        self.earlier.lost += len(lost.devices)
        if self.executor is not None:
            self.states = {name: self.executor.committed_state(name) for name in self.logs}
            self.earlier.segment(self.executor, self.began, self.pool, self.first_steps, self.label)
            self.earlier.book(self.executor, self.first_steps)
        self.pool = self.pool.without(lost.devices)
        if not self.pool.bundles:
            raise RuntimeError(
                f"{lost.why}: no device left; check the cluster (`ray status`) and resume with --resume RUN_DIR"
            ) from None
        if len(set(self.first_steps.values())) != 1:
            raise RuntimeError(
                f"{lost.why} while the pipelines stood at different steps {self.first_steps}: a multiplexed run goes "
                "on only from a step every pipeline committed; resume with --resume RUN_DIR"
            ) from None
        if lost.devices:
            self.config = on_fewer_devices(self.config, len(self.pool.bundles))
        step = next(iter(self.first_steps.values()))
        devices = len(self.pool.bundles)
        for name in self.logs:
            self.earlier.ledgers.setdefault(name, Ledger()).went_on.append((step, devices, lost.why))
        left = f"{devices} device{'s' if devices > 1 else ''} left"
        self.label = f"{lost.why}: going on from step {step} on the {left} under {self.config.policy}"
        self.note(self.label)

    def finish(self, trace: Trace) -> dict:
        """The run's outputs written (trace, chart, ledgers, profile) and its figures for the summary; a pipeline
        whose reward failed saved at its last committed step."""
        executor = self.executor
        assert executor is not None  # a segment ran
        for pipeline in self.started.values():  # every publication is loaded: no member waits at their rendezvous
            pipeline.incarnations.forget_publications()
        stopped = {name: save_stopped(executor, name, self.logs, self.first_steps[name]) for name in executor.stopped}
        if stopped and len(self.logs) == 1:
            raise RewardError(next(iter(stopped.values())))
        self.earlier.segment(executor, self.began, self.pool, self.first_steps, self.label)
        outputs = write_run_outputs(
            self.logs,
            self.config,
            self.prepared,
            executor,
            trace,
            self.costs,
            self.choice,
            self.earlier,
            self.lost_at_end,
        )
        return (
            outputs
            | ({"stopped": stopped} if stopped else {})
            | {"startup_s": self.startup_s, "devices_lost": self.earlier.lost}
        )


class Recorder:
    """Records each optimizer step of a run's pipeline in its log (`StepLog`), with the trainer state where the log
    needs it (a checkpoint, an evaluation); `after_record()` runs next.

    The step's metrics and trainer state are read from the executor at its commit; the record itself (an evaluation,
    a checkpoint, the curves: seconds of the driver's) runs on a thread of its own, one step after another, so that
    the driver's loop goes on placing the pipelines' work meanwhile (a multiplexed run's other pipeline, the next
    step's rollout). What a record raises (a failing reward, a stop the user asked for) is raised in the loop at the
    next commit or by `drain`; once the user asked to stop, the loop waits for each record, so the run stops at the
    step it saves."""

    def __init__(
        self, logs: Mapping[str, RunLog], first_steps: dict[str, int], policy, policy_name: str, after_record
    ) -> None:
        self.logs, self.first_steps, self.policy_name, self.after_record = logs, first_steps, policy_name, after_record
        self.step_metrics = {name: StepMetrics(policy, name) for name in logs}
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="record")
        self.submitted: list[Future] = []
        self.failed = False
        """A record raised: the ones after it do nothing (the run ends at the step before it)."""

    def __call__(self, pipeline: str, rl_step: int, executor: RayExecutor) -> None:
        self._raise_failed()
        done, log = rl_step + 1, self.logs[pipeline]
        metrics = self.step_metrics[pipeline](executor, rl_step - self.first_steps[pipeline])
        state = executor.committed_state(pipeline) if log.needs_weights(done) else None
        self.submitted.append(self.thread.submit(self._record, log, done, metrics, state))
        if log.interrupt.requested is not None:
            self.drain()

    def _record(self, log, done: int, metrics: dict, state: dict | None) -> None:
        if self.failed:
            return
        try:
            if state is not None:
                log.load_trainer_state(state)
                log.holds = done
            log.record(done, metrics, {"policy": self.policy_name, "version": done})
            if self.after_record is not None:
                self.after_record()
        except BaseException:
            self.failed = True
            raise

    def _raise_failed(self) -> None:
        """Raise what a finished record raised; keep the ones still to finish."""
        pending = []
        for future in self.submitted:
            if not future.done():
                pending.append(future)
            elif (error := future.exception()) is not None:
                raise error
        self.submitted = pending

    def drain(self) -> None:
        """Wait for every record submitted; raise what a failed one raised."""
        submitted, self.submitted = self.submitted, []
        for future in submitted:
            future.result()

    def close(self) -> None:
        """`drain`, then end the thread: the executor this recorder served is done."""
        try:
            self.drain()
        finally:
            self.thread.shutdown()


@dataclass
class Earlier:
    """What the run did on the devices it had before it went on without lost ones: each pipeline's ledger of its
    committed steps, the samples those steps had to cover, the devices lost, and each stretch of the run on one set
    of devices (`segments`, the last one's added as the run ends), for the run's whole trace."""

    run_devices: tuple
    """The pool's devices (placement group bundles) when the run began: a later pool's device is known by its bundle."""
    run_first_step: int
    ledgers: dict[str, Ledger] = field(default_factory=dict)
    expected: dict[str, dict[SampleId, list[int]]] = field(default_factory=dict)
    lost: int = 0
    segments: list[Segment] = field(default_factory=list)

    def book(self, executor: RayExecutor, first_steps: dict[str, int]) -> None:
        """Keep what `executor` committed and move each pipeline's first step past it."""
        for name, run in executor.pipelines.items():
            first_steps[name] += executor.committed_steps(name)
            self.ledgers[name] = run.ledger.before(first_steps[name])
            self.expected.setdefault(name, {}).update(executor.expected_samples(name))

    def segment(self, executor: RayExecutor, began: float, pool, first_steps: dict[str, int], label: str) -> None:
        """Keep the trace `executor` ran from `began` (`time.perf_counter()`) on `pool`, from the run's step
        `first_steps`, and what began it (`label`)."""
        devices = tuple(self.run_devices.index(bundle) for bundle in pool.bundles)
        first_step = next(iter(first_steps.values())) - self.run_first_step
        self.segments.append(Segment(executor.state.trace, began, first_step, devices, label))


def on_fewer_devices(config, devices: int) -> TrainConfig:
    """The run's config on the `devices` that remain: the same policy and pools where they fit, else the policy's own
    pools, else the policy `policy=auto` picks there."""
    same = config.model_dump(mode="json")
    same["cluster"]["devices"] = devices
    own_pools = copy.deepcopy(same)
    for runtime in [own_pools.get("runtime", {}), *(p.get("runtime", {}) for p in own_pools.get("pipelines", []))]:
        runtime.pop("trainer_devices", None)
        runtime.pop("reward_devices", None)
    for tree in (same, own_pools, own_pools | {"policy": AUTO}):
        try:
            return parse_config(tree)
        except ConfigError:
            continue
    raise RuntimeError(f"no policy runs this config on the {devices} devices left; resume with --resume RUN_DIR")


def save_stopped(executor: RayExecutor, name: str, logs: Mapping[str, RunLog], first_step: int) -> str:
    """Save a pipeline whose reward failed at its last committed step, where its run ends; returns what to tell the
    user, in one line (a multiplexed pipeline resumes alone, from the config in its sub-directory)."""
    log = logs[name]
    done = first_step + executor.committed_steps(name)
    log.load_trainer_state(executor.committed_state(name))
    checkpoint = log.checkpoint(done, {"policy": log.config.policy, "version": done})
    log.last_step = done
    return (
        f"{executor.stopped[name]}; pipeline {name} stopped, its last committed step is saved in {checkpoint}: "
        f"fix the reward and resume with `dovetail train --resume {log.run.path}`"
    )


def node_seconds(trace) -> dict[str, tuple[float, list[int]]]:
    """Node id -> (wall seconds from first start to last end, the devices it ran on)."""
    spans: dict[str, list] = {}
    for span in trace.spans:
        spans.setdefault(span.node, []).append(span)
    return {
        node: (max(s.end for s in group) - min(s.start for s in group), sorted({s.device for s in group}))
        for node, group in spans.items()
    }


def write_run_outputs(
    logs: Mapping[str, RunLog],
    config,
    prepared,
    executor: RayExecutor,
    trace,
    costs: dict,
    choice: Choice | None,
    earlier: Earlier,
    lost_at_end: bool = False,
) -> dict:
    """In the run directory: trace.json (Perfetto / chrome://tracing), gantt.png and run_profile.json for
    `dovetail simulate --from-run`; in each pipeline's directory (the run's own for a single pipeline) its sample
    ledger.json, and with several pipelines all of them in the run directory's ledger.json. After the run went on
    without a lost device, the trace and chart are of the whole run (a mark where it went on), the ledger too, and the
    profile, which `simulate --from-run` replays, of the devices it ended on, naming the segments before them.
    `lost_at_end`: a device was lost after the last step's commit (the summary's device_engines is then None)."""
    path = next(iter(logs.values())).run.path if len(logs) == 1 else next(iter(logs.values())).run.path.parent
    # first: a worker that died after the last step is brought back, unless its device was lost (none is asked)
    device_engines = None if lost_at_end else executor.held_engines()
    segments = earlier.segments
    whole = Trace.of_segments(segments, len(earlier.run_devices)) if len(segments) > 1 else trace
    whole.write_chrome(path / "trace.json")
    whole.write_gantt(path / "gantt.png", f"dovetail train, policy {config.policy}, {whole.devices} devices")
    ledgers = {}
    for name, log in logs.items():
        ledger = executor.pipelines[name].ledger
        expected = earlier.expected.get(name, {}) | executor.expected_samples(name)
        problems = ledger.problems(expected)
        ledgers[name] = ledger.to_json() | {"problems": problems}
        (log.run.path / "ledger.json").write_text(json.dumps(ledgers[name]))
        if problems:
            raise RuntimeError(f"sample ledger of {name} violated: {problems[:5]} (see {log.run.path / 'ledger.json'})")
    if len(logs) > 1:  # every pipeline's ledger in one file too
        (path / "ledger.json").write_text(json.dumps(ledgers))
    metrics = summarize(trace)
    publication = {
        name: asdict(run.publication) | {"loads": dict(sorted(run.loads.items()))}
        for name, run in executor.pipelines.items()
    }
    profile = {
        "policy": config.policy,
        "config": config.model_dump(mode="json"),
        "steps": len(trace.steps) // len(logs),
        "shapes": {name: asdict(prepared.setup.shapes[name]) for name in logs},
        "node_seconds": node_seconds(trace),
        "waits": [asdict(wait) for wait in trace.waits],  # env nodes' waits on no device (`env.free_waits`)
        "switch_seconds": executor.switch_seconds,
        "calibration": {name: _fitted(cost) for name, cost in costs.items()},
        "measured_step_time_s": time_per_step(trace),
        "measured_steady_step_s": metrics.steady_step_s,
        "auto": None if choice is None else asdict(choice),  # what policy=auto predicted for each policy it weighed
        "resumed_from": earlier.run_first_step,
        "publication": publication,
        "segments_before": [
            {"first_step": s.first_step, "steps": len(s.trace.steps) // len(logs), "devices": s.devices, "why": s.label}
            for s in segments[:-1]
        ],
    }
    (path / "run_profile.json").write_text(json.dumps(profile))
    return {
        "efficiency": metrics.efficiency,
        "bubble_ratio": metrics.bubble_ratio,
        "step_time_s": metrics.step_time_s,
        "max_staleness": metrics.max_staleness,
        "restarts": sum(len(run.ledger.restarts) for run in executor.pipelines.values()),
        "device_engines": device_engines,
        "publication": publication,
    }


def _fitted(cost) -> dict:
    """The calibration fields a profile moved off the defaults. JSON keys are strings: an interference table's
    (kind, alongside) keys are written "kind|alongside" (`replay.fitted_calibration` reads them back)."""
    fitted = {k: v for k, v in asdict(cost.calibration).items() if v != getattr(DEFAULT, k)}
    if "interference" in fitted:
        fitted["interference"] = {f"{kind}|{alongside}": s for (kind, alongside), s in fitted["interference"].items()}
    return fitted
