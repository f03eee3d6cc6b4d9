"""The planner's entry: a scenario, a policy and a cost model make the policy's graph and setup (`prepare`), and the
simulator runs them (`simulate`). `dovetail plan` / `simulate`, the dry run and the Ray runtime all plan here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from dovetail.cost.catalog import DEVICES, Device
from dovetail.cost.catalog import device as lookup_device
from dovetail.cost.model import CostModel
from dovetail.graph.node import Engines, Graph, Node, Role
from dovetail.graph.spec import MAX_DEVICES
from dovetail.plan.metrics import Metrics, summarize
from dovetail.plan.scenario import Scenario
from dovetail.plan.sim import GaveUp, SimExecutor, collector_paused
from dovetail.plan.trace import Trace
from dovetail.sched import POLICIES, policy_class
from dovetail.sched.policy import MemoryRefusal, Policy, PolicyOptions, SearchContext, Setup


@dataclass(frozen=True)
class Prepared:
    """Everything an executor needs to run one policy on a scenario."""

    graph: Graph
    setup: Setup
    policy: Policy


def refuse_fixed_fields(scenario: Scenario, policy: str) -> None:
    """A field the scenario sets away from its default that the policy decides itself (`Policy.fixes`) is refused by
    name, with the policies that honour it: a plan must never silently be something else than what the file says."""
    fixes = policy_class(policy).fixes
    sections = [(f"pipelines.{i}", spec) for i, spec in enumerate(scenario.pipelines)] + [
        ("schedule", scenario.schedule)
    ]
    for section, values in sections:
        for field, why in fixes.items():
            if field not in type(values).model_fields:
                continue
            value = getattr(values, field)
            if value == type(values).model_fields[field].default:
                continue
            honour = [
                name
                for name in sorted(POLICIES)
                if field not in policy_class(name).fixes
                and all(spec.kind in policy_class(name).pipeline_kinds for spec in scenario.pipelines)
            ]
            raise ValueError(
                f"{section}.{field}={value}: policy {policy} {why}, so it cannot honour it; remove the field"
                + (f" or simulate {', '.join(honour)}" if honour else "")
            )


@dataclass
class Simulated:
    """A candidate a search simulated to its end (`prepare`'s `simulations`): what ran (its policy as the run left
    it), the trace, and its summary once a `forecast` asked for it (a search that only ranks needs none)."""

    prepared: Prepared
    trace: Trace
    metrics: Metrics | None = None


@dataclass(frozen=True)
class Searched:
    """One candidate a policy's search simulated: its shapes, over how many steps, and what it achieved."""

    policy: str
    shapes: dict
    horizon: int
    samples_per_s: float
    step_time_s: float
    """The simulated makespan over `horizon` (the first step's warm-up included)."""
    steady_step_s: float
    """Commit to commit after the first step (`plan.metrics.Metrics.steady_step_s`)."""
    first_step_s: float
    phase_s: dict[str, float]
    """Seconds a step spends in each kind of work (device-seconds over the devices) and idle: why one candidate
    steps faster than another (`searched_from`)."""
    samples_per_step: float = 0.0
    """Samples a step makes, every pipeline's."""

    @property
    def steady_samples_per_s(self) -> float:
        """A step's samples over the steady step: the throughput of a long run once warm, which `dovetail plan`
        ranks by. `samples_per_s` counts the warm-up over the few simulated steps: a pipelined shape whose first
        step overlaps nothing (streamrl's rollout on half the pool, then its training) shows less there."""
        return self.samples_per_step / self.steady_step_s


def searched_from(policy: str, shapes: dict, horizon: int, trace, metrics: Metrics | None = None) -> Searched:
    """The record of a candidate simulated over `horizon` steps into `trace` (a `plan.trace.Trace`), whose `metrics`
    (`summarize`) are taken when given: a plan's policies that run a candidate alike share its summary too."""
    metrics = summarize(trace) if metrics is None else metrics
    per_step = {kind: seconds / horizon for kind, seconds in metrics.phase_seconds.items()}
    idle = metrics.bubble_ratio * trace.makespan / horizon
    return Searched(
        policy,
        shapes,
        horizon,
        metrics.samples_per_s,
        trace.makespan / horizon,
        metrics.steady_step_s,
        metrics.first_step_s,
        per_step | {"idle": idle},
        sum(record.samples for record in trace.steps) / horizon,
    )


