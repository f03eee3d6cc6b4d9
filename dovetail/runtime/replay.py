"""`dovetail simulate --from-run RUN_DIR`: replay a real run's graph in the simulator, with the costs
that run measured, and compare the predicted step time with the one the run achieved.

This is the check that the simulator is a trustworthy planner: the same policy, the same graph, the
measured per-kind costs; only the executor differs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dovetail.config.common import MAX_STEPS, ConfigError
from dovetail.config.load import parse_config
from dovetail.config.multiplex import TrainConfig
from dovetail.cost.calibration import DEFAULT, Calibration
from dovetail.cost.model import CostModel
from dovetail.files import read_text
from dovetail.graph.node import Kind
from dovetail.plan.metrics import summarize, time_per_step
from dovetail.plan.prepare import prepare
from dovetail.plan.scenario import problem_lines, problem_report
from dovetail.plan.sim import SimExecutor
from dovetail.sched import from_fields, shape_from_fields

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


class RunProfile(BaseModel):
    """run_profile.json as `driver.write_run_outputs` writes it."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    config: dict
    steps: int = Field(ge=1, le=MAX_STEPS)
    shapes: dict[str, dict]
    node_seconds: dict[str, tuple[Annotated[float, Field(ge=0)], list[Annotated[int, Field(ge=0)]]]]
    switch_seconds: list[Annotated[float, Field(ge=0)]]
    calibration: dict[str, dict]
    measured_step_time_s: float = Field(gt=0)
    measured_steady_step_s: float | None = Field(None, gt=0)
    """Seconds between optimizer steps after the first (a profile written before it was recorded has none)."""
    auto: dict | None = None
    """What `policy=auto` predicted for each policy it weighed (`launch.Choice`), if the run chose so."""
    resumed_from: int = Field(0, ge=0, le=MAX_STEPS)
    """The step a `--resume` went on from (0: a fresh run): the profile is of this process's steps alone, since each
    resume writes run_profile.json anew."""
    segments_before: list[dict] = []
    """Where the run went on without lost devices: each earlier stretch's first step, committed steps, devices (the
    run's first pool's indices) and what began it; the profile's other fields are the last stretch's."""


@dataclass(frozen=True)
class Profile:
    """A run profile read whole, before the replay uses any of it."""

    config: TrainConfig
    shapes: dict
    calibrations: dict[str, Calibration]
    measured: RunProfile


def read_profile(path: Path) -> Profile:
    """The run profile at `path`, its config, shapes and calibrations built; a damaged one (cut short, edited, its
    pipelines or devices not its config's) is one ValueError naming the field, never a KeyError deep in the replay."""
    try:
        measured = RunProfile.model_validate_json(read_text(path, "the run_profile.json a run writes"))
    except ValidationError as error:
        raise _damaged(path, problem_lines(error)) from None
    try:
        config = parse_config(measured.config, rewards=False)  # a replay scores nothing: import none
    except ConfigError as error:
        raise ValueError(
            f"{path} was written by an older dovetail whose config this one cannot read: {error}"
        ) from None
    kinds = {spec.name: spec.kind for spec in config.scenario(1).pipelines}
    for field in ("shapes", "calibration"):
        names = sorted(getattr(measured, field))
        if names != sorted(kinds):
            raise _damaged(path, [f"{field}: pipelines {names}, its config's {sorted(kinds)}"])
    for node, (_, devices) in measured.node_seconds.items():
        if any(device >= config.cluster.devices for device in devices):
            raise _damaged(path, [f"node_seconds.{node}: devices {devices} in a {config.cluster.devices}-device run"])
    shapes, calibrations = {}, {}
    for name in kinds:
        try:
            shapes[name] = _built(("shapes", name), shape_from_fields, kinds[name], measured.shapes[name])
            calibrations[name] = _built(("calibration", name), fitted_calibration, measured.calibration[name])
        except ValueError as error:
            raise _damaged(path, str(error).splitlines()) from None
    return Profile(config, shapes, calibrations, measured)


def _built(where: tuple[str, str], build, *arguments):
    """build(*arguments), what is wrong with its fields (a ValueError) named under `where`."""
    try:
        return build(*arguments)
    except ValidationError as error:
        raise ValueError("\n".join(problem_lines(error, within=where))) from None
    except ValueError as error:
        raise ValueError(f"{'.'.join(where)}.{error}") from None


def _damaged(path: Path, problems: list[str]) -> ValueError:
    return ValueError(problem_report(f"{path} is damaged (rerun `dovetail train` to write a new one)", problems))


