"""What the language-model policies share: device groups, node placement and a stage walker.

LLM policies place nodes the same way — a shard's prefill / decode chain on its rollout engine,
trainer work on the whole trainer group — and differ in *when* they let work start and which devices
hold which role.
"""

from __future__ import annotations

from collections.abc import Sequence

from dovetail.graph.llm import LLMShape, stage
from dovetail.graph.node import Kind, Node, Role
from dovetail.graph.spec import LLMSpec, PipelineSpec
from dovetail.sched.policy import Decision, Policy, Run, View

def shard_of(node: Node) -> int | None:
    """The rollout engine a prefill / home decode node belongs to (None for the migrated tail)."""
    parts = node.id.split("/")
    if node.kind in (Kind.PREFILL, Kind.DECODE) and parts[3] != "tail":
        return int(parts[3])
    return None


def engine_devices(group: Sequence[int], shard: int, tensor_parallel: int) -> tuple[int, ...]:
    start = shard * tensor_parallel
    return tuple(group[start:start + tensor_parallel])


def split_pool(devices: int, parts: int) -> list[tuple[int, ...]]:
    """`devices` in `parts` contiguous groups (sizes differ by at most one)."""
    if parts > devices:
        raise ValueError(f"{parts} pipelines need at least {parts} devices, the pool has {devices}")
    base, extra = divmod(devices, parts)
    groups, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        groups.append(tuple(range(start, start + size)))
        start += size
    return groups


def rollout_engines(spec: LLMSpec, devices: int) -> int:
    engines = devices // spec.tensor_parallel
    if engines < 1:
        raise ValueError(
            f"{spec.name}: tensor_parallel={spec.tensor_parallel} needs more devices than the {devices} it has"
        )
    return min(engines, spec.batch)


def step_done(view: View, pipeline: str, step: int, stage_name: str) -> bool:
    return all(n.id in view.finished for n in view.graph.of(pipeline, step) if stage(n) == stage_name)


class StagedLLMPolicy(Policy):
    """Common machinery: role switches for a device group, rollout placement, trainer stages in order."""

    def ready_nodes(self, view: View, pipeline: str) -> list[Node]:
        return [view.graph[n] for n in view.ready if view.graph[n].pipeline == pipeline]

    def place_rollout(self, view: View, group: Sequence[int], tensor_parallel: int, nodes: Sequence[Node]) -> list[Decision]:
        """Each shard's chain on its engine; the migrated tail on the group's first engine."""
        decisions: list[Decision] = []
        busy: set[int] = set()
        for node in nodes:
            if stage(node) != "rollout":
                continue
            shard = shard_of(node)
            devices = engine_devices(group, 0 if shard is None else shard, tensor_parallel)
            if self.free(view, devices, Role.ROLLOUT) and not busy & set(devices):
                decisions.append(Run(node.id, devices))
                busy |= set(devices)
        return decisions

    @staticmethod
    def free(view: View, devices: Sequence[int], role: Role) -> bool:
        return all(view.devices[d].idle and view.devices[d].role == role for d in devices)

    def switch_group(self, view: View, pipeline: str, group: Sequence[int], role: Role) -> list[Decision]:
        """Switch every idle device of the group that does not hold `role` yet."""
        return [
            self.setup.switch(d, pipeline, view.devices[d].role, role)
            for d in group
            if view.devices[d].idle and view.devices[d].role != role
        ]

    def run_trainer_stage(self, view: View, pipeline: str, step: int, group: Sequence[int], ready: Sequence[Node], name: str) -> list[Decision]:
        """One node of a trainer stage at a time on the whole trainer group (FSDP data parallel)."""
        if not self.free(view, group, Role.TRAINER):
            return []
        for node in ready:
            if node.step == step and stage(node) == name:
                return [Run(node.id, tuple(group))]
        return []

    def run_scores(self, view: View, ready: Sequence[Node], group: Sequence[int]) -> list[Decision]:
        """Rule rewards are tiny; run each on a free device of the group."""
        decisions: list[Decision] = []
        free = [d for d in group if view.devices[d].idle]
        for node in ready:
            if stage(node) == "score" and free:
                decisions.append(Run(node.id, (free.pop(0),)))
        return decisions


def llm_only(policy: str, spec: PipelineSpec) -> LLMSpec:
    if not isinstance(spec, LLMSpec):
        raise ValueError(f"{policy} schedules language-model pipelines; {spec.name!r} is a {spec.kind} pipeline")
    return spec


def tensor_parallel(view: View, pipeline: str, group: Sequence[int]) -> int:
    """Devices per rollout engine: the group's devices over the step's shards (one prefill each)."""
    shards = len(view.graph.of(pipeline, view.graph.steps(pipeline)[0], Kind.PREFILL))
    return len(group) // shards
