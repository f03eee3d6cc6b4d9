"""digen's shape search: how digen (and digen+tcss) cut a flow pipeline's step, chosen by the simulator.

`candidates` ranks pool splits (a window around the split balancing predicted rollout and training device-seconds),
trainer group sizes, fragment counts and TSP chunks by the cost model (`predict_makespan`); it includes the
colocated-like shared shape (every device generates, then trains with TSP in groups, no recompute). `plan_shapes`
then simulates the best few, the best shared one, each with TAG allowed and not (and, for digen+tcss, with TCSS off
too: digen's own candidates), the best shared one stage-synchronous, and the staged baselines' shapes, and keeps the
fastest: the chosen shape is never slower in the simulator than one it considered, digen+tcss never slower than digen.
The policy that runs a shape is `sched.digen`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from dovetail.cost.catalog import DEVICES
from dovetail.cost.catalog import device as lookup_device
from dovetail.cost.model import CostModel
from dovetail.graph.flow import FlowShape, StepTotals, build_flow, engines, step_totals
from dovetail.graph.node import Engines, Kind, Node, Role
from dovetail.graph.spec import FlowSpec
from dovetail.sched.colocated import Colocated, fits, flow_only
from dovetail.sched.disaggregated import Disaggregated
from dovetail.sched.policy import MemoryRefusal, SearchContext, Shape, Tag, best_by_forecast

SIMULATED = 4
"""Shapes of each kind (synchronous, TCSS) the search simulates: the cost model's best few, and the best shared one
(the cost model ranks within a few percent of the simulator; the simulator settles the order)."""


RANKING_DEVICE = "H100"
"""The device the cost model ranks digen's cuts on, whatever the run's device (`ranking_model`): which cuts the
search simulates must not depend on how fast the device is, or a faster device could miss the cut a slower one
wins with (digen+tcss on digen-qwenimage-32 was slower on H200 than on H100). The simulator, on the run's device,
then chooses among them."""


@lru_cache(maxsize=8)
def ranking_model(cost: CostModel) -> CostModel:
    """`cost` on `RANKING_DEVICE` with its own device's node size (corrections kept), for a device of its platform;
    a device of another platform (a CPU core) ranks on itself: no catalogue device of its platform dominates it, and
    an H100's proportions of compute, memory and links are not a CPU core's."""
    ranking = lookup_device(RANKING_DEVICE)
    if cost.device.platform != ranking.platform:
        return cost
    return cost.ranked_on(ranking)


@dataclass(frozen=True)
class DigenShape(FlowShape):
    """A digen cut with the run-time choices the search makes per shape. A run's options may fix TAG over `tag`
    (`PolicyOptions.tag`); `tcss` matters only to digen+tcss (digen never overlaps steps)."""

    tag: bool = True
    """TAG may lend idle trainer devices to generation (where it pays)."""
    tcss: bool = True
    """Under digen+tcss, step s + 1 starts on weights s once every fragment of step s has started (its search turns it
    off where that is faster, and where the trainer pool is every device: nothing to overlap)."""

    @classmethod
    def of(cls, shape: FlowShape) -> DigenShape:
        """`shape` with digen's choices: its own, or the defaults above for a shape cut without them (a staged
        baseline's, or one a caller gave)."""
        return cls(**asdict(shape))

    def describe(self) -> str:
        return f"{super().describe()}, TAG {'on' if self.tag else 'off'}, TCSS {'on' if self.tcss else 'off'}"


