"""Scenarios: a cluster, one or more RL pipelines sharing it, and how to schedule them — in YAML.

Shipped scenarios live in `dovetail/scenarios/*.yaml`; `load_scenario` takes a shipped name or a path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dovetail.cost.catalog import device as lookup_device
from dovetail.cost.model import CostModel
from dovetail.exec.sim import SimExecutor
from dovetail.graph.node import Graph
from dovetail.graph.spec import FlowSpec, LLMSpec
from dovetail.sched import policy_class
from dovetail.sched.policy import Policy, Setup


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ClusterSpec(_Model):
    device: str = Field(
        description="Device from the catalogue: H100, H800, H200, A100-80G, L40S, Ascend-910B, cpu-core."
    )
    devices: int = Field(gt=0, description="Number of devices in the pool.")


class ScheduleSpec(_Model):
    steps: int = Field(3, gt=0, description="RL steps to simulate.")
    policies: list[str] = Field(
        min_length=1,
        description="Policies to compare (see `dovetail.sched.POLICIES`); the first is the baseline of speedups.",
    )
    trainer_devices: int | None = Field(
        None, gt=0, description="Trainer pool size of disaggregated policies; None lets them choose."
    )
    reward_devices: int = Field(
        0, ge=0, description="Devices that only score (flow policies); 0: reward engines share the rollout devices."
    )
    seed: int = 0
    noise: float = Field(
        0.0, ge=0, description="Log-normal sigma of simulated durations (0: exactly the predicted costs)."
    )


class PublishedRun(_Model):
    """A published measurement a calibration scenario reproduces."""

    source: str
    step_time_s: float = Field(gt=0)
    phases_s: dict[str, float] = Field(
        default_factory=dict, description="Published seconds per phase (generate, logprob, train, publish...)."
    )


class Scenario(_Model):
    name: str
    description: str = ""
    cluster: ClusterSpec
    pipelines: list[Annotated[FlowSpec | LLMSpec, Field(discriminator="kind")]] = Field(min_length=1)
    schedule: ScheduleSpec
    published: PublishedRun | None = None

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        names = [p.name for p in self.pipelines]
        if len(set(names)) != len(names):
            raise ValueError(f"pipelines: names must be unique, got {names}")
        check_pools(self.cluster.devices, self.schedule.trainer_devices, self.schedule.reward_devices, "schedule")
        return self


def check_pools(devices: int, trainer_devices: int | None, reward_devices: int, section: str) -> None:
    """The pools by role fit the cluster: the reward pool leaves devices to generate and train, a trainer pool
    leaves at least one rollout device. One check for scenarios and run configs; `section` names the fields."""
    if reward_devices >= devices:
        raise ValueError(
            f"{section}.reward_devices={reward_devices} must leave devices to generate and train of "
            f"cluster.devices={devices}: lower it or add devices"
        )
    if trainer_devices is not None and trainer_devices + reward_devices >= devices:
        raise ValueError(
            f"{section}.trainer_devices={trainer_devices} must leave at least one rollout device of "
            f"cluster.devices={devices}"
            + (f" after {section}.reward_devices={reward_devices}" if reward_devices else "")
        )


def _shipped() -> dict[str, Path]:
    folder = resources.files("dovetail") / "scenarios"
    return {Path(str(p)).stem: Path(str(p)) for p in folder.iterdir() if str(p).endswith(".yaml")}


def list_scenarios() -> dict[str, str]:
    """Shipped scenario names -> their one-line description."""
    return {name: load_scenario(name).description.strip().splitlines()[0] for name in sorted(_shipped())}


def parse_scenario(data: dict, origin: str = "scenario") -> Scenario:
    """Validate a scenario dict; errors name the field (dotted path) and what is wrong with it, one line for a
    single problem, one line each under a heading for several."""
    try:
        return Scenario.model_validate(data)
    except ValidationError as error:
        problems = [f"{'.'.join(str(part) for part in e['loc']) or '(top level)'}: {e['msg']}" for e in error.errors()]
        if len(problems) == 1:
            raise ValueError(f"{origin}: invalid scenario: {problems[0]}") from None
        raise ValueError(f"{origin}: invalid scenario\n" + "\n".join(f"  {p}" for p in problems)) from None


def load_scenario(name_or_path: str | Path) -> Scenario:
    shipped = _shipped()
    path = shipped.get(str(name_or_path), Path(name_or_path))
    if not path.is_file():
        raise ValueError(f"no scenario {str(name_or_path)!r}: give a YAML path or one of {', '.join(sorted(shipped))}")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a scenario is a YAML mapping with cluster, pipelines and schedule")
    return parse_scenario(data, str(path))


@dataclass(frozen=True)
class Prepared:
    """Everything an executor needs to run one policy on a scenario."""

    graph: Graph
    setup: Setup
    policy: Policy


def prepare(
    scenario: Scenario,
    policy: str,
    *,
    steps: int | None = None,
    devices: int | None = None,
    options: dict | None = None,
    shapes: dict | None = None,
    cost: CostModel | Mapping[str, CostModel] | None = None,
    **shape_overrides,
) -> Prepared:
    """Build the sub-stage graph the policy wants for every pipeline, the engines' footprints, and the policy.
    `options` go to the policy (e.g. {"tag": False});
    `shapes` (pipeline -> shape) fixes every pipeline's shape; otherwise `shape_overrides` (fragments, tsp_chunk,
    trainer_devices...) replace what the policy would choose. `cost` replaces the analytic cost model, for every
    pipeline or per pipeline name (the Ray runtime passes each pipeline's, corrected by costs profiled on its own
    devices); the pool has one interference table (`Setup.slowdown`), the first pipeline's cost model's."""
    cls = policy_class(policy)
    for spec in scenario.pipelines:
        if spec.kind not in cls.pipeline_kinds:
            raise ValueError(
                f"policy {policy} schedules {'/'.join(sorted(cls.pipeline_kinds))} pipelines; "
                f"pipeline {spec.name!r} is a {spec.kind} pipeline"
            )
    devices = devices or scenario.cluster.devices
    steps = steps or scenario.schedule.steps
    cost = cost or CostModel(scenario.cluster.device)
    costs = cost if isinstance(cost, Mapping) else {spec.name: cost for spec in scenario.pipelines}
    trainer_devices = shape_overrides.pop("trainer_devices", None) or scenario.schedule.trainer_devices
    reward_devices = scenario.schedule.reward_devices
    nodes, engines, trainer_pools = [], {}, {}
    # Policies that give each pipeline its own slice of the pool (verl-sync, streamrl, areal) cut steps for it.
    pipeline_devices = devices // len(scenario.pipelines) if cls.splits_pool else devices - reward_devices
    if shapes is None:
        shapes = {
            spec.name: cls.shape(spec, pipeline_devices, trainer_devices, costs[spec.name])
            for spec in scenario.pipelines
        }
        if shape_overrides:
            shapes = {name: replace(shape, **shape_overrides) for name, shape in shapes.items()}
        else:
            # A policy that plans pipelines together rolls the simulator forward a bounded horizon per candidate.
            def forecast(candidate: dict, horizon: int) -> float:
                trace = _run(
                    scenario,
                    prepare(
                        scenario, policy, steps=horizon, devices=devices, options=options, shapes=candidate, cost=cost
                    ),
                )
                return sum(r.samples for r in trace.steps) / trace.makespan

            shapes = cls.plan_shapes(scenario.pipelines, shapes, costs, forecast)
    for spec in scenario.pipelines:
        shape = shapes[spec.name]
        nodes += shape.build(spec, steps, costs[spec.name])
        engines[spec.name] = shape.engines(spec, costs[spec.name])
        trainer_pools[spec.name] = shape.trainer_devices
    capacity = lookup_device(scenario.cluster.device).memory_bytes / 1e9
    for node in nodes:
        need = engines[node.pipeline].resident_gb.get(node.role, 0.0) + node.memory_gb
        if need > capacity:
            raise ValueError(
                f"pipeline {node.pipeline}: {node.kind} needs {need:.0f} GB per device under {policy} "
                "(engine + working "
                f"memory), more than a {scenario.cluster.device}'s {capacity:.0f} GB; use more "
                "devices or set offload: true"
            )
    setup = Setup(
        devices=devices,
        memory_gb=capacity,
        engines=engines,
        trainer_devices=next(iter(trainer_pools.values()))
        if len(set(trainer_pools.values())) == 1
        else trainer_devices,
        reward_devices=reward_devices,
        trainer_groups={name: size for name, size in trainer_pools.items() if size is not None},
        options=options or {},
        priorities={spec.name: spec.priority for spec in scenario.pipelines},
        shapes=shapes,
        max_staleness=cls.max_staleness,
        slowdown=costs[scenario.pipelines[0].name].calibration.slowdown,
    )
    return Prepared(Graph(nodes), setup, cls(setup))


def simulate(
    scenario: Scenario,
    policy: str,
    *,
    steps: int | None = None,
    devices: int | None = None,
    options: dict | None = None,
    cost: CostModel | None = None,
    **shape_overrides,
):
    """Prepare and simulate one policy on a scenario; returns (Prepared, Trace). Shared devices slow each
    other down by the cost model's interference table (`Setup.slowdown`); `cost` replaces the analytic cost model."""
    prepared = prepare(scenario, policy, steps=steps, devices=devices, options=options, cost=cost, **shape_overrides)
    return prepared, _run(scenario, prepared)


def _run(scenario: Scenario, prepared: Prepared):
    executor = SimExecutor(
        prepared.graph,
        prepared.setup,
        seed=scenario.schedule.seed,
        noise=scenario.schedule.noise,
        slowdown=prepared.setup.slowdown,
    )
    return executor.run(prepared.policy)
