"""`colocated`: how veRL-Omni's hybrid engine, GenRL and flow_grpo schedule a FlowGRPO step.

Every device holds both engines and takes turns: all devices generate their share of the batch ->
barrier -> score -> sleep rollout / wake trainer -> recompute old log-probs over the batch -> the
per-timestep training loop (one forward/backward per trained timestep, no TSP) -> optimizer step ->
weight sync -> sleep trainer / wake rollout. The stage order is shared with `disaggregated`, which
runs it on two fixed pools instead of switching. With a reward pool (veRL-Omni's async reward) the judge scores each
prompt's group as it is generated and the trainer takes over once generation ends; training waits for the scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from dovetail.graph.flow import FlowShape
from dovetail.graph.node import Kind, Node, Role
from dovetail.graph.spec import FlowSpec, PipelineSpec
from dovetail.sched.policy import (
    Begin,
    Decision,
    Event,
    Policy,
    Run,
    SearchContext,
    Setup,
    Shape,
    SwitchRole,
    VersionPublished,
    all_idle,
    best_by_forecast,
    idle_devices,
    open_steps_on_publish,
    ready_of,
    reward_roles,
    score_on_reward_pool,
)


def flow_only(policy: str, spec: PipelineSpec) -> FlowSpec:
    if not isinstance(spec, FlowSpec):
        raise ValueError(f"policy {policy} schedules flow pipelines; pipeline {spec.name!r} is {spec.kind}")
    return spec


def flow_shape(policy: str, shape: Shape) -> FlowShape:
    """A shape a flow policy was given back (`SearchContext.shapes`, `Setup.shapes`): its own `shape`'s, a FlowShape."""
    if not isinstance(shape, FlowShape):
        raise TypeError(f"policy {policy} cuts flow steps; got a {type(shape).__name__}")
    return shape


def _chunk_start(train: Node) -> int:
    assert train.timesteps is not None  # graph.flow gives every train node its TSP chunk
    return train.timesteps[0]


def data_parallel_fragments(spec: FlowSpec, devices: int) -> int:
    """One fragment per rollout device (verl chunks the batch's samples evenly), a multiple of the mini-batch count."""
    fragments = min(spec.samples, devices)
    return max(spec.mini_batches, fragments - fragments % spec.mini_batches)


def fits(spec: FlowSpec, shape: FlowShape, cost) -> bool:
    """Every node of a step fits beside its role's engine on a device (the check `plan.prepare.prepare` makes)."""
    held = shape.engines(spec, cost).resident_gb
    capacity = cost.device.memory_bytes / 1e9
    return all(held.get(n.role, 0.0) + n.memory_gb <= capacity for n in shape.build(spec, 1, cost))