def prepare(
    scenario: Scenario,
    policy: str,
    *,
    steps: int | None = None,
    devices: int | None = None,
    options: PolicyOptions | Mapping[str, object] | None = None,
    shapes: dict | None = None,
    cost: CostModel | Mapping[str, CostModel] | None = None,
    searched: list | None = None,
    simulations: dict | None = None,
    **shape_overrides,
) -> Prepared:
    """Build the sub-stage graph the policy wants for every pipeline, the engines' footprints, and the policy.
    `options` go to the policy (`PolicyOptions`, or its mapping: e.g. {"tag": False});
    `shapes` (pipeline -> shape) fixes every pipeline's shape; otherwise `shape_overrides` (fragments, tsp_chunk,
    trainer_devices...) replace those fields of what the policy would choose, every candidate of its search too (the
    search still chooses the rest). `cost` replaces the analytic cost model, for every
    pipeline or per pipeline name (the Ray runtime passes each pipeline's, corrected by costs profiled on its own
    devices); the pool has one interference table (`Setup.slowdown`), the first pipeline's cost model's. A policy that
    searches simulates its candidates here; `searched` (a list), when given, receives a `Searched` for each (what
    `dovetail plan` shows). `simulations`, when given, keeps each candidate's simulated trace (and its summary, once
    asked) by the schedule it runs (`Policy.simulates_as`), its shapes and horizon (`simulation_key`): `dovetail plan`
    passes one to every policy of a plan on one pool and cost model, so a candidate two policies run alike is
    simulated and summarized once; `simulate` one, so the chosen shapes' trace is not simulated again."""
    cls = policy_class(policy)
    for spec in scenario.pipelines:
        if spec.kind not in cls.pipeline_kinds:
            raise ValueError(
                f"policy {policy} schedules {'/'.join(sorted(cls.pipeline_kinds))} pipelines; "
                f"pipeline {spec.name!r} is a {spec.kind} pipeline"
            )
    refuse_fixed_fields(scenario, policy)
    cost = cost or CostModel(scenario.cluster.catalogue_device())
    planning = Planning(
        scenario,
        policy,
        PolicyOptions.of(options),
        devices or scenario.cluster.devices,
        cost if isinstance(cost, Mapping) else {spec.name: cost for spec in scenario.pipelines},
        shape_overrides.pop("trainer_devices", None) or scenario.schedule.trainer_devices,
        simulations,
    )
    steps = steps or scenario.schedule.steps
    try:
        with collector_paused():  # a search builds and simulates many cuts, every one's graph and trace kept
            if shapes is None:
                shapes = planning.searched_shapes(steps, shape_overrides, searched)
            return planning.built(shapes, steps)
    except MemoryRefusal as refusal:
        raise MemoryRefusal(f"{refusal}; {what_fits(planning, steps, shape_overrides)}") from None


POOL_DOUBLINGS = 4
"""How far `what_fits` grows the pool: up to 16 times the devices asked for (8 -> 128), each size cut without
simulating (a search's enumeration on a few thousand devices would take longer than the plan it refuses)."""


