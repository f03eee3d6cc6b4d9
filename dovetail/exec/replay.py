"""`dovetail simulate --from-run RUN_DIR`: replay a real run's graph in the simulator, with the costs
that run measured, and compare the predicted step time with the one the run achieved.

This is the check that the simulator is a trustworthy planner: the same policy, the same graph, the
measured per-kind costs; only the executor differs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from pydantic import ValidationError

from dovetail.config.train import ConfigError, parse_config
from dovetail.cost.calibration import DEFAULT, Calibration
from dovetail.cost.model import CostModel
from dovetail.exec.metrics import time_per_step
from dovetail.exec.sim import SimExecutor
from dovetail.graph.node import Kind
from dovetail.scenario import prepare
from dovetail.sched import shape_from_fields

COST_KIND = {
    Kind.GENERATE: "generate",
    Kind.PREFILL: "prefill",
    Kind.DECODE: "decode",
    Kind.MIGRATE: "migrate",
    Kind.SCORE: "score",
    Kind.LOGPROB: "logprob",
    Kind.TRAIN: "train",
    Kind.COMMIT: "optimizer",
    Kind.PUBLISH: "publish",
}
"""The cost model's op kind of each node kind: what a measured node corrects."""


def replay_run(run_dir: Path | str) -> dict:
    path = Path(run_dir) / "run_profile.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: --from-run needs a run directory written by `dovetail train --policy "
            "colocated|disaggregated|digen`"
        )
    profile = json.loads(path.read_text())
    try:
        config = parse_config(profile["config"])
    except (ConfigError, ValidationError) as error:
        raise ValueError(
            f"{path} was written by an older dovetail whose config this one cannot read: {error}"
        ) from None
    scenario = config.scenario(profile["steps"])
    kinds = {spec.name: spec.kind for spec in scenario.pipelines}
    shapes = {name: shape_from_fields(kinds[name], shape) for name, shape in profile["shapes"].items()}
    options = config.policy_options()
    calibrations = {name: fitted_calibration(fitted) for name, fitted in profile["calibration"].items()}
    analytic = prepare(
        scenario,
        config.policy,
        steps=profile["steps"],
        options=options,
        cost={name: CostModel(config.cluster.device, c) for name, c in calibrations.items()},
        shapes=shapes,
    )
    measured = profile["node_seconds"]
    records: dict[str, list] = {name: [] for name in shapes}
    for node in analytic.graph:
        if node.id not in measured or node.cost_s <= 0:
            continue
        seconds, devices = measured[node.id]
        if seconds > 0:
            records[node.pipeline].append((COST_KIND[node.kind], predicted_seconds(node, len(devices)), seconds))
    for name, engines in analytic.setup.engines.items():
        wake = max(engines.wake_s.values())
        records[name] += [("switch", wake, max(s, 1e-6)) for s in profile["switch_seconds"]]
    costs = {
        name: CostModel.from_measurements(config.cluster.device, records[name], calibrations[name]) for name in shapes
    }
    replayed = prepare(scenario, config.policy, steps=profile["steps"], options=options, cost=costs, shapes=shapes)
    missing = set(measured) - set(replayed.graph.nodes)
    if missing:
        raise ValueError(
            f"the replayed graph lacks nodes the run ran, e.g. {sorted(missing)[:3]}: the policy's shape changed"
        )
    pace = device_pace(replayed.graph, measured, replayed.setup.devices)
    # A measured node time already holds the slowdown of whatever shared its device: replayed nodes run at full
    # speed side by side, or interference would count twice (and a shared node at its share, twice again).
    trace = SimExecutor(replayed.graph, replayed.setup, device_pace=pace, slowdown=lambda kind, alongside: 1.0).run(
        replayed.policy
    )
    predicted = time_per_step(trace)
    measured_step = profile["measured_step_time_s"]
    return {
        "run": str(run_dir),
        "policy": config.policy,
        "steps": profile["steps"],
        "measured_step_time_s": measured_step,
        "predicted_step_time_s": predicted,
        "relative_error": (predicted - measured_step) / measured_step,
        "corrections": {name: cost.corrections() for name, cost in costs.items()},
        "device_pace": pace,
    }


def fitted_calibration(fitted: dict) -> Calibration:
    """A pipeline's calibration as the run wrote it (`driver._fitted`): its fields over DEFAULT, an interference
    table's "kind|alongside" keys back to (kind, alongside)."""
    if "interference" in fitted:
        fitted = fitted | {"interference": {tuple(key.split("|")): s for key, s in fitted["interference"].items()}}
    return replace(DEFAULT, **fitted)


def predicted_seconds(node, width: int) -> float:
    return node.seconds_on(width)


def device_pace(graph, measured: dict, devices: int) -> list[float]:
    """How much slower each device ran its own nodes than the corrected cost model says, relative to the others:
    the per-kind corrections fit the devices' mean, but a synchronous commit waits for the slowest. Fitted on the
    nodes that ran on one device alone (every measured node is in `graph`: replay_run checks it first); normalised
    so that the fitted per-kind totals stay the run's."""
    took, predicted = [0.0] * devices, [0.0] * devices
    for node_id, (seconds, where) in measured.items():
        if len(where) == 1 and graph[node_id].cost_s > 0:
            took[where[0]] += seconds
            predicted[where[0]] += predicted_seconds(graph[node_id], 1)
    if not any(predicted):
        return [1.0] * devices
    mean = sum(took) / sum(predicted)
    return [t / p / mean if p else 1.0 for t, p in zip(took, predicted)]
