"""Start the Ray runtime for a training config (any pipeline kind): Ray, one DeviceWorker per device, a cost model
corrected by a profile of those devices, the policy's graph, and the RayExecutor that runs it."""

from __future__ import annotations

import pickle
import statistics
import time
from dataclasses import asdict

import ray
import torch
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dovetail.config.train import TrainConfig
from dovetail.cost.catalog import DEVICES, device
from dovetail.cost.model import CostModel
from dovetail.exec.metrics import summarize
from dovetail.exec.pipeline import pipeline_module
from dovetail.exec.ray_executor import RayExecutor
from dovetail.exec.worker import DEVICE_RESOURCE, DeviceWorker, form_group
from dovetail.scenario import Prepared, Scenario, prepare, simulate


def device_bundle(config: TrainConfig) -> dict[str, float]:
    """What one device is to Ray: a GPU, or here one `dovetail_device` (a CPU core)."""
    platform = device(config.cluster.device).platform
    if platform == "cpu":
        return {DEVICE_RESOURCE: 1}
    if platform == "cuda":
        return {"GPU": 1}
    runnable = ", ".join(name for name, d in DEVICES.items() if d.platform in ("cuda", "cpu"))
    raise ValueError(
        f"cluster.device={config.cluster.device!r} can be planned (`dovetail simulate`) but not run: the Ray "
        f"runtime drives CUDA GPUs or CPU cores ({runnable})"
    )


def start_ray(config: TrainConfig) -> None:
    """A local Ray instance (one `dovetail_device` per core, or the GPUs Ray finds), or the cluster at
    cluster.address; either way it must hold cluster.devices devices."""
    (resource,) = device_bundle(config)
    if not ray.is_initialized():
        quiet = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
        if config.cluster.address:
            ray.init(address=config.cluster.address)
        elif resource == DEVICE_RESOURCE:
            ray.init(num_cpus=1, resources={DEVICE_RESOURCE: config.cluster.devices}, **quiet)
        else:
            ray.init(num_cpus=1, **quiet)
    available = ray.cluster_resources().get(resource, 0)
    if available < config.cluster.devices:
        fix = (
            f"start the cluster's nodes with `ray start --resources='{{\"{DEVICE_RESOURCE}\": CORES}}'`"
            if resource == DEVICE_RESOURCE
            else "lower cluster.devices, or set cluster.device=cpu-core to use CPU cores"
        )
        raise RuntimeError(
            f"cluster.devices={config.cluster.devices} {config.cluster.device} devices asked for, but the Ray "
            f"instance has {available:g} {resource!r}; {fix}"
        )


_POOLS: dict[tuple[str, str], list] = {}
"""(Ray job, device type) -> its DeviceWorkers: a pool outlives a run, never the Ray instance it lives in."""


def start_workers(config: TrainConfig, trainer_state: dict) -> tuple[list, ray.ObjectRef, ray.ObjectRef]:
    """One DeviceWorker per device, placed through a placement group (one bundle per device),
    configured for this run and holding `trainer_state` (weights + optimizer). The actors are kept
    for the next run on the same kind of device in this process, while Ray stays up."""
    pool = _POOLS.setdefault((ray.get_runtime_context().get_job_id(), config.cluster.device), [])
    missing = config.cluster.devices - len(pool)
    if missing > 0:
        bundle = device_bundle(config)
        group = placement_group([bundle] * missing, strategy="PACK")
        ray.get(group.ready(), timeout=120)
        for index in range(missing):
            options = {
                "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
            }
            if "GPU" in bundle:
                options |= {"num_gpus": 1, "resources": {}}
            pool.append(DeviceWorker.options(**options).remote(len(pool)))
    workers = pool[: config.cluster.devices]
    state_ref = ray.put(trainer_state)
    weights_ref = ray.put(trainer_state["weights"])
    ray.get([w.configure.remote(config.model_dump(mode="json"), state_ref) for w in workers])
    form_group(workers)
    return workers, weights_ref, state_ref