def what_fits(planning: Planning, steps: int, overrides: Mapping[str, object]) -> str:
    """The scenario change that makes a refused plan fit, as `field=value`, the least first: a larger pool (the
    trainer state shards thinner, up to `POOL_DOUBLINGS` doublings), the catalogue device with the least memory that
    holds it on this pool (of the same platform first), a pipeline field that lowers what a device holds
    (`PipelineSpec.memory_remedies`), and last a larger device on a larger pool. Each change is checked as the plan
    itself is (the policy's cut and memory prune, every node beside its engine), with no candidate simulated."""
    scenario, reward = planning.scenario, planning.scenario.schedule.reward_devices
    pools = [reward + (planning.devices - reward) * 2**doubling for doubling in range(1, POOL_DOUBLINGS + 1)]
    pools = [devices for devices in pools if devices <= MAX_DEVICES]
    for devices in pools:
        if replace(planning, devices=devices).fits(steps, overrides):
            return f"it fits with cluster.devices={devices}"
    platform = lookup_device(scenario.cluster.device).platform
    larger = sorted(
        (d for d in DEVICES.values() if d.memory_bytes / 1e9 > planning.capacity_gb),
        key=lambda d: (d.platform != platform, d.memory_bytes),
    )
    on_device = {device.name: planning.on_device(device) for device in larger}
    for name, changed in on_device.items():
        if changed.fits(steps, overrides):
            return f"it fits with cluster.device={name}"
    for index, spec in enumerate(scenario.pipelines):
        for field, value in spec.memory_remedies():
            pipelines = [*scenario.pipelines]
            pipelines[index] = spec.model_copy(update={field: value})
            changed = replace(planning, scenario=scenario.model_copy(update={"pipelines": pipelines}))
            if changed.fits(steps, overrides):
                return f"it fits with pipelines.{index}.{field}={str(value).lower()}"
    for name, changed in on_device.items():
        for devices in pools:
            if replace(changed, devices=devices).fits(steps, overrides):
                return f"it fits with cluster.device={name} and cluster.devices={devices}"
    return f"no pool of up to {pools[-1] if pools else planning.devices} devices, catalogue device or field fits it"


