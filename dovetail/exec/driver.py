"""The Ray side of `dovetail train`: run the policy on DeviceWorkers, log each optimizer step, and
leave the run's trace, Gantt chart, sample ledger and profiled costs in the run directory."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import ray

from dovetail.cost.calibration import DEFAULT
from dovetail.exec.launch import make_executor, prepare_run, start_ray, start_workers
from dovetail.exec.metrics import summarize, time_per_step
from dovetail.exec.pipeline import load_trainer_state, trainer_state_of
from dovetail.exec.ray_executor import RayExecutor
from dovetail.graph.node import Kind
from dovetail.rewards import RewardError


def window_busy(executor: RayExecutor, start: float, end: float) -> list[float]:
    """Busy share of each device between two commits, from the trace."""
    busy = [0.0] * executor.setup.devices
    for span in executor.state.trace.spans:
        overlap = min(span.end, end) - max(span.start, start)
        if overlap > 0:
            busy[span.device] += overlap * span.share
    return [b / (end - start) for b in busy]


class StepMetrics:
    """Turns the executor's state at a commit into the step's line of metrics.jsonl."""

    def __init__(self, policy, pipeline: str):
        self.policy = policy
        self.pipeline = pipeline
        self.last_commit_time = 0.0
        self.tag_seen = 0

    def __call__(self, executor: RayExecutor, graph_step: int) -> dict:
        graph, now = executor.graph, executor.state.now
        scores = ray.get(executor.outputs_of([n.id for n in graph.of(self.pipeline, graph_step, Kind.SCORE)]))
        trained = ray.get(executor.outputs_of([n.id for n in graph.of(self.pipeline, graph_step, Kind.TRAIN)]))
        window = now - self.last_commit_time
        busy = window_busy(executor, self.last_commit_time, now)
        tag = self.policy.tag_decisions
        metrics = executor.adapter.step_metrics(scores, trained, executor, graph_step) | {
            "samples_per_s": sum(len(s.samples) for s in scores) / window,
            "step_s": window,
            "efficiency": float(np.mean(busy)),
            "bubble_ratio_per_device": [round(1 - b, 4) for b in busy],
            "staleness": graph_step - executor.state.started[(self.pipeline, graph_step)],
            "publish_bytes": executor.publish_bytes,
            "publish_s": executor.publish_seconds[-1] if executor.publish_seconds else 0.0,
            "tag_decisions": [k for _, k in tag[self.tag_seen :]],
        }
        self.last_commit_time, self.tag_seen = now, len(tag)
        return metrics


def train_on_ray(config, log, first_step: int, last_step: int, *, after_part=None) -> dict:
    """Train steps [first_step, last_step) under config.policy; returns run-level figures for the summary."""
    start_ray(config)
    workers, weights, trainer_state = start_workers(config, trainer_state_of(log.model, log.optimizer))
    cost, prepared = prepare_run(config, last_step - first_step, workers)
    step_metrics = StepMetrics(prepared.policy, config.pipeline_name)

    def on_commit(rl_step: int, executor: RayExecutor) -> None:
        done = rl_step + 1
        metrics = step_metrics(executor, rl_step - first_step)
        if log.needs_weights(done):
            load_trainer_state(log.model, log.optimizer, ray.get(executor.trainer_state))
        log.record(done, metrics, {"policy": config.policy, "version": done})

    executor = make_executor(
        config, prepared, workers, weights, trainer_state, first_step, on_commit=on_commit, after_part=after_part
    )
    try:
        trace = executor.run(prepared.policy)
    except RewardError as error:
        done = first_step + len(executor.state.trace.steps)
        load_trainer_state(log.model, log.optimizer, ray.get(executor.trainer_state))
        checkpoint = log.checkpoint(done, {"policy": config.policy, "version": done})
        raise RewardError(
            f"{error}; the last committed step is saved in {checkpoint}: fix the reward and resume "
            f"with --resume {log.run.path}"
        ) from None
    return write_run_outputs(log.run.path, config, prepared, executor, trace, cost)


def node_seconds(trace) -> dict[str, tuple[float, list[int]]]:
    """Node id -> (wall seconds from first start to last end, the devices it ran on)."""
    spans: dict[str, list] = {}
    for span in trace.spans:
        spans.setdefault(span.node, []).append(span)
    return {
        node: (max(s.end for s in group) - min(s.start for s in group), sorted({s.device for s in group}))
        for node, group in spans.items()
    }


def write_run_outputs(path, config, prepared, executor: RayExecutor, trace, cost) -> dict:
    """trace.json (Perfetto / chrome://tracing), gantt.png, ledger.json, and run_profile.json for
    `dovetail simulate --from-run`."""
    trace.write_chrome(path / "trace.json")
    trace.write_gantt(path / "gantt.png", f"dovetail train, policy {config.policy}, {config.cluster.devices} devices")
    problems = executor.ledger.problems(executor.expected_samples())
    (path / "ledger.json").write_text(json.dumps(executor.ledger.to_json() | {"problems": problems}))
    if problems:
        raise RuntimeError(f"sample ledger violated: {problems[:5]} (see {path / 'ledger.json'})")
    metrics = summarize(trace)
    fitted = {k: v for k, v in asdict(cost.calibration).items() if v != getattr(DEFAULT, k)}
    profile = {
        "policy": config.policy,
        "config": config.model_dump(mode="json"),
        "steps": len(trace.steps),
        "shape": asdict(prepared.setup.shapes[config.pipeline_name]),
        "node_seconds": node_seconds(trace),
        "switch_seconds": executor.switch_seconds,
        "calibration": fitted,
        "measured_step_time_s": time_per_step(trace),
    }
    (path / "run_profile.json").write_text(json.dumps(profile))
    return {
        "efficiency": metrics.efficiency,
        "bubble_ratio": metrics.bubble_ratio,
        "run_samples_per_s": metrics.samples_per_s,
        "step_time_s": metrics.step_time_s,
        "max_staleness": metrics.max_staleness,
        "restarts": len(executor.ledger.restarts),
        "device_engines": ray.get([worker.held_engines.remote() for worker in executor.workers]),
    }