class StagedFlow(Policy):
    """Stage-synchronous FlowGRPO on a rollout pool and a trainer pool (the same devices when colocated).
    Trainer nodes run on the whole trainer pool, one at a time, as one FSDP group (verl's default `fsdp_size: -1`,
    what the published veRL-Omni runs use and the cross-node calibration was fitted on), or, with `hybrid_sharding`
    (`colocated-hsdp`), the faster of that and FSDP groups of one node replicated across nodes (`plan_shapes`)."""

    pipeline_kinds = frozenset({"flow"})

    switching: bool
    supports_reward_pool = True
    hybrid_sharding: bool = False
    fixes = {
        "tsp_chunk": "trains one timestep per forward/backward (the per-timestep loop)",
        "fragments": "splits each mini-batch's samples evenly over its rollout devices (verl's data.chunk)",
    }

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        if len(setup.engines) != 1:
            raise ValueError(f"policy {self.name} runs one pipeline, got {sorted(setup.engines)}")
        (self.pipeline,) = setup.engines
        self.rollout_pool, self.trainer_pool = self.pools(setup)
        self.everyone = tuple(range(setup.compute_devices))
        """Every device that holds the policy's engines (reward devices hold only the reward engine)."""

    @classmethod
    def plan_shapes(cls, context: SearchContext) -> dict[str, Shape]:
        """verl's `fsdp_size`: the trainer pool as one FSDP group (its default, -1) or, past one node, HSDP groups of
        a node (parameters gathered inside the node, gradients all-reduced across nodes once per optimizer step),
        whichever the simulator finds faster over the run's steps — what a user tuning a multi-node run sets."""
        shapes = dict(context.shapes)
        if len(context.specs) != 1 or not cls.hybrid_sharding:
            return shapes  # __init__ refuses several pipelines
        spec = flow_only(cls.name, context.specs[0])
        shape, cost = flow_shape(cls.name, shapes[spec.name]), context.costs[spec.name]
        node = cost.device.node_size
        if shape.trainer_devices <= node or shape.trainer_devices % node:
            return shapes
        hybrid = replace(shape, trainer_group=node)
        if not fits(spec, hybrid, cost):
            return shapes
        return best_by_forecast(
            [shapes, {spec.name: hybrid}], context.forecast, context.horizon, context.forecast_beating
        )

    @classmethod
    def with_reward_pool(cls, specs: Sequence[PipelineSpec], shapes: dict[str, Shape]) -> dict[str, Shape]:
        """veRL-Omni's async reward: the judge on its own devices scores each prompt's group as the rollout returns
        it, overlapped with the rest of the generation. Each rollout device then generates its share one group after
        another (a fragment per prompt), and the reward pool scores each fragment as it finishes; without this the
        fragments would all end together and the whole batch would be judged after generation."""
        cut: dict[str, Shape] = {}
        for spec in specs:
            flow, shape = flow_only(cls.name, spec), flow_shape(cls.name, shapes[spec.name])
            cut[spec.name] = replace(shape, fragments=max(shape.fragments, flow.prompts))
        return cut

    def pools(self, setup: Setup) -> tuple[tuple[int, ...], tuple[int, ...]]:
        raise NotImplementedError

    def _initial_roles(self) -> list[Decision]:
        roles = {d: Role.ROLLOUT for d in self.rollout_pool}
        if not self.switching:
            roles.update({d: Role.TRAINER for d in self.trainer_pool})
        return [self.setup.switch(d, self.pipeline, None, role) for d, role in roles.items()] + reward_roles(
            self.setup, self.pipeline
        )

    def _finished(self, view, step: int, kind: Kind) -> bool:
        return all(n.id in view.finished for n in view.graph.of(self.pipeline, step, kind))

    def decide(self, view, events: Sequence[Event]) -> list[Decision]:
        decisions: list[Decision] = []
        for event in events:
            if isinstance(event, Begin):
                decisions += self._initial_roles()
            elif (
                isinstance(event, VersionPublished)
                and self.switching
                and event.version in view.graph.steps(self.pipeline)
            ):
                if event.version > 0:
                    decisions += [
                        self.setup.switch(d, self.pipeline, Role.TRAINER, Role.ROLLOUT) for d in self.everyone
                    ]
        decisions += open_steps_on_publish(view, events)
        if not view.started:
            return decisions
        step = max(s for (_, s) in view.started)
        if any(isinstance(d, SwitchRole) for d in decisions):
            return decisions

        publish = ready_of(view, Kind.PUBLISH)
        if publish:
            if all_idle(view, self.everyone):
                decisions.append(Run(publish[0].id, self.everyone))
            return decisions

        generated = self._finished(view, step, Kind.GENERATE)
        # A reward pool scores while the trainer wakes and recomputes old log-probs (verl's async reward is awaited
        # after old_log_prob); train nodes still wait for their scores. Without one, the rollout devices score first.
        handed_over = generated if self.setup.reward_devices else generated and self._finished(view, step, Kind.SCORE)
        if self.switching and handed_over and view.devices[0].role == Role.ROLLOUT and all_idle(view, self.everyone):
            return decisions + [self.setup.switch(d, self.pipeline, Role.ROLLOUT, Role.TRAINER) for d in self.everyone]

        trainer_ready = all_idle(view, self.trainer_pool) and all(
            view.devices[d].role == Role.TRAINER for d in self.trainer_pool
        )
        if handed_over and trainer_ready:
            node = self._next_trainer_node(view, step)
            if node is not None:
                decisions.append(Run(node.id, self.trainer_pool))

        rollout = idle_devices(view, self.rollout_pool, Role.ROLLOUT)
        work = ready_of(view, Kind.GENERATE)
        if self._finished(view, step, Kind.GENERATE):
            work = [] if self.setup.reward_devices else ready_of(view, Kind.SCORE)
        for node, device in zip(work, rollout):
            decisions.append(Run(node.id, (device,)))
        return decisions + score_on_reward_pool(view, self.setup, self.pipeline)

    def _next_trainer_node(self, view, step: int) -> Node | None:
        """Optimizer step first, then the per-timestep loop once every old log-prob is recomputed."""
        if commits := ready_of(view, Kind.COMMIT):
            return commits[0]
        if self._finished(view, step, Kind.LOGPROB):
            trains = ready_of(view, Kind.TRAIN)
            return min(trains, key=_chunk_start) if trains else None
        logprobs = ready_of(view, Kind.LOGPROB)
        return logprobs[0] if logprobs else None


class Colocated(StagedFlow):
    name = "colocated"
    switching = True
    fixes = StagedFlow.fixes | {"trainer_devices": "trains on every device"}

    @classmethod
    def shape(cls, spec: PipelineSpec, devices: int, trainer_devices: int | None, cost) -> FlowShape:
        spec = flow_only(cls.name, spec)
        return FlowShape(data_parallel_fragments(spec, devices), 1, spec.recompute_logprob, devices, staged=True)

    def pools(self, setup: Setup) -> tuple[tuple[int, ...], tuple[int, ...]]:
        everyone = tuple(range(setup.compute_devices))
        return everyone, everyone


class ColocatedHSDP(Colocated):
    """`colocated` as a user tuning veRL-Omni for a multi-node cluster runs it: `fsdp_size` set to one node (HSDP)
    where the simulator finds that faster than one FSDP group over every device."""

    name = "colocated-hsdp"
    hybrid_sharding = True
    searches = True