@dataclass(frozen=True)
class Planning:
    """What one `prepare` plans with: the scenario, the policy, its options, the pool, each pipeline's cost model and
    the trainer pool asked for. It cuts the pipelines' steps (the policy's shapes, searched where the policy searches)
    and builds the graph and setup of a cut; a search simulates each candidate cut it weighs the same way."""

    scenario: Scenario
    policy: str
    options: PolicyOptions
    devices: int
    costs: Mapping[str, CostModel]
    trainer_devices: int | None
    simulations: dict[tuple, Simulated] | None = None
    """The candidates simulated so far (`simulation_key` -> `Simulated`), shared by the policies of one plan
    (`prepare`)."""

    @property
    def pipeline_devices(self) -> int:
        """The devices a pipeline's step is cut for: its slice where the policy gives each pipeline its own (verl-sync,
        streamrl, areal), else the pool less its reward devices."""
        cls, scenario = policy_class(self.policy), self.scenario
        if cls.splits_pool:
            return self.devices // len(scenario.pipelines)
        return self.devices - scenario.schedule.reward_devices

    @property
    def capacity_gb(self) -> float:
        return lookup_device(self.scenario.cluster.device).memory_bytes / 1e9

    def on_device(self, device: Device) -> Planning:
        """This planning on a pool of `device` (the catalogue's network), each pipeline's cost model recalibrated as
        given (a profile's corrections are its own device's)."""
        cluster = self.scenario.cluster.model_copy(update={"device": device.name, "network_gbps": None})
        costs = {name: CostModel(device, cost.calibration) for name, cost in self.costs.items()}
        return replace(self, scenario=self.scenario.model_copy(update={"cluster": cluster}), costs=costs)

    def fits(self, steps: int, overrides: Mapping[str, object]) -> bool:
        """Whether the policy cuts the pipelines within memory here: its shapes (a search's memory prune included,
        its candidates not simulated) and every node beside its engine (`built`)."""
        try:
            self.built(self.searched_shapes(steps, overrides, None, simulated=False), steps)
        except ValueError:
            return False
        return True

    def searched_shapes(
        self, steps: int, overrides: Mapping[str, object], searched: list | None, simulated: bool = True
    ) -> dict:
        """The policy's shapes, the fields `overrides` fix replaced in each (a searching policy still searches what
        they leave): a policy that plans pipelines together rolls the simulator forward a bounded horizon for each
        candidate (`forecast`), and `searched`, when given, receives each candidate's figures. Not `simulated`: every
        candidate forecasts 0 samples/s, so a search keeps its cost model's first (what `fits` checks)."""
        cls, scenario = policy_class(self.policy), self.scenario

        def fixed(candidate: Mapping) -> dict:
            return {name: replace(shape, **overrides) for name, shape in candidate.items()}

        def forecast(candidate: dict, horizon: int) -> float:
            if not simulated:
                return 0.0
            candidate = fixed(candidate)
            key = simulation_key(self.policy, self.devices, self.options, candidate, horizon)
            simulations = {} if self.simulations is None else self.simulations
            kept = simulations.get(key)
            if kept is None:
                prepared = self.built(candidate, horizon)
                kept = simulations[key] = Simulated(prepared, run_prepared(scenario, prepared))
            if kept.metrics is None:  # simulated by `forecast_beating`, which needs no summary
                kept.metrics = summarize(kept.trace)
            record = searched_from(self.policy, candidate, horizon, kept.trace, kept.metrics)
            if searched is not None:
                searched.append(record)
            return record.samples_per_s

        def forecast_beating(candidate: dict, horizon: int, rate: float) -> float:
            """`forecast`, given up once the candidate cannot beat `rate` (`sched.policy.ForecastBeating`). Its
            samples/s is `summarize`'s, its steps' samples over its makespan: the samples are the graph's
            (`samples_of`), and the makespan is at least the end `e` of any span recorded so far, so once
            samples / e <= rate (floats: division rounds monotonically, so a makespan m >= e gives
            samples / m <= samples / e), the candidate's figure is at most `rate`, and `rate` is returned."""
            candidate = fixed(candidate)
            key = simulation_key(self.policy, self.devices, self.options, candidate, horizon)
            if self.simulations is not None and key in self.simulations:
                trace = self.simulations[key].trace
            else:
                prepared = self.built(candidate, horizon)
                samples = samples_of(prepared.graph)
                try:
                    trace = executor(scenario, prepared).run(
                        prepared.policy, lambda end: end > 0 and samples / end <= rate
                    )
                except GaveUp:
                    return rate
                if self.simulations is not None:
                    self.simulations[key] = Simulated(prepared, trace)
            return sum(record.samples for record in trace.steps) / trace.makespan  # `summarize`'s samples/s

        shapes = {
            spec.name: cls.shape(spec, self.pipeline_devices, self.trainer_devices, self.costs[spec.name])
            for spec in scenario.pipelines
        }
        if scenario.schedule.reward_devices and cls.supports_reward_pool:
            shapes = cls.with_reward_pool(scenario.pipelines, shapes)
        context = SearchContext(
            scenario.pipelines,
            fixed(shapes),
            self.costs,
            forecast,
            steps=steps,
            devices=self.pipeline_devices,
            trainer_devices=self.trainer_devices,
            options=self.options,
            # Every candidate's figures are kept whole where they are shown (`searched`), and none is simulated
            # where the search only checks the cut fits (not `simulated`).
            forecast_beating=forecast_beating if searched is None and simulated else None,
        )
        return fixed(cls.plan_shapes(context))

    def built(self, shapes: Mapping, steps: int) -> Prepared:
        """The graph of `steps` steps of every pipeline cut by `shapes`, checked to fit each device's memory, the
        setup, and the policy to run them."""
        scenario, costs = self.scenario, self.costs
        nodes: list[Node] = []
        engines: dict[str, Engines] = {}
        trainer_pools: dict[str, int] = {}
        for spec in scenario.pipelines:
            shape = shapes[spec.name]
            nodes += shape.build(spec, steps, costs[spec.name])
            engines[spec.name] = shape.engines(spec, costs[spec.name])
            trainer_pools[spec.name] = shape.trainer_devices
        capacity = self.capacity_gb
        for node in nodes:
            need = engines[node.pipeline].resident_gb.get(node.role, 0.0) + node.memory_gb
            if need > capacity:
                spec = next(spec for spec in scenario.pipelines if spec.name == node.pipeline)
                raise MemoryRefusal(
                    f"pipeline {node.pipeline}: {node.kind} needs {need:.0f} GB per device under {self.policy} "
                    f"(engine + working memory), more than a {scenario.cluster.device}'s {capacity:.0f} GB; "
                    + spec.memory_fix(node, engines[node.pipeline].resident_gb.get(node.role, 0.0) > capacity)
                )
        cls = policy_class(self.policy)
        setup = Setup(
            devices=self.devices,
            memory_gb=capacity,
            engines=engines,
            trainer_devices=next(iter(trainer_pools.values()))
            if len(set(trainer_pools.values())) == 1
            else self.trainer_devices,
            reward_devices=scenario.schedule.reward_devices,
            trainer_groups={name: size for name, size in trainer_pools.items() if size is not None},
            options=self.options,
            priorities={spec.name: spec.priority for spec in scenario.pipelines},
            shapes=dict(shapes),
            max_staleness=max(cls.max_staleness, self.options.staleness),
            node_size=costs[scenario.pipelines[0].name].device.node_size,
            slowdown=costs[scenario.pipelines[0].name].calibration.slowdown,
        )
        return Prepared(Graph(nodes), setup, cls(setup))