@lru_cache(maxsize=65536)
def predict_makespan(
    rollout_free: tuple[float, ...],
    pending: int,
    arrivals: tuple[float, ...],
    trainer_free: float,
    generate_s: float,
    score_s: float,
    train_s: float,
    tail_s: float,
    tag: int = 0,
    tag_in_s: float = 0.0,
    tag_out_s: float = 0.0,
    now: float = 0.0,
    groups: int = 1,
) -> float:
    """End of the step under GAP: `pending` fragments go to the earliest-free rollout device, `tag` of
    them to trainer devices (each pays `tag_in_s`, generates, pays `tag_out_s`, holding the trainer pool
    until all are back); each fragment trains (`train_s`) on the earliest-free of `groups` trainer groups
    in arrival order, then `tail_s` (optimizer step and publication)."""
    free = list(rollout_free)
    heapq.heapify(free)
    landed = list(arrivals)
    trainer = trainer_free
    if tag:
        landed += [now + tag_in_s + generate_s + score_s] * tag
        trainer = max(trainer, now + tag_in_s + generate_s + tag_out_s)
    # `heapreplace` of the earliest: the same values as popping it and pushing the new one, in one sift.
    for _ in range(pending - tag):
        done = free[0] + generate_s
        landed.append(done + score_s)
        heapq.heapreplace(free, done)
    trainers = [trainer] * groups
    for arrival in sorted(landed):
        earliest = trainers[0]
        heapq.heapreplace(trainers, (earliest if earliest > arrival else arrival) + train_s)
    return max(trainers) + tail_s


def _step_costs(totals: StepTotals, fragments: int, group: int) -> tuple[float, float, float, float, float]:
    """Per-fragment generate, score and (one trainer group's wall) train seconds — reference forwards
    included —, the trainer's tail of the step (optimizer step, publication) and one rollout device's
    weight load (the publication's bytes through its own host link)."""
    total = totals.seconds
    return (
        total[Kind.GENERATE] / fragments,
        total[Kind.SCORE] / fragments,
        (total[Kind.TRAIN] + total[Kind.LOGPROB]) / fragments / group,
        total[Kind.COMMIT] + total[Kind.PUBLISH],
        total[Kind.PUBLISH],
    )