def replay_run(run_dir: Path | str) -> dict:
    path = Path(run_dir) / "run_profile.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: --from-run needs a run directory written by `dovetail train --policy "
            "colocated|disaggregated|digen`"
        )
    profile = read_profile(path)
    config, shapes, calibrations, run = profile.config, profile.shapes, profile.calibrations, profile.measured
    scenario = config.scenario(run.steps)
    options = config.policy_options()
    analytic = prepare(
        scenario,
        config.policy,
        steps=run.steps,
        options=options,
        cost={name: CostModel(config.cluster.device, c) for name, c in calibrations.items()},
        shapes=shapes,
    )
    measured = run.node_seconds
    records: dict[str, list] = {name: [] for name in shapes}
    for node in analytic.graph:
        if node.id not in measured or node.cost_s <= 0:
            continue
        seconds, devices = measured[node.id]
        if seconds > 0:
            # A decode that rolled trajectories out whole slept through their waits, which env.latency prices and
            # no correction of its compute should absorb: both sides without them (`Node.wait_s`).
            compute = predicted_seconds(node, len(devices)) - node.wait_s
            records[node.pipeline].append((COST_KIND[node.kind], compute, max(seconds - node.wait_s, 1e-6)))
    for name, engines in analytic.setup.engines.items():
        wake = max(engines.wake_s.values())
        records[name] += [("switch", wake, max(s, 1e-6)) for s in run.switch_seconds]
    costs = {
        name: CostModel.from_measurements(config.cluster.device, records[name], calibrations[name]) for name in shapes
    }
    replayed = prepare(scenario, config.policy, steps=run.steps, options=options, cost=costs, shapes=shapes)
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
    measured_step = run.measured_step_time_s
    result = {
        "run": str(run_dir),
        "policy": config.policy,
        "steps": run.steps,
        "resumed_from": run.resumed_from,
        "first_step": run.resumed_from + sum(segment["steps"] for segment in run.segments_before) + 1,
        "measured_step_time_s": measured_step,
        "predicted_step_time_s": predicted,
        "relative_error": (predicted - measured_step) / measured_step,
        "measured_steady_step_s": run.measured_steady_step_s,
        "predicted_steady_step_s": summarize(trace).steady_step_s,
        "corrections": {name: cost.corrections() for name, cost in costs.items()},
        "device_pace": pace,
    }
    if run.auto is not None:
        samples_per_step = sum(record.samples for record in trace.steps) / len(trace.steps)
        result["auto"] = auto_replayed(config, run, run.auto["predicted"], costs, samples_per_step / measured_step)
    return result


def auto_replayed(
    config: TrainConfig, run: RunProfile, predicted: dict[str, float], costs: dict[str, CostModel], measured: float
) -> dict:
    """`policy=auto`'s choice after the fact (`predicted`: samples/s of each policy it weighed, before the run): the
    chosen policy's predicted samples/s before the run beside what it measured, and the runner-up's prediction before
    the run beside its prediction on the costs the run measured (it did not run: that is the closest figure to a
    measurement of it)."""
    chosen = {"policy": config.policy, "predicted_samples_per_s": predicted[config.policy], "measured": measured}
    others = [name for name in predicted if name != config.policy]
    if not others:
        return {"chosen": chosen, "runner_up": None}
    # A tie goes to the first in the registry's order, as auto's choice does.
    name = max(others, key=predicted.__getitem__)
    rate = predicted[name]
    candidate = config.model_copy(update={"policy": name})
    prepared = prepare(
        candidate.scenario(run.steps),
        name,
        steps=run.steps,
        options=candidate.policy_options(),
        cost=costs,
        **candidate.shape_overrides(),
    )
    trace = SimExecutor(prepared.graph, prepared.setup).run(prepared.policy)
    on_measured = sum(record.samples for record in trace.steps) / trace.makespan
    runner_up = {"policy": name, "predicted_samples_per_s": rate, "on_measured_costs": on_measured}
    return {"chosen": chosen, "runner_up": runner_up}


def fitted_calibration(fitted: dict) -> Calibration:
    """A pipeline's calibration as the run wrote it (`driver._fitted`): its fields over DEFAULT, an interference
    table's "kind|alongside" keys back to (kind, alongside); a field of another name or type is a ValueError."""
    table = fitted.get("interference")
    if isinstance(table, dict):
        fitted = fitted | {"interference": {tuple(key.split("|")): s for key, s in table.items()}}
    return from_fields(Calibration, asdict(DEFAULT) | fitted)


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
