"""`digen`: DigenRL's schedule for FlowGRPO / DanceGRPO on a rollout pool and a trainer pool.

* GAP — the batch is cut into M fragments of whole groups; each fragment is scored and trained as
  soon as it is generated, gradients accumulate, and one optimizer step commits the batch. Rollout and
  trainer hold the same weights version, so the rollout's log-probs are the old log-probs: no recompute.
* TSP — a train node covers a chunk of trained timesteps, batched into one forward/backward.
* TAG — while the trainer pool would wait for data, its devices generate fragments; a bounded,
  memoized search over the predicted makespan (switch costs included) decides how many, and only
  where it shortens the step. `PolicyOptions.tag` fixes it for a run: `Tag.OFF` turns it off (for ablations and
  `plan`), `Tag.FORCE` inserts it whenever a trainer idles while fragments wait (to test that TAG changes no number).
* TCSS (opt-in) — once every fragment of step s has started, the rollout pool starts step s + 1 on
  weights s (staleness 1, never more, one version per step so no group or trajectory mixes versions).
* Trainer groups — the trainer pool is one FSDP group or several (hybrid sharding), a group no larger than a node
  placed inside one (`trainer_layout`): every group trains whole train nodes, all of them commit together
  (gradients all-reduced across groups).
* Publication without a cluster barrier — the trainer pool publishes; a rollout device loads the new weights on
  its own timeline, between two fragments, before the first fragment that uses them.
* Shape — chosen by `sched.digen_search` among the cost model's best cuts (GAP fragments, TSP chunk, pool split,
  trainer groups, TAG and TCSS allowed or not), the colocated-like shared shape and the staged baselines' shapes, by
  simulating them; a staged baseline's shape that wins runs that baseline's schedule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from dovetail.cost.model import CostModel
from dovetail.graph.node import Kind, Node, Role
from dovetail.graph.spec import PipelineSpec
from dovetail.sched import digen_search
from dovetail.sched.colocated import Colocated, flow_only, flow_shape
from dovetail.sched.digen_search import DigenShape, lent_gb, predict_makespan, trainer_layout
from dovetail.sched.disaggregated import Disaggregated, split_pools
from dovetail.sched.policy import (
    Begin,
    Decision,
    Event,
    NodeStarted,
    Policy,
    Run,
    SearchContext,
    Setup,
    Shape,
    StartStep,
    SwitchRole,
    Tag,
    VersionPublished,
    idle_devices,
    open_steps_on_publish,
    ready_of,
    reward_roles,
    score_on_reward_pool,
)

TAG_MIN_GAIN = 0.01
"""TAG must shorten the predicted step by at least this fraction; otherwise switching is not worth it."""


class Digen(Policy):
    name = "digen"
    pipeline_kinds = frozenset({"flow"})
    tcss = False
    """Steps overlap (digen+tcss) on a shape whose search allowed it (`DigenShape.tcss`)."""
    supports_reward_pool = True
    assists_generation = True
    searches = True

    @classmethod
    def shape(cls, spec: PipelineSpec, devices: int, trainer_devices: int | None, cost: CostModel) -> DigenShape:
        """The cost model's best cut (`plan_shapes` then lets the simulator choose among the best few)."""
        spec = flow_only(cls.name, spec)
        return digen_search.candidates(spec, devices, trainer_devices, cost, tcss=cls.tcss)[0][1]

    @classmethod
    def plan_shapes(cls, context: SearchContext) -> dict[str, Shape]:
        """The fastest of the search's finalists in the simulator (`digen_search.plan_shapes`)."""
        return digen_search.plan_shapes(context, tcss=cls.tcss)

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        if len(setup.engines) != 1:
            raise ValueError(f"policy digen runs one pipeline, got {sorted(setup.engines)}")
        (self.pipeline,) = setup.engines
        shape = DigenShape.of(flow_shape(self.name, setup.shapes[self.pipeline]))
        staged = Colocated if setup.trainer_devices == setup.compute_devices else Disaggregated
        self.staged = staged(setup) if shape.staged else None
        """The stage-synchronous schedule digen runs when its search chose a staged shape (`digen_search._staged`)."""
        self.tcss = type(self).tcss and shape.tcss
        """Steps overlap: digen+tcss on a shape its search cut with TCSS (or one given without that choice)."""
        self.tag = setup.options.tag or (Tag.AUTO if shape.tag else Tag.OFF)
        """TAG as the run's options fix it, else as the shape's search chose."""
        self.shared = setup.trainer_devices == setup.compute_devices
        """Colocated-like shape: every device generates, then trains (one engine resident at a time, switch costs
        paid), with GAP, TSP, trainer groups and no recompute."""
        devices = setup.compute_devices
        self.rollout_pool: tuple[int, ...]
        self.trainer_pool: tuple[int, ...]
        if self.shared:
            self.rollout_pool, self.trainer_pool = (), tuple(range(devices))
        else:
            self.rollout_pool, self.trainer_pool = split_pools(devices, setup.trainer_devices)
        group = shape.group
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
        self.lent: dict[int, None] = {}
        """Trainer devices TAG lent to generation and not yet switched back, in the pool's order: the only trainer
        devices that can hold the rollout role, so `_tag_devices` looks at these instead of the whole pool at every
        decision."""
        self.started_at: dict[str, float] = {}
        self.loaded = dict.fromkeys(range(setup.devices), 0)
        """Weights version in each device's rollout engine: a device loads a newer one between fragments."""

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
        """Every device of `devices` idle and holding the trainer role: one pass, stopping at the first that is not
        (asked for each group and the whole pool at nearly every decision)."""
        states, trainer = view.devices, Role.TRAINER
        for device in devices:
            state = states[device]
            if not state.idle or state.role != trainer:
                return False
        return True

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
        if decisions or self.shared or self.tag == Tag.OFF or not self._trainers_ready(view, self.trainer_pool):
            return decisions  # (TAG off: `_consider_tag` lends nothing, so the whole pool is not looked at)
        return self._consider_tag(view, taken)

    def _consider_tag(self, view, taken: set[int]) -> list[Decision]:
        """The trainer group is idle with nothing to train: let k of its devices generate fragments if
        the predicted makespan of the step drops by more than TAG_MIN_GAIN."""
        if self.tag == Tag.OFF:
            return []
        unclaimed = [n for n in ready_of(view, Kind.GENERATE, self.pipeline) if n.id not in self.tag_reserved.values()]
        rollout_idle = idle_devices(view, self.rollout_pool, Role.ROLLOUT)
        waiting = unclaimed[len(rollout_idle) :]
        if not waiting or lent_gb(self.setup.engines[self.pipeline], waiting) > self.setup.memory_gb:
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
        if self.tag == Tag.FORCE:
            best_k = max(best_k, 1)  # for tests of exactness under TAG: insert it even where it does not pay
        elif best_k == 0 or baseline - best < TAG_MIN_GAIN * (baseline - view.now):
            return []
        chosen = self.trainer_pool[:best_k]
        for device, node in zip(chosen, reversed(waiting)):
            self.tag_reserved[device] = node.id
        self.tag_decisions.append((view.now, best_k))
        self.lent.update(dict.fromkeys(chosen))  # none lent now: the whole pool was idle, every device a trainer
        taken.update(self.trainer_pool)
        return [SwitchRole(d, Role.ROLLOUT, tag_in, self.tag_resident_gb) for d in chosen]

    def _typical(self, nodes: Sequence[Node]) -> tuple[Node, Node, Node, Node]:
        """One generate, score and train node of a step (the cost of one fragment) and its commit."""
        first: dict[Kind, Node] = {}
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
        for device in list(self.lent):
            state = view.devices[device]
            if device in taken or not state.idle or state.role != Role.ROLLOUT:
                continue
            node_id = self.tag_reserved.get(device)
            if node_id is not None and node_id in view.ready:
                decisions.append(self._generate(view, view.graph[node_id], device, self.tag_resident_gb))
            else:
                self.tag_reserved.pop(device, None)
                del self.lent[device]
                held = self.setup.engines[self.pipeline]
                decisions.append(
                    SwitchRole(device, Role.TRAINER, held.sleep_s[Role.ROLLOUT], held.resident_gb[Role.TRAINER])
                )
            taken.add(device)
        return decisions

    def _rollout(self, view, taken: set[int]) -> list[Decision]:
        """Scores first (they unblock the trainer) unless a reward pool takes them, then fragments, "
        "oldest step first."""
        reserved = set(self.tag_reserved.values())
        scores = [] if self.setup.reward_devices else ready_of(view, Kind.SCORE, self.pipeline)
        work = scores + sorted(
            (n for n in ready_of(view, Kind.GENERATE, self.pipeline) if n.id not in reserved), key=lambda n: n.step
        )
        if not work:  # nothing to place: the rollout pool is not looked at
            return []
        devices = [d for d in idle_devices(view, self.rollout_pool, Role.ROLLOUT) if d not in taken]
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

    @classmethod
    def simulates_as(cls, shapes: Mapping[str, Shape]) -> str:
        """digen's schedule on a shape its search cut without TCSS, or on a staged baseline's (`__init__`: steps
        overlap only where both the policy and the shape allow it; a staged shape runs the staged policy)."""
        if len(shapes) != 1:
            return cls.name
        shape = DigenShape.of(flow_shape(cls.name, next(iter(shapes.values()))))
        return Digen.name if shape.staged or not shape.tcss else cls.name
