"""Start the Ray runtime for a training config (any pipeline kind): Ray, one DeviceWorker per device, a cost model
corrected by a profile of those devices, the policy's graph, and the RayExecutor that runs it."""

from __future__ import annotations

import pickle
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

import ray
import torch
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, get_placement_group, placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dovetail.config.common import AUTO, MAX_PIPELINES, REFERENCE, auto_candidates, ray_address
from dovetail.config.multiplex import PipelineConfig, TrainConfig, pipeline_configs, refined_by_profiles
from dovetail.cost.catalog import device
from dovetail.cost.model import CostModel
from dovetail.kinds import kind
from dovetail.plan.metrics import summarize
from dovetail.plan.prepare import Prepared, prepare, simulate
from dovetail.plan.scenario import Scenario
from dovetail.runtime.executor import PipelineRun, RayExecutor
from dovetail.runtime.interference import measure_interference
from dovetail.runtime.pipeline import SAMPLING_WEIGHTS_KEY, Ledger
from dovetail.runtime.publication import Publication, measured
from dovetail.runtime.ray_start import DEVICE_RESOURCE, device_bundle, start_ray, warning_muted
from dovetail.runtime.recovery import Incarnations, LostWatch, Started
from dovetail.runtime.startup_cache import cached
from dovetail.runtime.worker import DeviceWorker, WorkerRestarted

WORKER_ACTOR: Any = DeviceWorker
"""`ray.remote` made DeviceWorker an actor class (`.options`, `.remote`), which the type checker cannot see."""

Bundle = TypeVar("Bundle")


STARTUP_ATTEMPTS = 3
"""Start-up profiles tried before a run gives up on workers that keep dying."""


@dataclass(frozen=True)
class DevicePool:
    """The Ray job's DeviceWorkers on one type of device: a placement group bundle per device, and per slot (a
    pipeline's place in a run) a worker on each device, so the pipelines of a multiplexed run share the devices.

    Ray holds both, named by job and device type (`device_pool` finds them by name), rather than this process, so
    a later run of the job (a sweep, a test session) takes up warm workers instead of starting processes that
    import torch and the engines again, seconds each. A worker is a detached actor (no handle keeps it alive
    between runs) in a placement group of the job, which Ray removes as the job ends, ending its workers with it;
    a worker Ray has given up restarting is replaced by a fresh one under its name. A worker is named after its
    bundle, not its place in the pool: a run that goes on without a lost device keeps the others' workers."""

    bundles: tuple[tuple[PlacementGroup, str, int], ...]
    """Per device, its placement group, the group's name and the bundle's index in it."""
    gpu: bool

    def workers(self, slot: int) -> list:
        """Slot `slot`'s DeviceWorker on each device: the job's, or started now under its name."""
        share = 1 / MAX_PIPELINES
        options: dict = {"num_gpus": share, "resources": {}} if self.gpu else {"resources": {DEVICE_RESOURCE: share}}
        with warning_muted("ray.actor", "detached actor with a placement group"):  # its point here: see above
            return [
                WORKER_ACTOR.options(
                    name=f"{name}-bundle{bundle}-slot{slot}",
                    get_if_exists=True,
                    lifetime="detached",
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle),
                    **options,
                ).remote(index)
                for index, (group, name, bundle) in enumerate(self.bundles)
            ]

    def nodes(self) -> list[str | None]:
        """The node each device's bundle is on now (None: it has none)."""
        placed = bundle_nodes(self.bundles)
        return [placed[name].get(bundle) for _, name, bundle in self.bundles]

    def unplaced(self) -> list[int]:
        """The devices whose bundle has no node now: its node is gone and no other had room for it (yet)."""
        nodes = bundle_nodes(self.bundles)
        return [device for device, (_, name, bundle) in enumerate(self.bundles) if not nodes[name].get(bundle)]

    def without(self, devices: list[int]) -> DevicePool:
        """The pool of the devices that remain after `devices` are lost."""
        return replace(self, bundles=tuple(b for device, b in enumerate(self.bundles) if device not in devices))


