"""What the language-model policies share: device groups, node placement and a stage walker.

LM policies place nodes the same way — a shard's prefill / decode chain on its rollout engine,
trainer work on the whole trainer group — and differ in *when* they let work start and which devices
hold which role.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from weakref import WeakKeyDictionary

from dovetail.graph.lm import ROLLOUT_STAGE_KINDS, LMShape, stage
from dovetail.graph.node import Graph, Kind, Node, Role
from dovetail.graph.spec import LMSpec, PipelineSpec
from dovetail.sched.policy import Begin, Decision, Event, MemoryRefusal, Policy, Run, Shape, StartStep, View


def engine_devices(group: Sequence[int], shard: int, tensor_parallel: int) -> tuple[int, ...]:
    start = shard * tensor_parallel
    return tuple(group[start : start + tensor_parallel])


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


def rollout_engines(spec: LMSpec, devices: int) -> int:
    engines = devices // spec.tensor_parallel
    if engines < 1:
        raise ValueError(
            f"{spec.name}: tensor_parallel={spec.tensor_parallel} needs more devices than the {devices} it has"
        )
    return min(engines, spec.batch)


_stages: WeakKeyDictionary[Graph, dict[tuple[str, int], dict[str, tuple[str, ...]]]] = WeakKeyDictionary()


def stage_nodes(graph: Graph, pipeline: str, step: int) -> Mapping[str, tuple[str, ...]]:
    """The ids of one step's nodes by verl stage (`graph.lm.stage`), each in topological order: kept per graph, as
    the staged policies ask at every decision which stage a step is in."""
    steps = _stages.setdefault(graph, {})
    if (pipeline, step) not in steps:
        grouped: dict[str, list[str]] = {}
        for node in graph.of(pipeline, step):
            grouped.setdefault(stage(node), []).append(node.id)
        steps[(pipeline, step)] = {name: tuple(ids) for name, ids in grouped.items()}
    return steps[(pipeline, step)]


def step_done(view: View, pipeline: str, step: int, stage_name: str) -> bool:
    return all(n in view.finished for n in stage_nodes(view.graph, pipeline, step).get(stage_name, ()))


class StagedLMPolicy(Policy):
    """Common machinery: role switches for a device group, rollout placement, trainer stages in order."""

    pipeline_kinds = frozenset({"lm"})

    def ready_nodes(self, view: View, pipeline: str) -> list[Node]:
        return [view.graph[n] for n in view.ready if view.graph[n].pipeline == pipeline]

    def place_rollout(self, view: View, group: Sequence[int], tensor_parallel: int, nodes: Sequence[Node]) -> list[Run]:
        """Each shard's chain on its engine; the migrated tail on the group's first engine."""
        decisions: list[Run] = []
        busy: set[int] = set()
        for node in nodes:
            if node.kind not in ROLLOUT_STAGE_KINDS:
                continue
            shard = node.shard
            devices = engine_devices(group, 0 if shard is None else shard, tensor_parallel)
            if busy.isdisjoint(devices) and self.free(view, devices, Role.ROLLOUT):
                decisions.append(Run(node.id, devices))
                busy |= set(devices)
        return decisions

    @staticmethod
    def free(view: View, devices: Sequence[int], role: Role) -> bool:
        """Every device idle and holding `role`: one pass, stopping at the first that is not (asked of each rollout
        engine and the trainer group at every decision)."""
        states = view.devices
        for device in devices:
            state = states[device]
            if not state.idle or state.role != role:
                return False
        return True

    def switch_group(self, view: View, pipeline: str, group: Sequence[int], role: Role) -> list[Decision]:
        """Switch every idle device of the group that does not hold `role` yet."""
        return [
            self.setup.switch(d, pipeline, view.devices[d].role, role)
            for d in group
            if view.devices[d].idle and view.devices[d].role != role
        ]

    def run_trainer_stage(
        self, view: View, pipeline: str, step: int, group: Sequence[int], ready: Sequence[Node], name: str
    ) -> list[Decision]:
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


def lm_only(policy: str, spec: PipelineSpec) -> LMSpec:
    """`spec`, a language model's, which `policy` schedules: every LM policy runs a step of several draws (dynamic
    sampling, `graph.lm`: each draw's rollout follows the score of the one before) as it runs any step's nodes."""
    if not isinstance(spec, LMSpec):
        raise ValueError(f"{policy} schedules language-model pipelines; {spec.name!r} is a {spec.kind} pipeline")
    return spec


def lm_shape(policy: str, shape: Shape) -> LMShape:
    """A shape an LM policy was given back (`SearchContext.shapes`, `Setup.shapes`): its own `shape`'s, an LMShape."""
    if not isinstance(shape, LMShape):
        raise TypeError(f"policy {policy} cuts language-model steps; got a {type(shape).__name__}")
    return shape


def tensor_parallel(view: View, pipeline: str, group: Sequence[int]) -> int:
    """Devices per rollout engine: the group's devices over the step's shards (one prefill each, in each draw)."""
    shards = len({n.shard for n in view.graph.of(pipeline, view.graph.steps(pipeline)[0], Kind.PREFILL)})
    return len(group) // shards


def rollout_seconds(nodes: Sequence[Node], tensor_parallel: int) -> float:
    """Wall time of a step's rollout: the slowest engine's prefill / decode chain, plus the migrated tail."""
    chains: dict[int | None, float] = {}
    for node in nodes:
        if stage(node) == "rollout":
            shard = node.shard
            chains[shard] = chains.get(shard, 0.0) + node.seconds_on(tensor_parallel)
    tail = chains.pop(None, 0.0)
    return max(chains.values(), default=0.0) + tail


