"""`digen`: DigenRL's schedule for FlowGRPO / DanceGRPO on a rollout pool and a trainer pool.

* GAP — the batch is cut into M fragments of whole groups; each fragment is scored and trained as
  soon as it is generated, gradients accumulate, and one optimizer step commits the batch. Rollout and
  trainer hold the same weights version, so the rollout's log-probs are the old log-probs: no recompute.
* TSP — a train node covers a chunk of trained timesteps, batched into one forward/backward.
* TAG — while the trainer pool would wait for data, its devices generate fragments; a bounded,
  memoized search over the predicted makespan (switch costs included) decides how many, and only
  where it shortens the step. `Setup.options["tag"] = False` turns it off (for ablations and `plan`),
  "force" inserts it whenever a trainer idles while fragments wait (to test that TAG changes no number).
* TCSS (opt-in) — once every fragment of step s has started, the rollout pool starts step s + 1 on
  weights s (staleness 1, never more, one version per step so no group or trajectory mixes versions).
* Trainer groups — the trainer pool is one FSDP group or several (hybrid sharding), a group no larger than a node
  placed inside one (`trainer_layout`): every group trains whole train nodes, all of them commit together
  (gradients all-reduced across groups).
* Publication without a cluster barrier — the trainer pool publishes; a rollout device loads the new weights on
  its own timeline, between two fragments, before the first fragment that uses them.
* Shape — `candidates` ranks pool splits (a window around the split balancing predicted rollout and training
  device-seconds), group sizes, fragment counts and TSP chunks by the cost model; it includes the colocated-like
  shared shape (every device generates, then trains with TSP in groups, no recompute). `plan_shapes` then
  simulates the best few, the best shared one, each with TAG allowed and not (and, for digen+tcss, with TCSS off
  too: digen's own candidates), the best shared one stage-synchronous, and the staged baselines' shapes, and keeps the
  fastest: the chosen shape is never slower in the simulator than one it considered, digen+tcss never slower than
  digen.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from dovetail.graph.flow import FlowShape, build_flow, engines
from dovetail.graph.node import Kind, Node, Role
from dovetail.graph.spec import FlowSpec, PipelineSpec
from dovetail.sched.colocated import Colocated, fits, flow_only
from dovetail.sched.disaggregated import Disaggregated, split_pools
from dovetail.sched.policy import (
    Begin,
    Decision,
    Event,
    NodeStarted,
    Policy,
    Run,
    Setup,
    StartStep,
    SwitchRole,
    VersionPublished,
    all_idle,
    best_by_forecast,
    idle_devices,
    open_steps_on_publish,
    ready_of,
    reward_roles,
    score_on_reward_pool,
    search_horizon,
)

TAG_MIN_GAIN = 0.01
"""TAG must shorten the predicted step by at least this fraction; otherwise switching is not worth it."""
SIMULATED = 4
"""Shapes of each kind (synchronous, TCSS) the search simulates: the cost model's best few, and the best shared one
(the cost model ranks within a few percent of the simulator; the simulator settles the order)."""


@dataclass(frozen=True)
class DigenShape(FlowShape):
    """A digen cut with the run-time choices the search makes per shape: whether TAG may lend trainer devices, and
    whether steps overlap (TCSS; only digen+tcss overlaps, and it may choose not to)."""

    tag: bool = True
    tcss: bool = False


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
    for _ in range(pending - tag):
        done = heapq.heappop(free) + generate_s
        landed.append(done + score_s)
        heapq.heappush(free, done)
    trainers = [trainer] * groups
    for arrival in sorted(landed):
        heapq.heappush(trainers, max(heapq.heappop(trainers), arrival) + train_s)
    return max(trainers) + tail_s


def _step_costs(nodes: Sequence[Node], fragments: int, group: int) -> tuple[float, float, float, float, float]:
    """Per-fragment generate, score and (one trainer group's wall) train seconds — reference forwards
    included —, the trainer's tail of the step (optimizer step, publication) and one rollout device's
    weight load (the publication's bytes through its own host link)."""
    total = {kind: sum(n.cost_s for n in nodes if n.kind == kind) for kind in Kind}
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


class Digen(Policy):
    name = "digen"
    pipeline_kinds = frozenset({"flow"})
    tcss = False
    supports_reward_pool = True
    searches = True

    @classmethod
    def shape(cls, spec: PipelineSpec, devices: int, trainer_devices: int | None, cost) -> DigenShape:
        """The cost model's best of `candidates` (`plan_shapes` then lets the simulator choose among the best few)."""
        return cls.candidates(spec, devices, trainer_devices, cost)[0][1]

    @classmethod
    def plan_shapes(
        cls,
        specs: Sequence[PipelineSpec],
        shapes: dict[str, FlowShape],
        costs,
        forecast,
        *,
        steps: int = 1,
        devices: int | None = None,
        trainer_devices: int | None = None,
        options: Mapping[str, object] | None = None,
    ) -> dict[str, FlowShape]:
        """The fastest in the simulator of `finalists`, over the run's steps (at most `SEARCH_STEPS`)."""
        if len(specs) != 1 or devices is None:
            return shapes  # __init__ refuses several pipelines
        (spec,) = specs
        tag = (options or {}).get("tag")
        finalists = cls.finalists(
            spec, devices, trainer_devices, costs[spec.name], tag_fixed=tag is not None, staged=tag != "force"
        )
        return best_by_forecast([{spec.name: shape} for shape in finalists], forecast, search_horizon(steps))

    @classmethod
    def finalists(
        cls,
        spec: FlowSpec,
        devices: int,
        trainer_devices: int | None,
        cost,
        tag_fixed: bool = False,
        staged: bool = True,
    ) -> list[FlowShape]:
        """The shapes the search simulates, the cost model's best first: the `SIMULATED` best synchronous shapes and
        the best shared (colocated-like) one; for digen+tcss those again with TCSS on (the synchronous ones also
        with it off, so it never loses to digen) and the `SIMULATED` best TCSS shapes. Each with TAG allowed and,
        where a trainer device can hold both engines and the run's options do not fix TAG, not allowed. Last, the
        best shared shape run stage-synchronously (its trainer takes the mini-batch once all of it is generated: fewer,
        larger train nodes, which the simulator finds as fast or slightly faster than GAP on DigenRL's scenarios) and
        the staged baselines' own shapes (`_staged`), so digen never loses to colocated or disaggregated; none of these
        when the run forces TAG (`staged` False), which only GAP's schedule has."""
        synchronous = cls._best(spec, devices, trainer_devices, cost, tcss=False)
        shapes = list(synchronous)
        if cls.tcss:
            overlapped = cls._best(spec, devices, trainer_devices, cost, tcss=True)
            shapes = overlapped[:1] + shapes + [replace(s, tcss=True) for s in synchronous] + overlapped[1:]
        shapes = [replace(s, tcss=False) if s.trainer_devices == devices else s for s in shapes]  # nothing to overlap
        capacity = cost.device.memory_bytes / 1e9
        with_tag_off = []
        for shape in dict.fromkeys(shapes):
            with_tag_off.append(shape)
            held = shape.engines(spec, cost).resident_gb
            lendable = held[Role.TRAINER] + held[Role.ROLLOUT] <= capacity and shape.trainer_devices < devices
            if lendable and not tag_fixed:
                with_tag_off.append(replace(shape, tag=False))
        if not staged:
            return with_tag_off
        shared = [replace(s, staged=True, tag=False) for s in synchronous if s.trainer_devices == devices][:1]
        return with_tag_off + shared + cls._staged(spec, devices, trainer_devices, cost)

    @staticmethod
    def _staged(spec: FlowSpec, devices: int, trainer_devices: int | None, cost) -> list[FlowShape]:
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

    @classmethod
    def _best(cls, spec: FlowSpec, devices: int, trainer_devices: int | None, cost, tcss: bool) -> list[DigenShape]:
        ranked = [shape for _, shape in cls.candidates(spec, devices, trainer_devices, cost, tcss=tcss)]
        shared = [shape for shape in ranked if shape.trainer_devices == devices][:1]
        return list(dict.fromkeys(ranked[:SIMULATED] + shared))

    @classmethod
    def candidates(
        cls, spec: PipelineSpec, devices: int, trainer_devices: int | None, cost, tcss: bool | None = None
    ) -> list[tuple[float, DigenShape]]:
        """(predicted step seconds, shape) for every trainer pool (around the balanced split, `_pool_choices`),
        trainer group size, fragment count and TSP chunk that fits in memory, best first (ties: the larger
        chunk), predicted with TCSS on or off (default: the policy's). The scenario's own choices are kept when
        given."""
        tcss = cls.tcss if tcss is None else tcss
        ranked = cls._predicted_shapes(flow_only(cls.name, spec), devices, trainer_devices, cost)
        ranked = sorted(ranked, key=lambda r: (r[1] if tcss else r[0], r[2]))
        return [(r[1] if tcss else r[0], replace(r[3], tcss=tcss)) for r in ranked]

    @staticmethod
    @lru_cache(maxsize=8)
    def _predicted_shapes(
        spec: FlowSpec, devices: int, trainer_devices: int | None, cost
    ) -> tuple[tuple[float, float, int, DigenShape], ...]:
        """(synchronous seconds, TCSS seconds, -chunk, shape) of every shape `candidates` ranks: one graph per shape
        for both predictions, memoized (`prepare` asks for the policy's shape, then its search for the best few; on 64
        devices this enumeration, not the simulation, is most of a search's time)."""
        capacity = cost.device.memory_bytes / 1e9
        pools = [trainer_devices] if trainer_devices else Digen._pool_choices(spec, devices, cost) + [devices]
        ranked = []
        for trainers in pools:
            rollout = devices - trainers
            for group in Digen._group_choices(devices, trainers, cost.device.node_size):
                held = engines(spec, cost, group)
                for fragments in Digen._fragment_choices(spec, rollout or trainers, trainers // group):
                    for chunk in Digen._chunk_choices(spec):
                        shape = DigenShape(
                            fragments, chunk, False, trainers, trainer_group=None if group == trainers else group
                        )
                        nodes = build_flow(spec, 1, shape, cost)
                        if (
                            max(n.memory_gb for n in nodes if n.kind == Kind.TRAIN) + held.resident_gb[Role.TRAINER]
                            > capacity
                        ):
                            continue
                        synchronous, overlapped = (
                            Digen._predict(nodes, shape, rollout, held, capacity, tcss) for tcss in (False, True)
                        )
                        ranked.append((synchronous, overlapped, -chunk, shape))
        if not ranked:
            raise ValueError(
                f"{spec.name}: no digen shape fits in {capacity:.0f} GB per device: add devices (cluster.devices)"
                + (", set offload: true" if not spec.offload else "")
                + (" or lower tsp_chunk" if spec.tsp_chunk else "")
            )
        return tuple(ranked)

    @staticmethod
    def _predict(nodes: Sequence[Node], shape: FlowShape, rollout: int, held, capacity: float, tcss: bool) -> float:
        """Predicted seconds per step of `shape`: with TCSS the slower pool sets the pace (a rollout device loads
        the new weights once per step); synchronous, one step from the weight load to the publication, with
        the best number of TAG fragments (none when both engines do not fit on a trainer device). No rollout pool:
        every device switches to generate, then to train (colocated-like)."""
        generate_s, score_s, train_s, tail_s, load_s = _step_costs(nodes, shape.fragments, shape.group)
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
        lendable = (
            shape.trainer_devices if held.resident_gb[Role.TRAINER] + held.resident_gb[Role.ROLLOUT] <= capacity else 0
        )
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

    @classmethod
    def _pool_choices(cls, spec: FlowSpec, devices: int, cost) -> list[int]:
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

    @staticmethod
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

    @staticmethod
    def _fragment_choices(spec: FlowSpec, rollout: int, groups: int = 1) -> list[int]:
        if spec.fragments:
            return [spec.fragments]
        choices = {min(spec.prompts, k * workers) for k in (1, 2, 4, 8) for workers in (rollout, groups)}
        return sorted({max(spec.mini_batches, m - m % spec.mini_batches) for m in choices})

    @staticmethod
    def _chunk_choices(spec: FlowSpec) -> list[int]:
        if spec.tsp_chunk:
            return [spec.tsp_chunk]
        return sorted({min(c, spec.trained_timesteps) for c in (1, 2, 4, 8, spec.trained_timesteps)})

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        if len(setup.engines) != 1:
            raise ValueError(f"policy digen runs one pipeline, got {sorted(setup.engines)}")
        (self.pipeline,) = setup.engines
        shape = setup.shapes.get(self.pipeline)
        staged = Colocated if setup.trainer_devices == setup.compute_devices else Disaggregated
        self.staged = staged(setup) if getattr(shape, "staged", False) else None
        """The stage-synchronous schedule digen runs when its search chose a staged baseline's shape (`_staged`)."""
        self.tcss = type(self).tcss and getattr(shape, "tcss", True)
        """Steps overlap: digen+tcss on a shape its search cut with TCSS (or one given without that choice)."""
        self.tag = setup.options.get("tag", getattr(shape, "tag", True))
        """TAG allowed (the run's options, else the shape's choice); "force" inserts it wherever it can."""
        self.shared = setup.trainer_devices == setup.compute_devices
        """Colocated-like shape: every device generates, then trains (one engine resident at a time, switch costs
        paid), with GAP, TSP, trainer groups and no recompute."""
        devices = setup.compute_devices
        if self.shared:
            self.rollout_pool, self.trainer_pool = (), tuple(range(devices))
        else:
            self.rollout_pool, self.trainer_pool = split_pools(devices, setup.trainer_devices)
        group = getattr(shape, "group", len(self.trainer_pool))
        if not self.shared:
            packed = trainer_layout(devices, len(self.trainer_pool), group, setup.node_size or devices)
            if packed is not None:  # else a group the caller fixed that no node holds: the last devices, as given
                self.trainer_pool = packed
                self.rollout_pool = tuple(d for d in range(devices) if d not in packed)
        self.groups = [self.trainer_pool[i : i + group] for i in range(0, len(self.trainer_pool), group)]
        """FSDP trainer groups; each trains whole train nodes, all of them commit together."""
        held = setup.engines[self.pipeline].resident_gb
        self.rollout_resident_gb = held[Role.ROLLOUT]
        self.tag_resident_gb = held[Role.TRAINER] + held[Role.ROLLOUT]
        self.tag_reserved: dict[int, str] = {}
        self.started_at: dict[str, float] = {}
        self.loaded = dict.fromkeys(range(setup.devices), 0)
        """Weights version in each device's rollout engine: a device loads a newer one between fragments."""
        """(time, fragments) of every TAG insertion, for the run's log."""

    # ------------------------------------------------------------ decisions
    def decide(self, view, events: Sequence[Event]) -> list[Decision]:
        if self.staged is not None:
            return self.staged.react(view, events)
        decisions: list[Decision] = []
        for event in events:
            if isinstance(event, Begin):
                decisions += [self.setup.switch(d, self.pipeline, None, Role.ROLLOUT) for d in self.rollout_pool]
                first = Role.ROLLOUT if self.shared else Role.TRAINER
                decisions += [self.setup.switch(d, self.pipeline, None, first) for d in self.trainer_pool]
                decisions += reward_roles(self.setup, self.pipeline)
            elif isinstance(event, VersionPublished) and event.version:
                self.loaded.update(dict.fromkeys(self.trainer_pool, event.version))
        decisions += open_steps_on_publish(view, events)
        if any(isinstance(d, SwitchRole) for d in decisions):
            return decisions
        if self.tcss and not self.shared:
            decisions += self._early_start(view, decisions)
        taken: set[int] = set()

        # No cluster barrier: the trainer pool publishes, rollout devices load the new weights between fragments.
        publish = ready_of(view, Kind.PUBLISH)
        if publish and self._trainers_ready(view, self.trainer_pool):
            decisions.append(Run(publish[0].id, self.trainer_pool))
            taken.update(self.trainer_pool)
        elif not publish:
            decisions += self._trainer_groups(view, taken)
        decisions += score_on_reward_pool(view, self.setup, self.pipeline)
        if self.shared:
            return decisions + self._take_turns(view, taken)
        decisions += self._tag_devices(view, taken)
        decisions += self._rollout(view, taken)
        return decisions

    def _take_turns(self, view, taken: set[int]) -> list[Decision]:
        """Shared devices: scores first, then fragments on rollout engines; a rollout device with nothing left to
        generate switches to its trainer engine, a trainer device switches back once a new step's fragments wait
        and no trainer work is ready."""
        scores = [] if self.setup.reward_devices else ready_of(view, Kind.SCORE, self.pipeline)
        fragments = sorted(ready_of(view, Kind.GENERATE, self.pipeline), key=lambda n: n.step)
        trainer_work = any(
            ready_of(view, kind, self.pipeline) for kind in (Kind.TRAIN, Kind.LOGPROB, Kind.COMMIT, Kind.PUBLISH)
        )
        decisions: list[Decision] = []
        for device in self.trainer_pool:
            state = view.devices[device]
            if device in taken or not state.idle:
                continue
            if scores:
                decisions.append(Run(scores.pop(0).id, (device,)))
            elif state.role == Role.ROLLOUT and fragments:
                decisions.append(self._generate(view, fragments[0], device, self.rollout_resident_gb))
                if isinstance(decisions[-1], Run):
                    fragments.pop(0)
            elif state.role == Role.ROLLOUT:
                decisions.append(self.setup.switch(device, self.pipeline, Role.ROLLOUT, Role.TRAINER))
            elif fragments and not trainer_work:
                decisions.append(self.setup.switch(device, self.pipeline, Role.TRAINER, Role.ROLLOUT))
        return decisions

    def _early_start(self, view, decided: list[Decision]) -> list[Decision]:
        """TCSS: when every fragment of the newest step has started, open the next on the latest weights."""
        opening = {(d.pipeline, d.step) for d in decided if isinstance(d, StartStep)}
        started = [s for (p, s) in view.started if p == self.pipeline] + [s for (_, s) in opening]
        if not started:
            return []
        newest = max(started)
        following = newest + 1
        if following not in view.graph.steps(self.pipeline) or (self.pipeline, newest) in opening:
            return []
        if any(node.id in view.ready for node in view.graph.of(self.pipeline, newest, Kind.GENERATE)):
            return []
        version = view.published[self.pipeline]
        if following - version > 1:
            return []
        return [StartStep(self.pipeline, following, version)]

    @staticmethod
    def _trainers_ready(view, devices: Sequence[int]) -> bool:
        return all_idle(view, devices) and all(view.devices[d].role == Role.TRAINER for d in devices)

    def _trainer_groups(self, view, taken: set[int]) -> list[Decision]:
        """The optimizer step on the whole pool once every group is free (nothing new starts while it waits);
        otherwise each idle group takes the oldest ready train node, then reference forwards; TAG when the
        whole pool is idle with nothing to train."""
        commits = ready_of(view, Kind.COMMIT, self.pipeline)
        if commits:
            if not self._trainers_ready(view, self.trainer_pool):
                return []
            taken.update(self.trainer_pool)
            return [Run(commits[0].id, self.trainer_pool)]
        work = [
            node
            for kind in (Kind.TRAIN, Kind.LOGPROB)
            for node in sorted(ready_of(view, kind, self.pipeline), key=lambda n: n.step)
        ]
        decisions: list[Decision] = []
        for group in self.groups:
            if work and self._trainers_ready(view, group):
                decisions.append(Run(work.pop(0).id, group))
                taken.update(group)
        if decisions or self.shared or not self._trainers_ready(view, self.trainer_pool):
            return decisions
        return self._consider_tag(view, taken)

    def _consider_tag(self, view, taken: set[int]) -> list[Decision]:
        """The trainer group is idle with nothing to train: let k of its devices generate fragments if
        the predicted makespan of the step drops by more than TAG_MIN_GAIN."""
        if not self.tag or self.tag_resident_gb > self.setup.memory_gb:
            return []
        unclaimed = [n for n in ready_of(view, Kind.GENERATE, self.pipeline) if n.id not in self.tag_reserved.values()]
        rollout_idle = idle_devices(view, self.rollout_pool, Role.ROLLOUT)
        waiting = unclaimed[len(rollout_idle) :]
        if not waiting:
            return []
        nodes = view.graph.of(self.pipeline, waiting[0].step)
        generate_s, score_s, train_s, tail_s = (self.costs.seconds(n) for n in self._typical(nodes))
        group = len(self.groups[0])
        train_s /= group
        arrivals, rollout_free = [], []
        for d in self.rollout_pool:
            remaining = 0.0
            for node_id in view.devices[d].running:
                remaining = max(remaining, self._remaining(view, node_id))
                arrivals.append(view.now + remaining + score_s)
            rollout_free.append(view.now + remaining)
        engines_ = self.setup.engines[self.pipeline]
        tag_in = engines_.wake_s[Role.ROLLOUT]
        tag_out = engines_.sleep_s[Role.ROLLOUT]
        backlog = sum(self.costs.seconds(n, group) for n in ready_of(view, Kind.TRAIN, self.pipeline)) / len(
            self.groups
        )
        pending = len(unclaimed)
        args = (
            tuple(round(t, 2) for t in rollout_free),
            pending,
            tuple(round(t, 2) for t in arrivals),
            round(view.now + backlog, 2),
            round(generate_s, 2),
            round(score_s, 2),
            round(train_s, 2),
            round(tail_s, 2),
        )
        baseline = predict_makespan(*args, groups=len(self.groups))
        best_k, best = 0, baseline
        for k in range(1, min(len(self.trainer_pool), len(waiting)) + 1):
            predicted = predict_makespan(
                *args, k, round(tag_in, 2), round(tag_out, 2), round(view.now, 2), len(self.groups)
            )
            if predicted < best:
                best_k, best = k, predicted
        if self.tag == "force":
            best_k = max(best_k, 1)  # for tests of exactness under TAG: insert it even where it does not pay
        elif best_k == 0 or baseline - best < TAG_MIN_GAIN * (baseline - view.now):
            return []
        chosen = self.trainer_pool[:best_k]
        for device, node in zip(chosen, reversed(waiting)):
            self.tag_reserved[device] = node.id
        self.tag_decisions.append((view.now, best_k))
        taken.update(self.trainer_pool)
        return [SwitchRole(d, Role.ROLLOUT, tag_in, self.tag_resident_gb) for d in chosen]

    def _typical(self, nodes: Sequence[Node]) -> tuple[Node, Node, Node, Node]:
        """One generate, score and train node of a step (the cost of one fragment) and its commit."""
        first = {}
        for node in nodes:
            first.setdefault(node.kind, node)
        train_per_fragment = sum(
            n.cost_s for n in nodes if n.kind in (Kind.TRAIN, Kind.LOGPROB) and n.samples == first[Kind.TRAIN].samples
        )
        train = replace(first[Kind.TRAIN], cost_s=train_per_fragment)
        tail = replace(first[Kind.COMMIT], cost_s=first[Kind.COMMIT].cost_s + first[Kind.PUBLISH].cost_s)
        return first[Kind.GENERATE], first[Kind.SCORE], train, tail

    def _remaining(self, view, node_id: str) -> float:
        node = view.graph[node_id]
        return max(0.0, self.costs.seconds(node) - (view.now - self.started_at.get(node_id, view.now)))

    def _tag_devices(self, view, taken: set[int]) -> list[Decision]:
        """Trainer devices lent to generation: run the reserved fragment, then switch back."""
        decisions: list[Decision] = []
        for device in self.trainer_pool:
            state = view.devices[device]
            if device in taken or not state.idle or state.role != Role.ROLLOUT:
                continue
            node_id = self.tag_reserved.get(device)
            if node_id is not None and node_id in view.ready:
                decisions.append(self._generate(view, view.graph[node_id], device, self.tag_resident_gb))
            else:
                self.tag_reserved.pop(device, None)
                held = self.setup.engines[self.pipeline]
                decisions.append(
                    SwitchRole(device, Role.TRAINER, held.sleep_s[Role.ROLLOUT], held.resident_gb[Role.TRAINER])
                )
            taken.add(device)
        return decisions

    def _rollout(self, view, taken: set[int]) -> list[Decision]:
        """Scores first (they unblock the trainer) unless a reward pool takes them, then fragments, "
        "oldest step first."""
        devices = [d for d in idle_devices(view, self.rollout_pool, Role.ROLLOUT) if d not in taken]
        reserved = set(self.tag_reserved.values())
        scores = [] if self.setup.reward_devices else ready_of(view, Kind.SCORE, self.pipeline)
        work = scores + sorted(
            (n for n in ready_of(view, Kind.GENERATE, self.pipeline) if n.id not in reserved), key=lambda n: n.step
        )
        decisions: list[Decision] = []
        for device in devices:
            if not work:
                break
            decision = self._generate(view, work[0], device, self.rollout_resident_gb)
            if isinstance(decision, Run):
                work.pop(0)
            decisions.append(decision)
        return decisions

    def _generate(self, view, node: Node, device: int, resident_gb: float) -> Decision:
        """Run `node` on `device`, or first load the weights its step generates with (a fragment never
        mixes versions): the published bytes through the device's host link, on its own timeline."""
        version = view.started[(node.pipeline, node.step)]
        if node.kind != Kind.GENERATE or self.loaded[device] == version:
            return Run(node.id, (device,))
        self.loaded[device] = version
        # Any version is the same bytes (a device lent by the trainer may need the older weights of a TCSS step).
        publication = view.graph.of(node.pipeline, max(version - 1, 0), Kind.PUBLISH)[0]
        return SwitchRole(device, Role.ROLLOUT, self.costs.seconds(publication), resident_gb)

    def observe(self, view, events: Sequence[Event]) -> None:
        super().observe(view, events)
        for event in events:
            if isinstance(event, NodeStarted):
                self.started_at[event.node] = event.time


class DigenTCSS(Digen):
    """digen with one-step bounded asynchrony (TCSS) on."""

    name = "digen+tcss"
    tcss = True
