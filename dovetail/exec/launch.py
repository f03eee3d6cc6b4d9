"""Start the Ray runtime for a training config: Ray, one DeviceWorker per device, a cost model
corrected by a profile of those devices, the policy's graph, and the RayExecutor that runs it."""

from __future__ import annotations

import pickle
import statistics
import time
from dataclasses import replace

import ray
import torch
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dovetail.config.train import TrainConfig
from dovetail.cost.calibration import DEFAULT
from dovetail.cost.catalog import DEVICES, device, diffusion_model
from dovetail.cost.model import CostModel
from dovetail.exec.metrics import summarize
from dovetail.exec.ray_executor import RayExecutor
from dovetail.exec.worker import DEVICE_RESOURCE, DeviceWorker, form_group, profile_work
from dovetail.graph.node import Role
from dovetail.models.t2i import checkpoint_weights, load_model
from dovetail.recipe import sde_settings, step_timesteps
from dovetail.scenario import Prepared, Scenario, parse_scenario, prepare, simulate

PIPELINE = "digits"


def flow_scenario(config: TrainConfig, steps: int) -> Scenario:
    """The training config as a scenario the planner understands (the same graph the simulator would run)."""
    algo = config.algo
    trained = len(step_timesteps(config, 0))
    return parse_scenario(
        {
            "name": "train-" + config.policy,
            "cluster": {"device": config.cluster.device, "devices": config.cluster.devices},
            "pipelines": [
                {
                    "kind": "flow",
                    "name": PIPELINE,
                    "model": "digits-t2i",
                    "algorithm": "dancegrpo" if config.algorithm == "dance_grpo" else "flowgrpo",
                    "prompts": algo.prompts_per_step,
                    "group": algo.group_size,
                    "denoising_steps": config.sampling.num_steps,
                    "trained_timesteps": trained,
                    "height": 8,
                    "width": 8,
                    "reward": "rule",
                    # train.chunk_size (sample, timestep) pairs share one forward/backward
                    "micro_batch": max(1, config.train.chunk_size // trained),
                }
            ],
            "schedule": {
                "steps": steps,
                "policies": [config.policy],
                "trainer_devices": config.runtime.trainer_devices,
                "reward_devices": config.runtime.reward_devices,
            },
        },
        "training config",
    )


def shape_overrides(config: TrainConfig) -> dict:
    runtime = config.runtime
    return {k: v for k, v in (("fragments", runtime.fragments), ("tsp_chunk", runtime.tsp_chunk)) if v is not None}


def policy_options(config: TrainConfig) -> dict:
    return {"tag": {"auto": True, "off": False, "force": "force"}[config.runtime.tag]}


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


_POOLS: dict[str, list] = {}


def start_workers(config: TrainConfig, trainer_state: dict) -> tuple[list, ray.ObjectRef, ray.ObjectRef]:
    """One DeviceWorker per device, placed through a placement group (one bundle per device),
    configured for this run and holding `trainer_state` (weights + optimizer). The actors are kept
    for the next run on the same kind of device in this process."""
    pool = _POOLS.setdefault(config.cluster.device, [])
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
    measured = {kind: statistics.median(profile[kind] for profile in profiles) for kind in profiles[0]}
    measured |= {
        kind: min(profile[kind] for profile in profiles) for kind in ("generate_fastest", "generate_small_fastest")
    }
    start = time.perf_counter()
    ray.get(workers[0].switch_role.remote("rollout"))
    measured["switch"] = time.perf_counter() - start
    return fitted_cost(config, scenario, measured)


def fitted_cost(config: TrainConfig, scenario: Scenario, measured: dict[str, float]) -> CostModel:
    """The analytic cost model fitted to a device's measured seconds: the small-pass half point from the fastest
    generation at two batch sizes, then one correction per kind of work (`CostModel.from_measurements`)."""
    samples = config.runtime.profile_samples
    spec = scenario.pipelines[0]
    model = diffusion_model(spec.model)
    tokens = model.latent_tokens(spec.height, spec.width)
    small = max(1, samples // 4)
    ratio = measured["generate_fastest"] / measured["generate_small_fastest"]
    half = tokens * (samples - ratio * small) / (ratio - 1) if ratio > 1 else DEFAULT.dit_half_mfu_tokens
    calibration = replace(DEFAULT, dit_half_mfu_tokens=max(half, 0.0))

    analytic = CostModel(config.cluster.device, calibration)
    engines = prepare(scenario, config.policy, steps=1, cost=analytic, **shape_overrides(config)).setup.engines[
        PIPELINE
    ]
    predicted = {
        "generate": analytic.generate(model, samples, spec.height, spec.width, spec.denoising_steps),
        "score": analytic.rule_score(samples),
        "logprob": analytic.dit_logprob(model, samples, 1, tokens),
        "train": analytic.dit_train(model, samples, 1, tokens),
        "optimizer": analytic.optimizer_step(model.params),
        "publish": analytic.publish(model.params),
        "switch": engines.wake_s[Role.ROLLOUT],
    }
    records = [(kind, predicted[kind], max(measured[kind], 1e-9)) for kind in predicted]
    return CostModel.from_measurements(config.cluster.device, records, calibration)


def prepare_run(config: TrainConfig, steps: int, workers: list) -> tuple[CostModel, Prepared]:
    scenario = flow_scenario(config, steps)
    cost = profiled_cost(config, scenario, workers)
    return cost, prepare(
        scenario, config.policy, steps=steps, cost=cost, options=policy_options(config), **shape_overrides(config)
    )


DRY_RUN_STEPS = 3
"""RL steps the dry run simulates: enough for the steady state of every policy (TCSS overlaps two)."""


def dry_run(config: TrainConfig, steps: int) -> dict:
    """What `dovetail train` would do for `steps` steps, without Ray: the checkpoint and the devices checked, then
    the policy's shape and throughput as the simulator predicts them. On CPU cores the costs are profiled here, in
    this process, as the run profiles its devices; for GPUs they are the device catalogue's analytic costs
    (the run, profiling its GPUs, may then choose another shape)."""
    checkpoint_weights(config.model.checkpoint)
    if config.policy == "reference":
        return {"policy": "reference"}
    device_bundle(config)
    simulated = min(steps, DRY_RUN_STEPS)
    scenario = flow_scenario(config, simulated)
    cost = None
    if device(config.cluster.device).platform == "cpu":
        torch.set_num_threads(1)
        measured = profile_work(
            load_model(config.model.checkpoint),
            config,
            sde_settings(config),
            config.runtime.profile_samples,
            carry=lambda weights: pickle.loads(pickle.dumps(weights)),
        )
        cost = fitted_cost(config, scenario, measured | {"switch": 0.0})  # no Ray round trip to time here
    prepared, trace = simulate(
        scenario, config.policy, steps=simulated, options=policy_options(config), cost=cost, **shape_overrides(config)
    )
    shape, metrics = prepared.setup.shapes[PIPELINE], summarize(trace)
    return {
        "policy": config.policy,
        "devices": config.cluster.devices,
        "device": config.cluster.device,
        "fragments": shape.fragments,
        "tsp_chunk": shape.tsp_chunk,
        "trainer_devices": shape.trainer_devices,
        "rollout_devices": config.compute_devices - shape.trainer_devices,
        "reward_devices": config.runtime.reward_devices,
        "recompute_logprob": shape.recompute_logprob,
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