def simulate(
    scenario: Scenario,
    policy: str,
    *,
    steps: int | None = None,
    devices: int | None = None,
    options: PolicyOptions | Mapping[str, object] | None = None,
    cost: CostModel | Mapping[str, CostModel] | None = None,
    **shape_overrides,
):
    """Prepare and simulate one policy on a scenario; returns (Prepared, Trace). Shared devices slow each
    other down by the cost model's interference table (`Setup.slowdown`); `cost` replaces the analytic cost model."""
    simulations: dict[tuple, Simulated] = {}
    prepared = prepare(
        scenario,
        policy,
        steps=steps,
        devices=devices,
        options=options,
        cost=cost,
        simulations=simulations,
        **shape_overrides,
    )
    # A search that simulated the chosen shapes over these steps already holds their trace: the same graph, setup and
    # seed give the same one.
    setup = prepared.setup
    key = simulation_key(policy, setup.devices, setup.options, setup.shapes, steps or scenario.schedule.steps)
    if key in simulations:
        return simulations[key].prepared, simulations[key].trace  # its policy ran it (`tag_decisions`, ...)
    return prepared, run_prepared(scenario, prepared)


def simulation_key(policy: str, devices: int, options: PolicyOptions, shapes: Mapping, horizon: int) -> tuple:
    """What a simulated candidate is kept by (`prepare`'s `simulations`): the schedule it runs (`Policy.simulates_as`),
    the pool, the options, its shapes and its horizon in steps."""
    return (policy_class(policy).simulates_as(shapes), devices, options, tuple(sorted(shapes.items())), horizon)


def run_prepared(scenario: Scenario, prepared: Prepared):
    return executor(scenario, prepared).run(prepared.policy)


def executor(scenario: Scenario, prepared: Prepared) -> SimExecutor:
    """The simulator of a prepared plan, with the scenario's seed and noise and the plan's interference table."""
    return SimExecutor(
        prepared.graph,
        prepared.setup,
        seed=scenario.schedule.seed,
        noise=scenario.schedule.noise,
        slowdown=prepared.setup.slowdown,
    )


def samples_of(graph: Graph) -> int:
    """The samples every step of `graph` makes, counted as a step's commit counts them (`ClusterState._commit`: the
    distinct samples of its nodes); a run to the graph's end commits every step."""
    return sum(
        len({sample for node in graph.of(pipeline, step) for sample in node.samples})
        for pipeline in graph.pipelines()
        for step in graph.steps(pipeline)
    )


def rollout_wake_s(scenario: Scenario, cost: CostModel) -> float:
    """The cost model's wake of the first pipeline's rollout engine, as the scenario's first policy cuts it before
    any search (what a start-up profile's measured role switch is fitted against; the rollout engine's footprint
    does not depend on what a search tunes)."""
    spec, schedule = scenario.pipelines[0], scenario.schedule
    devices = scenario.cluster.devices - schedule.reward_devices
    shape = policy_class(schedule.policies[0]).shape(spec, devices, schedule.trainer_devices, cost)
    return shape.engines(spec, cost).wake_s[Role.ROLLOUT]