def trainer_layout(devices: int, trainers: int, group: int, node_size: int) -> tuple[int, ...] | None:
    """Devices of a trainer pool of `trainers` cut into FSDP groups of `group`: groups no larger than a node each lie
    inside one node, as many as fit at the end of each node from the last one (12 trainers in groups of 6 on two nodes
    of 8: devices 2-7 and 10-15), the other devices generate; a larger group, the last `trainers` devices. The cost
    model prices a group within a node on the intra-node links, so a group must not straddle two. None when the groups
    do not fit inside the nodes, or do not divide the pool."""
    if trainers % group:
        return None
    if group > node_size:
        return tuple(range(devices - trainers, devices))
    layout: list[int] = []
    remaining = trainers // group
    for start in range(devices - (devices - 1) % node_size - 1, -1, -node_size):
        end = min(start + node_size, devices)
        taken = min(remaining, (end - start) // group)
        layout = list(range(end - taken * group, end)) + layout
        remaining -= taken
    return tuple(layout) if remaining == 0 else None


def lent_gb(held: Engines, nodes: Sequence[Node]) -> float:
    """What a trainer device lent to generation (TAG) holds at its fullest: both engines and the largest fragment's
    working memory, the sum the simulator checks as a fragment starts there (`plan.state`). Lending needs it to fit:
    both engines alone may fit where a fragment beside them does not (QwenImage with CFG on 32 H100s: 77.8 GB of
    engines and 3.4 GB of activations)."""
    fragment_gb = max((n.memory_gb for n in nodes if n.kind == Kind.GENERATE), default=0.0)
    return lent_beside(held, fragment_gb)


def lent_beside(held: Engines, fragment_gb: float) -> float:
    """What a lent trainer device holds with a fragment of `fragment_gb` working memory (`lent_gb`)."""
    return held.resident_gb[Role.TRAINER] + held.resident_gb[Role.ROLLOUT] + fragment_gb


def plan_shapes(context: SearchContext, tcss: bool) -> dict[str, Shape]:
    """The fastest in the simulator of `finalists`, over the run's steps (at most `SEARCH_STEPS`); `tcss`: the
    policy overlaps steps (digen+tcss)."""
    if len(context.specs) != 1 or context.devices is None:
        return dict(context.shapes)  # the policy refuses several pipelines
    spec = flow_only("digen", context.specs[0])
    tag = context.options.tag
    shapes = finalists(
        spec,
        context.devices,
        context.trainer_devices,
        context.costs[spec.name],
        tcss=tcss,
        tag_fixed=tag is not None,
        staged=tag != Tag.FORCE,
    )
    return best_by_forecast(
        [{spec.name: shape} for shape in shapes], context.forecast, context.horizon, context.forecast_beating
    )


def finalists(
    spec: FlowSpec,
    devices: int,
    trainer_devices: int | None,
    cost: CostModel,
    *,
    tcss: bool,
    tag_fixed: bool = False,
    staged: bool = True,
) -> list[FlowShape]:
    """The shapes the search simulates, the cost model's best first: the `SIMULATED` best synchronous shapes and
    the best shared (colocated-like) one; for digen+tcss (`tcss`) those again with TCSS on (the synchronous ones also
    with it off, so it never loses to digen) and the `SIMULATED` best TCSS shapes. Each with TAG allowed and, where
    a trainer device can hold both engines and a fragment (`lent_gb`) and the run's options do not fix TAG, not
    allowed. Last, the best shared shape run stage-synchronously (its trainer takes the mini-batch once all of it is
    generated: fewer, larger train nodes, which the simulator finds as fast or slightly faster than GAP on DigenRL's
    scenarios) and the staged baselines' own shapes (`_staged`), so digen never loses to colocated or disaggregated;
    none of these when the run forces TAG (`staged` False), which only GAP's schedule has. Ranked on one device
    (`RANKING_DEVICE`), so devices that differ only in speed simulate the same shapes."""
    synchronous = _best(spec, devices, trainer_devices, cost, tcss=False)
    shapes = list(synchronous)
    if tcss:
        overlapped = _best(spec, devices, trainer_devices, cost, tcss=True)
        shapes = overlapped[:1] + shapes + [replace(s, tcss=True) for s in synchronous] + overlapped[1:]
    shapes = [replace(s, tcss=False) if s.trainer_devices == devices else s for s in shapes]  # nothing to overlap
    capacity = cost.device.memory_bytes / 1e9
    with_tag_off: list[FlowShape] = []
    for shape in dict.fromkeys(shapes):
        with_tag_off.append(shape)
        lendable = (
            shape.trainer_devices < devices
            and lent_gb(shape.engines(spec, cost), shape.build(spec, 1, cost)) <= capacity
        )
        if lendable and not tag_fixed:
            with_tag_off.append(replace(shape, tag=False))
    if not staged:
        return with_tag_off
    shared = [replace(s, staged=True, tag=False) for s in synchronous if s.trainer_devices == devices][:1]
    return with_tag_off + shared + _staged(spec, devices, trainer_devices, cost)


def _staged(spec: FlowSpec, devices: int, trainer_devices: int | None, cost: CostModel) -> list[FlowShape]:
    """The stage-synchronous schedules digen generalises, cut as their policies cut them: colocated (one FSDP
    group, or HSDP groups of a node past one node) and disaggregated; none where the scenario fixes a field they
    cannot honour. A digen run on one of them runs that schedule: whole-group fragments cap generation at one
    device per prompt, where verl's even split of the samples keeps every device busy (HunyuanVideo, 64 GPUs)."""
    if spec.tsp_chunk or spec.fragments:
        return []
    shapes = []
    if not trainer_devices:
        colocated = Colocated.shape(spec, devices, None, cost)
        node = cost.device.node_size
        shapes.append(colocated)
        if devices > node and not devices % node:
            shapes.append(replace(colocated, trainer_group=node))
    if devices >= 2:
        shapes.append(Disaggregated.shape(spec, devices, trainer_devices, cost))
    return [shape for shape in shapes if fits(spec, shape, cost)]


def _best(spec: FlowSpec, devices: int, trainer_devices: int | None, cost: CostModel, tcss: bool) -> list[DigenShape]:
    """The `SIMULATED` best shapes and the best shared one within the device's memory and within each smaller memory
    of a catalogue device of its platform (`memory_tiers`): a device with more memory than another (every device
    that dominates it) considers every shape that one considers, so the shapes that only its memory admits can add to
    the set but never push the other's winner out of it."""
    best: list[DigenShape] = []
    for capacity in memory_tiers(cost):
        ranked = [shape for _, shape in candidates(spec, devices, trainer_devices, cost, tcss=tcss, capacity=capacity)]
        best += ranked[:SIMULATED] + [shape for shape in ranked if shape.trainer_devices == devices][:1]
    return list(dict.fromkeys(best))


def memory_tiers(cost: CostModel) -> list[float]:
    """GB per device of the catalogue devices of `cost`'s platform with no more memory than its device, and its
    device's own: the memories whose best shapes its search considers, smallest first."""
    own = cost.device.memory_bytes / 1e9
    tiers = {d.memory_bytes / 1e9 for d in DEVICES.values() if d.platform == cost.device.platform}
    return sorted({tier for tier in tiers if tier <= own} | {own})


def candidates(
    spec: FlowSpec,
    devices: int,
    trainer_devices: int | None,
    cost: CostModel,
    tcss: bool = False,
    capacity: float | None = None,
) -> list[tuple[float, DigenShape]]:
    """(predicted step seconds, shape) for every trainer pool (around the balanced split, `pool_choices`),
    trainer group size, fragment count and TSP chunk that fits in `capacity` GB per device (None: the device's
    memory), best first (ties: the larger chunk), predicted on `RANKING_DEVICE` (`ranking_model`) with TCSS on
    (digen+tcss) or off (digen). The scenario's own choices are kept when given."""
    own = cost.device.memory_bytes / 1e9
    capacity = own if capacity is None else capacity
    rows = _predicted_shapes(spec, devices, trainer_devices, ranking_model(cost), own)
    ranked = sorted(
        (
            (row.seconds(tcss, lend=row.lending_gb <= capacity), -row.chunk, row.shape)
            for row in rows
            if row.need_gb <= capacity
        ),
        key=lambda r: (r[0], r[1]),
    )
    return [(seconds, replace(shape, tcss=tcss)) for seconds, _, shape in ranked]


@dataclass(frozen=True)
class _Predicted:
    """One shape's predictions: synchronous and TCSS seconds with TAG lending and without, the memory a trainer
    device needs, and what a device lent to generation holds (`lent_gb`: lending needs it to fit)."""

    shape: DigenShape
    chunk: int
    need_gb: float
    lending_gb: float
    lending: tuple[float, float]
    not_lending: tuple[float, float]

    def seconds(self, tcss: bool, lend: bool) -> float:
        return (self.lending if lend else self.not_lending)[tcss]


@lru_cache(maxsize=8)
def _predicted_shapes(
    spec: FlowSpec, devices: int, trainer_devices: int | None, cost: CostModel, capacity: float
) -> tuple[_Predicted, ...]:
    """The predictions of every shape `candidates` ranks that fits in `capacity` GB per device, from each shape's
    step totals (`graph.flow.step_totals`: one fragment priced per size, no graph built), memoized (`prepare` asks for
    the policy's shape, then its search for the best few). `cost` is the ranking model (`ranking_model`), `capacity`
    the run's device's memory."""
    pools = [trainer_devices] if trainer_devices else pool_choices(spec, devices, cost) + [devices]
    ranked = []
    for trainers in pools:
        rollout = devices - trainers
        for group in _group_choices(devices, trainers, cost.device.node_size):
            held = engines(spec, cost, group)
            for fragments in _fragment_choices(spec, rollout or trainers, trainers // group):
                for chunk in _chunk_choices(spec):
                    shape = DigenShape(
                        fragments, chunk, False, trainers, trainer_group=None if group == trainers else group
                    )
                    totals = step_totals(spec, shape, cost)
                    need = totals.train_gb + held.resident_gb[Role.TRAINER]
                    if need > capacity:
                        continue
                    lending_gb = lent_beside(held, totals.generate_gb)
                    lending, not_lending = (
                        (
                            _predict(totals, shape, rollout, held, lend=lend, tcss=False),
                            _predict(totals, shape, rollout, held, lend=lend, tcss=True),
                        )
                        for lend in (True, False)
                    )
                    ranked.append(_Predicted(shape, chunk, need, lending_gb, lending, not_lending))
    if not ranked:
        raise MemoryRefusal(
            f"{spec.name}: no digen shape fits in {capacity:.0f} GB per device: add devices (cluster.devices)"
            + (", set offload: true" if not spec.offload else "")
            + (" or lower tsp_chunk" if spec.tsp_chunk else "")
        )
    return tuple(ranked)


def _predict(totals: StepTotals, shape: FlowShape, rollout: int, held: Engines, lend: bool, tcss: bool) -> float:
    """Predicted seconds per step of `shape`: with TCSS the slower pool sets the pace (a rollout device loads
    the new weights once per step); synchronous, one step from the weight load to the publication, with
    the best number of TAG fragments where trainer devices may lend (`lend`: a lent device holds both engines and a
    fragment). No rollout pool: every device switches to generate, then to train (colocated-like)."""
    generate_s, score_s, train_s, tail_s, load_s = _step_costs(totals, shape.fragments, shape.group)
    fragments, groups = shape.fragments, shape.groups
    if not rollout:
        to_rollout = held.sleep_s[Role.TRAINER] + held.wake_s[Role.ROLLOUT]
        to_trainer = held.sleep_s[Role.ROLLOUT] + held.wake_s[Role.TRAINER]
        return predict_makespan(
            (to_rollout,) * shape.trainer_devices,
            fragments,
            (),
            0.0,
            generate_s,
            score_s + to_trainer,
            train_s,
            tail_s,
            groups=groups,
        )
    if tcss:
        # Steps overlap: the rollout pool streams fragments across steps (a fragment holds one device), the trainer
        # pool trains a step's fragments between two optimizer steps; the slower of the two sets the pace.
        rollout_s = max(fragments / rollout, 1.0) * (generate_s + score_s) + load_s
        return max(rollout_s, -(-fragments // groups) * train_s + tail_s)
    lendable = shape.trainer_devices if lend else 0
    return min(
        predict_makespan(
            (load_s,) * rollout,
            fragments,
            (),
            0.0,
            generate_s,
            score_s,
            train_s,
            tail_s,
            tag,
            held.wake_s[Role.ROLLOUT],
            held.sleep_s[Role.ROLLOUT],
            0.0,
            groups,
        )
        for tag in range(0, min(lendable, fragments) + 1)
    )


def pool_choices(spec: FlowSpec, devices: int, cost: CostModel) -> list[int]:
    """Trainer pool sizes within a quarter of the cluster of the split that balances the predicted
    device-seconds of rollout (generate + score) and training (one node-sized group, whole-step TSP)."""
    group = max(1, min(cost.device.node_size, devices // 2))
    fragments = spec.prompts - spec.prompts % spec.mini_batches
    nodes = build_flow(spec, 1, FlowShape(fragments, spec.tsp_chunk or spec.trained_timesteps, False, group), cost)
    rollout = sum(n.cost_s for n in nodes if n.kind in (Kind.GENERATE, Kind.SCORE))
    training = sum(n.cost_s for n in nodes if n.kind in (Kind.TRAIN, Kind.LOGPROB))
    seed = round(devices * training / (rollout + training))
    window = max(2, devices // 4)
    return list(range(max(1, seed - window), min(devices - 1, seed + window) + 1))


def _group_choices(devices: int, trainers: int, node_size: int) -> list[int]:
    """The whole pool as one FSDP group, or groups of a node, of half a node, or the largest that divide the pool
    and fit in a node (12 trainers on nodes of 8: two groups of 6), each placed inside one node
    (`trainer_layout`)."""
    largest = next(trainers // n for n in range(1, trainers + 1) if not trainers % n and trainers // n <= node_size)
    sizes = (node_size, node_size // 2, largest)
    choices = [trainers] + [g for g in sizes if 1 <= g < trainers and trainers % g == 0]
    return [
        g
        for g in dict.fromkeys(choices)
        if g == trainers or trainer_layout(devices, trainers, g, node_size) is not None
    ]


def _fragment_choices(spec: FlowSpec, rollout: int, groups: int = 1) -> list[int]:
    if spec.fragments:
        return [spec.fragments]
    choices = {min(spec.prompts, k * workers) for k in (1, 2, 4, 8) for workers in (rollout, groups)}
    return sorted({max(spec.mini_batches, m - m % spec.mini_batches) for m in choices})


def _chunk_choices(spec: FlowSpec) -> list[int]:
    if spec.tsp_chunk:
        return [spec.tsp_chunk]
    return sorted({min(c, spec.trained_timesteps) for c in (1, 2, 4, 8, spec.trained_timesteps)})