def profiled_cost(config: TrainConfig, scenario: Scenario, workers: list) -> CostModel:
    """The cost model fitted to what the devices that hold the policy's engines measure (`profile_work`), all at
    once as they will run, the median over them; and to a role switch's round trip. Profiling also warms every
    device's engines up, so the run's first step is like the others."""
    compute = workers[: config.compute_devices]
    profiles = ray.get([worker.profile.remote(config.runtime.profile_samples) for worker in compute])
    # seconds are the median over devices; what describes the profiled work (e.g. response lengths) is the first's
    measured = {
        kind: statistics.median(p[kind] for p in profiles) if isinstance(value, float) else value
        for kind, value in profiles[0].items()
    }
    # interference only adds time: a "fastest" figure is the best any device saw
    measured |= {kind: min(profile[kind] for profile in profiles) for kind in profiles[0] if kind.endswith("_fastest")}
    start = time.perf_counter()
    ray.get(workers[0].switch_role.remote("rollout"))
    measured["switch"] = time.perf_counter() - start
    return pipeline_module(config.kind).fitted_cost(config, scenario, measured)


def prepare_run(config: TrainConfig, steps: int, workers: list) -> tuple[CostModel, Prepared]:
    scenario = config.scenario(steps)
    cost = profiled_cost(config, scenario, workers)
    return cost, prepare(
        scenario, config.policy, steps=steps, cost=cost, options=config.policy_options(), **config.shape_overrides()
    )


DRY_RUN_STEPS = 3
"""RL steps the dry run simulates: enough for the steady state of every policy (TCSS overlaps two)."""


def dry_run(config: TrainConfig, steps: int) -> dict:
    """What `dovetail train` would do for `steps` steps, without Ray: the checkpoint and the devices checked, then
    the policy's shape and throughput as the simulator predicts them. On CPU cores the costs are profiled here, in
    this process, as the run profiles its devices; for GPUs they are the device catalogue's analytic costs
    (the run, profiling its GPUs, may then choose another shape)."""
    kind = pipeline_module(config.kind)
    kind.check_checkpoint(config)
    if config.policy == "reference":
        return {"policy": "reference"}
    device_bundle(config)
    simulated = min(steps, DRY_RUN_STEPS)
    scenario = config.scenario(simulated)
    cost = None
    if device(config.cluster.device).platform == "cpu":
        torch.set_num_threads(1)
        measured = kind.profile_here(config, carry=lambda weights: pickle.loads(pickle.dumps(weights)))
        cost = kind.fitted_cost(config, scenario, measured | {"switch": 0.0})  # no Ray round trip to time here
    prepared, trace = simulate(
        scenario, config.policy, steps=simulated, options=config.policy_options(), cost=cost, **config.shape_overrides()
    )
    shape, metrics = prepared.setup.shapes[config.pipeline_name], summarize(trace)
    return {
        "policy": config.policy,
        "devices": config.cluster.devices,
        "device": config.cluster.device,
        "shape": asdict(shape),
        "trainer_devices": shape.trainer_devices,
        "rollout_devices": config.compute_devices - shape.trainer_devices,
        "reward_devices": config.cluster.devices - config.compute_devices,
        "step_time_s": metrics.step_time_s,
        "samples_per_s": metrics.samples_per_s,
        "efficiency": metrics.efficiency,
        "bubble_ratio": metrics.bubble_ratio,
        "run_s": metrics.step_time_s * steps,
        "costs": "profiled" if cost else "analytic",
    }


def make_executor(
    config: TrainConfig, prepared: Prepared, workers: list, weights, trainer_state, first_step: int, **hooks
) -> RayExecutor:
    return RayExecutor(
        prepared.graph,
        prepared.setup,
        config,
        workers,
        first_step=first_step,
        initial_weights=weights,
        initial_trainer_state=trainer_state,
        **hooks,
    )