def device_pool(config: TrainConfig) -> DevicePool:
    """The job's `DevicePool` on the run's cluster.devices devices. Its bundles are placement groups named
    `<prefix>-from<first device>`: the job's earlier runs placed some, and the devices this run needs beyond them
    are placed now as one more group (PACK: on as few nodes as Ray can)."""
    bundle = device_bundle(config)
    prefix = f"dovetail-{ray.get_runtime_context().get_job_id()}-{config.cluster.device}"
    bundles: list[tuple[PlacementGroup, str, int]] = []
    while len(bundles) < config.cluster.devices:
        name = f"{prefix}-from{len(bundles)}"
        try:
            group = get_placement_group(name)
        except ValueError:  # no such group yet
            group = placement_group([bundle] * (config.cluster.devices - len(bundles)), strategy="PACK", name=name)
        ray.get(group.ready(), timeout=120)
        bundles += [(group, name, index) for index in range(group.bundle_count)]
    nodes = bundle_nodes(bundles)
    ordered = by_node(bundles[: config.cluster.devices], lambda b: nodes[b[1]][b[2]])
    return DevicePool(tuple(ordered), "GPU" in bundle)


def start_devices_early(config: TrainConfig) -> dict[str, list]:
    """A local run's Ray instance and device workers started now, each worker importing its pipeline's engines
    (`DeviceWorker.preload`), for a caller that has yet to import its own (the command line, before the runner, by
    `ray_start.start_devices_in_background`): the imports, seconds each on every process, overlap, and the run takes
    up both as it starts (`start_ray` finds Ray started; `device_pool` and `DevicePool.workers` find their names).
    Returns each pipeline's workers; a run on a cluster (cluster.address, $RAY_ADDRESS) and the one-process reference
    start nothing here (none)."""
    if config.policy == REFERENCE or ray_address(config.cluster):
        return {}
    start_ray(config)
    pool = device_pool(config)
    pipelines = pipeline_configs(config)
    workers = pipeline_workers(pool, pipelines)
    for name, pipeline in pipelines.items():
        for worker in workers[name]:
            worker.preload.remote(pipeline.kind)
    return workers


def pipeline_workers(pool: DevicePool, pipelines: Mapping[str, object]) -> dict[str, list]:
    """Each of the run's pipelines' DeviceWorkers in `pool` (one per device): a pipeline's slot is its place in the
    run."""
    return {name: pool.workers(slot) for slot, name in enumerate(pipelines)}


def bundle_nodes(bundles) -> dict[str, dict[int, str]]:
    """Each placement group's bundles' nodes (bundle index -> node id; a bundle without a node has none), by group
    name, from one read of each group's table."""
    groups = {name: group for group, name, _ in bundles}
    return {name: placement_group_table(group)["bundles_to_node_id"] for name, group in groups.items()}


def by_node(bundles: list[Bundle], node_of: Callable[[Bundle], str]) -> list[Bundle]:
    """The bundles with each node's together, nodes in the order they first come: a policy's pools and groups are
    ranges of device indices, which the planner takes to be a node's devices where they fit in one (a trainer group
    inside a node all-reduces over its interconnect, not the network)."""
    rank = {node: i for i, node in enumerate(dict.fromkeys(node_of(b) for b in bundles))}
    return sorted(bundles, key=lambda b: rank[node_of(b)])


def start_workers(config: TrainConfig, pool: DevicePool, trainer_states: dict[str, dict]) -> dict[str, Started]:
    """Each pipeline's DeviceWorkers in the run's `pool` (one per device, in its own process), configured for this
    run and holding the pipeline's `trainer_states[name]` (weights + optimizer), each pipeline's workers one
    torch.distributed group (at most config.MAX_PIPELINES of them: the config holds the limit). Every pipeline's
    processes start at once (a new one spends seconds importing torch and its engines); then each pipeline's are
    configured in turn."""
    pipelines = pipeline_configs(config)
    workers = pipeline_workers(pool, pipelines)
    started = {}
    for name, pipeline in pipelines.items():
        state_ref = ray.put(trainer_states[name])
        state = trainer_states[name]
        weights_ref = ray.put(state.get(SAMPLING_WEIGHTS_KEY, state["weights"]))
        incarnations = Incarnations([0] * len(workers[name]))
        config_dump = pipeline.model_dump(mode="json")
        started[name] = Started(
            config_dump, workers[name], incarnations, weights_ref, state_ref, lost_watch(config, pool)
        )
        started[name].revive("configure")  # every worker is new to this run: configured and grouped, even if one
        started[name].restarts.clear()  # dies meanwhile; not a restart of the run's
    return started


