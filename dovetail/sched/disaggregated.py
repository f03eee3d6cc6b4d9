"""`disaggregated`: verl-omni's `separate` mode (the DigenRL authors' own first step).

A rollout pool and a trainer pool that never switch; the stage order is colocated's — the whole batch
is generated and scored before the trainer starts (full-batch barrier), old log-probs are recomputed,
training is the per-timestep loop, and weights are published once per step."""

from __future__ import annotations

from dovetail.graph.flow import FlowShape
from dovetail.graph.spec import PipelineSpec
from dovetail.sched.colocated import StagedFlow, data_parallel_fragments, flow_only
from dovetail.sched.policy import Setup


def split_pools(devices: int, trainer_devices: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Rollout devices first, trainer devices last; half and half unless told."""
    if devices < 2:
        raise ValueError(
            f"a rollout pool and a trainer pool need at least 2 devices, there {'is' if devices == 1 else 'are'} "
            f"{devices} to generate and train on: add devices (cluster.devices) or use colocated, which shares them"
        )
    trainers = trainer_devices or devices // 2
    if not 1 <= trainers < devices:
        raise ValueError(
            f"trainer_devices={trainers} must be in 1..{devices - 1}, leaving a rollout device of the {devices}"
        )
    return tuple(range(devices - trainers)), tuple(range(devices - trainers, devices))


class Disaggregated(StagedFlow):
    name = "disaggregated"
    switching = False

    @classmethod
    def shape(cls, spec: PipelineSpec, devices: int, trainer_devices: int | None, cost) -> FlowShape:
        spec = flow_only(cls.name, spec)
        rollout, trainer = split_pools(devices, trainer_devices)
        return FlowShape(
            data_parallel_fragments(spec, len(rollout)), 1, spec.recompute_logprob, len(trainer), staged=True
        )

    def pools(self, setup: Setup) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return split_pools(setup.compute_devices, setup.trainer_devices)