TRAINER_KINDS = frozenset({Kind.LOGPROB, Kind.TRAIN, Kind.COMMIT, Kind.PUBLISH})
"""The trainer's work in a step of either kind of pipeline (a flow publish holds role ANY, an LM one TRAINER)."""


def trainer_seconds(nodes: Sequence[Node], trainer_devices: int) -> float:
    """Wall time of a step's trainer work on a group of `trainer_devices` (collectives take their cost)."""
    return sum(n.seconds_on(trainer_devices) for n in nodes if n.kind in TRAINER_KINDS)


class SplitLMPolicy(StagedLMPolicy):
    """A disaggregated LM system: each pipeline's slice of the pool is cut into a rollout pool and a
    trainer pool that never switch; engines generate continuously (oldest open step first) and the
    trainer group runs one node at a time. A step opens as soon as its rollouts would be at most
    `setup.max_staleness` versions behind; subclasses may hold the trainer back (`trainable`)."""

    splits_pool = True
    stream = False

    @classmethod
    def shape(cls, spec: PipelineSpec, devices: int, trainer_devices: int | None, cost) -> LMShape:
        """The trainer pool that balances rollout and training time (they overlap), within memory."""
        from dovetail.cost.catalog import device as lookup_device

        spec = lm_only(cls.name, spec)
        capacity = lookup_device(cost.device.name).memory_bytes / 1e9
        tp = spec.tensor_parallel
        if devices < tp + 1:
            raise ValueError(
                f"{spec.name}: {cls.name} splits the pipeline's {devices} device{'s' if devices > 1 else ''} into a "
                f"rollout engine of tensor_parallel={tp} and a trainer pool of at least 1, so it needs {tp + 1}: "
                "add devices (cluster.devices) or use verl-sync or jigsaw, which share them"
            )
        if trainer_devices and devices - trainer_devices < tp:
            raise ValueError(
                f"{spec.name}: trainer_devices={trainer_devices} leaves {devices - trainer_devices} of the pipeline's "
                f"{devices} devices to roll out, fewer than tensor_parallel={tp}: lower it"
            )
        best: tuple[float, LMShape] | None = None
        least_gb = float("inf")
        for trainers in [trainer_devices] if trainer_devices else range(1, devices - tp + 1):
            shape = LMShape(rollout_engines(spec, devices - trainers), trainers, stream=cls.stream)
            resident = shape.engines(spec, cost).resident_gb[Role.TRAINER]
            if resident > capacity:  # the trainer state alone is too large: no cut of the step needs pricing
                least_gb = min(least_gb, resident)
                continue
            nodes = shape.build(spec, 1, cost)
            need = resident + max(n.memory_gb for n in nodes)
            least_gb = min(least_gb, need)
            if need > capacity:
                continue
            predicted = max(rollout_seconds(nodes, tp), trainer_seconds(nodes, trainers))
            if best is None or predicted < best[0]:
                best = (predicted, shape)
        if best is None:
            largest = trainer_devices or devices - tp
            fix = (
                "set replicated_trainer: false (a replica holds the whole trainer state, whatever the device count)"
                if spec.replicated_trainer
                else "add devices (cluster.devices)"
            )
            raise MemoryRefusal(
                f"{spec.name}: {cls.name}'s trainer needs {least_gb:.0f} GB per device even on {largest} trainer "
                f"device{'s' if largest > 1 else ''} (the rest roll out), more than {capacity:.0f} GB: {fix} or raise "
                "micro_batches (fewer tokens per trainer pass)"
            )
        return best[1]

    def pools(self, view: View, pipeline: str, group: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Rollout devices first, the trainer group last."""
        trainers = self.setup.trainer_groups[pipeline]
        return group[: len(group) - trainers], group[len(group) - trainers :]

    def opens(self, view: View, pipeline: str, step: int) -> int | None:
        """Open the next step on the latest weights as soon as the staleness bound allows."""
        version = view.published[pipeline]
        return version if step - version <= self.setup.max_staleness else None

    def trainable(self, view: View, pipeline: str, step: int) -> bool:
        """Whether the trainer may work on the step's ready nodes now (streaming: always)."""
        return True

    def decide(self, view: View, events: Sequence[Event]) -> list[Decision]:
        pipelines = view.graph.pipelines()
        decisions: list[Decision] = []
        for pipeline, group in zip(pipelines, split_pool(self.setup.devices, len(pipelines))):
            rollout, trainer = self.pools(view, pipeline, group)
            if any(isinstance(e, Begin) for e in events):
                decisions += self.switch_group(view, pipeline, rollout, Role.ROLLOUT)
                decisions += self.switch_group(view, pipeline, trainer, Role.TRAINER)
                continue
            decisions += self._open(view, pipeline)
            ready = sorted(self.ready_nodes(view, pipeline), key=lambda n: n.step)
            placed = self.place_rollout(view, rollout, tensor_parallel(view, pipeline, rollout), ready)
            placed += self._train(view, trainer, ready)
            taken = {d for decision in placed for d in decision.devices}
            decisions += placed + self.run_scores(view, ready, [d for d in rollout + trainer if d not in taken])
        return decisions

    def _open(self, view: View, pipeline: str) -> list[Decision]:
        opened = [s for (p, s) in view.started if p == pipeline]
        following = max(opened) + 1 if opened else view.graph.steps(pipeline)[0]
        if following not in view.graph.steps(pipeline):
            return []
        version = self.opens(view, pipeline, following)
        return [] if version is None else [StartStep(pipeline, following, version)]

    def _train(self, view: View, trainer: tuple[int, ...], ready: Sequence[Node]) -> list[Run]:
        if not self.free(view, trainer, Role.TRAINER):
            return []
        for node in ready:
            if node.role == Role.TRAINER and self.trainable(view, node.pipeline, node.step):
                return [Run(node.id, trainer)]
        return []