def profiled(config: PipelineConfig, scenario: Scenario, workers: list, reprofile: bool = False) -> dict:
    """What the devices that hold the policy's engines measure (`profile_work`), all at once as they will run, the
    median over them; and a role switch's round trip. Profiling also warms every device's engines up, so the run's
    first step is like the others. Kept per machine and config (`runtime.startup_cache`): a run of a config
    profiled here before reads the figures unless `reprofile`."""

    def measure() -> dict:
        compute = workers[: config.compute_devices]
        profiles = ray.get([worker.profile.remote(config.runtime.profile_samples) for worker in compute])
        # seconds are the median over devices; what describes the profiled work (e.g. response lengths) is the first's
        measured = {
            kind: statistics.median(p[kind] for p in profiles) if isinstance(value, float) else value
            for kind, value in profiles[0].items()
        }
        # interference only adds time: a "fastest" figure is the best any device saw
        measured |= {kind: min(p[kind] for p in profiles) for kind in profiles[0] if kind.endswith("_fastest")}
        start = time.perf_counter()
        ray.get(workers[0].switch_role.remote("rollout"))
        return measured | {"switch": time.perf_counter() - start}

    measured = cached("profile", [config.model_dump(mode="json")], measure, reprofile)
    spec = scenario.pipelines[0]
    if spec.trains_replicas:
        measured |= measured_sync(config, workers, reprofile)
    return measured


SYNC_REPEATS = 5


def measured_sync(config: TrainConfig, workers: list, reprofile: bool = False) -> dict:
    """How long a commit takes to add a gradient across the devices that may train (`DeviceWorker.time_sync`:
    `sync` seconds over `sync_devices`), which a trainer pool of several replicas pays at every step and a device
    alone does not; nothing on one device. Kept per machine, config and device count (`runtime.startup_cache`).
    Measured for a pipeline whose scenario prices its trainer as the runtime's replicas (`replicated_trainer`: a
    language model's); a flow scenario still prices a trainer pool as FSDP groups, where the measured sync would
    weigh against the replicas alone and tip digen's search to a split the runtime does not run."""
    trainers = workers[: config.compute_devices]
    if len(trainers) < 2:
        return {}
    ranks = tuple(range(len(trainers)))

    def measure() -> dict:
        seconds = ray.get([worker.time_sync.remote(ranks, SYNC_REPEATS) for worker in trainers])
        return {"sync": statistics.median(seconds), "sync_devices": len(trainers)}

    return cached("sync", [config.model_dump(mode="json"), {"sync_devices": len(trainers)}], measure, reprofile)


def cached_interference(started: dict[str, Started], configs: dict, reprofile: bool) -> dict[tuple[str, str], float]:
    """`measure_interference`, kept per machine and the run's pipeline configs (`runtime.startup_cache`)."""

    def measure() -> dict:
        return {f"{kind}|{alongside}": s for (kind, alongside), s in measure_interference(started, configs).items()}

    trees = [pipeline.model_dump(mode="json") for pipeline in configs.values()]
    table = cached("interference", trees, measure, reprofile)
    return {tuple(pair.split("|")): slowdown for pair, slowdown in table.items()}


def prepare_run(
    config: TrainConfig,
    steps: int,
    started: dict[str, Started],
    nodes: list[str | None],
    reprofile: bool = False,
) -> tuple[dict[str, CostModel], Prepared, Choice | None, dict[str, Publication]]:
    """Each pipeline's costs profiled on its own workers (one pipeline at a time, so the profiles do not slow each
    other); with several pipelines (a multiplexing policy: jigsaw, jigsaw-greedy), how much their work slows each
    other down on one device, measured there and put in every pipeline's cost model; how each publishes
    (`publication.measured`, on the devices' `nodes`); then the policy's graph of every pipeline, under the policy
    `policy=auto` chooses on these costs (`chosen_policy`, returned too; else None). The first two measurements are
    kept per machine and config (`runtime.startup_cache`) unless `reprofile`."""
    for attempt in range(STARTUP_ATTEMPTS):
        try:
            measured_by = {
                name: profiled(pipeline, pipeline.scenario(steps), started[name].workers, reprofile)
                for name, pipeline in pipeline_configs(config).items()
            }
            config = refined_by_profiles(config, measured_by)
            configs = pipeline_configs(config)
            costs = {
                name: kind(pipeline.kind).load("fit")(pipeline, pipeline.scenario(steps), measured_by[name])
                for name, pipeline in configs.items()
            }
            if len(configs) > 1:
                table = cached_interference(started, configs, reprofile)
                costs = {name: cost.with_interference(table) for name, cost in costs.items()}
            publications = {
                name: measured(
                    config.cluster.publication,
                    name,
                    started[name].workers,
                    started[name].incarnations.publication_prefix,
                    nodes,
                    pipeline.compute_devices,
                )
                for name, pipeline in configs.items()
            }
            break
        except (RayActorError, WorkerRestarted):  # a worker died while profiling: bring it back, profile again
            if attempt == STARTUP_ATTEMPTS - 1:
                raise
            for pipeline in started.values():
                pipeline.revive("start-up")
    choice = chosen_policy(config, steps, costs) if config.policy == AUTO else None
    if choice is not None:
        config = config.model_copy(update={"policy": choice.policy})
    prepared = prepare(
        config.scenario(steps),
        config.policy,
        steps=steps,
        cost=costs,
        options=config.policy_options(),
        **config.shape_overrides(),
    )
    return costs, prepared, choice, publications


AUTO_TIE = 0.01
"""Predictions within this fraction of the fastest are a tie, below what the cost model can tell apart: the first of
them in the registry's order wins (`sched.POLICIES`: a kind's own policies before the multiplexing ones)."""


@dataclass(frozen=True)
class Choice:
    """What `policy=auto` chose, and the predicted samples/s of every policy it considered."""

    policy: str
    predicted: dict[str, float]
    """Policy -> samples/s the simulator predicts on the run's costs; a policy the config rules out is absent."""
    refused: dict[str, str] = field(default_factory=dict)
    """Policy -> why the config rules it out (a field it decides itself, a pool it cannot use)."""

    def line(self) -> str:
        ranked = sorted(self.predicted.items(), key=lambda item: -item[1])
        others = ", ".join(f"{name} {rate:.3g}" for name, rate in ranked if name != self.policy)
        return (
            f"policy auto: {self.policy}, the fastest predicted on these devices "
            f"({self.predicted[self.policy]:.3g} samples/s" + (f"; {others}" if others else "") + ")"
        )


def chosen_policy(config, steps: int, cost: CostModel | Mapping[str, CostModel] | None) -> Choice:
    """`policy=auto`: every policy that schedules the run's kind, simulated on its costs (the profiled ones on a
    run, the catalogue's in a GPU dry run) over `steps` (at most DRY_RUN_STEPS), the fastest kept (`AUTO_TIE`). A
    policy the config rules out (a field it decides itself, a reward pool it cannot use) is skipped and said why."""
    simulated = min(steps, DRY_RUN_STEPS)
    predicted, refused = {}, {}
    for policy in auto_candidates(config.kind):
        candidate = config.model_copy(update={"policy": policy})
        try:
            _, trace = simulate(
                candidate.scenario(simulated),
                policy,
                steps=simulated,
                cost=cost,
                options=candidate.policy_options(),
                **candidate.shape_overrides(),
            )
        except ValueError as error:
            refused[policy] = str(error)
            continue
        predicted[policy] = summarize(trace).samples_per_s
    if not predicted:
        reasons = "; ".join(f"{name}: {why}" for name, why in refused.items())
        raise ValueError(f"policy=auto: the config rules out every policy of a {config.kind} run ({reasons})")
    best = max(predicted.values())
    chosen = next(name for name, rate in predicted.items() if rate >= (1 - AUTO_TIE) * best)
    return Choice(chosen, predicted, refused)


DRY_RUN_STEPS = 3
"""RL steps the dry run simulates: enough for the steady state of every policy (TCSS overlaps two)."""


def profiled_here(config: TrainConfig) -> dict[str, dict]:
    """Each pipeline's start-up profile taken in this process on one thread, as a run profiles a CPU core (no Ray
    round trip to time: its `switch` is 0), by pipeline name."""
    torch.set_num_threads(1)

    def carry(weights: dict) -> dict:  # what a Ray round trip does to them
        return pickle.loads(pickle.dumps(weights))

    return {
        name: kind(pipeline.kind).load("profile")(pipeline, carry=carry) | {"switch": 0.0}
        for name, pipeline in pipeline_configs(config).items()
    }


def dry_run(config: TrainConfig, steps: int, profiles: Mapping[str, dict] | None = None) -> dict:
    """What `dovetail train` would do for `steps` steps, without Ray: the checkpoints and the devices checked, then
    the policy's shapes and throughput as the simulator predicts them. On CPU cores the costs are profiled here, in
    this process, as the run profiles its devices, or taken from `profiles` (`profiled_here`'s, by pipeline name):
    a caller comparing arrangements of the same pipelines prices them all on one profile, since two profiles of a
    loaded machine differ by up to 2x. For GPUs they are the device catalogue's analytic costs (the run, profiling
    its GPUs, may then choose another shape)."""
    configs = pipeline_configs(config)
    for pipeline in configs.values():
        kind(pipeline.kind).load("check_checkpoint")(pipeline)
    if config.policy == "reference":
        return {"policy": "reference"}
    device_bundle(config)
    simulated = min(steps, DRY_RUN_STEPS)
    costs = None
    if device(config.cluster.device).platform == "cpu":
        measured_by = profiled_here(config) if profiles is None else {name: profiles[name] for name in configs}
        config = refined_by_profiles(config, measured_by)
        costs = {
            name: kind(pipeline.kind).load("fit")(pipeline, pipeline.scenario(simulated), measured_by[name])
            for name, pipeline in pipeline_configs(config).items()
        }
    choice = chosen_policy(config, steps, costs) if config.policy == AUTO else None
    if choice is not None:
        config = config.model_copy(update={"policy": choice.policy})
    prepared, trace = simulate(
        config.scenario(simulated),
        config.policy,
        steps=simulated,
        options=config.policy_options(),
        cost=costs,
        **config.shape_overrides(),
    )
    metrics = summarize(trace)
    plan = {
        "policy": config.policy,
        "auto": None if choice is None else asdict(choice) | {"line": choice.line()},
        "devices": config.cluster.devices,
        "device": config.cluster.device,
        "step_time_s": metrics.step_time_s,
        "steady_step_s": metrics.steady_step_s,
        "first_step_s": metrics.first_step_s,
        "samples_per_s": metrics.samples_per_s,
        "efficiency": metrics.efficiency,
        "bubble_ratio": metrics.bubble_ratio,
        "run_s": metrics.step_time_s * steps,
        "costs": "profiled" if costs else "analytic",
    }
    if len(configs) > 1:
        return plan | {"shapes": {name: asdict(prepared.setup.shapes[name]) for name in configs}}
    shape = prepared.setup.shapes[config.pipeline_name]
    return plan | {
        "shape": asdict(shape),
        "trainer_devices": shape.trainer_devices,
        "rollout_devices": config.compute_devices - shape.trainer_devices,
        "reward_devices": config.cluster.devices - config.compute_devices,
    }


def lost_watch(config: TrainConfig, pool: DevicePool) -> Callable[[], LostWatch]:
    """New watches of the pool's devices, each lost once it has had no node for cluster.lost_after_s."""
    return lambda: LostWatch(pool.unplaced, config.cluster.lost_after_s)


def make_executor(
    config: TrainConfig,
    prepared: Prepared,
    started: dict[str, Started],
    first_steps: dict[str, int],
    pool: DevicePool,
    ledgers: Mapping[str, Ledger],
    publications: Mapping[str, Publication],
    **hooks,
) -> RayExecutor:
    """The executor of the run's pipelines from `first_steps`, each publishing as `publications` says; a pipeline's
    ledger takes up from its entry in `ledgers` (what the run booked before it went on without a lost device), if
    any."""
    pipelines = {
        name: PipelineRun(
            name,
            pipeline,
            started[name].workers,
            started[name].incarnations,
            first_steps[name],
            {0: started[name].weights},
            started[name].trainer_state,
            ledger=ledgers.get(name, Ledger()).with_restarts(started[name].restarts),
            publication=publications[name],
        )
        for name, pipeline in pipeline_configs(config).items()
    }
    return RayExecutor(
        prepared.graph, prepared.setup, pipelines, lost=lost_watch(config, pool), nodes=pool.nodes, **hooks
    )
