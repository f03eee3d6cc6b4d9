"""`jigsaw`: JigsawRL's pipeline multiplexing (LM GRPO, flow GRPO beside it), and `jigsaw-greedy`, its ablation.

Several RL pipelines share one pool. Every device holds every pipeline's rollout engine (with a reduced
KV-cache budget) and FSDP trainer shard (role ANY), so nothing is ever put to sleep. Each step is the
sub-stage graph of `graph.lm` with shareable nodes: a pipeline's rollout runs on all devices as one
engine per `tensor_parallel` devices, its trainer work on the whole pool. Complementary sub-stages of
different pipelines — bandwidth-bound decode beside compute-bound log-prob / training — share devices
(share `SHARE` each) and slow each other down by the pool's interference table (`Setup.slowdown`: the calibrated
default, or the table a multiplexed run measures on its own devices, `runtime.interference`). Long-tail responses
migrate at `migrate_at` tokens (re-prefill counted) onto one engine of `tail_parallel` devices, freeing the
others for the other pipeline's decode and trainer work; micro-batches are whole prompt groups in finishing
order, so finished length bands get their log-probs and gradients while the tail decodes (one optimizer
step per batch: steps stay on-policy, staleness 0). A step that draws more prompts (dynamic sampling, `draws`) rolls
each draw out (its tail migrating as any rollout's) after the score of the one before, and trains the groups it keeps
once every draw is scored. A flow (text-to-image) pipeline multiplexes the same way:
its generate fragments (whole prompt groups, one per device) are rollout work on the roomiest devices, its
log-prob, train, commit and publish nodes trainer work on the whole pool.

`jigsaw` chooses where the tail migrates and how wide its engine is by rolling the simulator forward one step per
candidate (`plan_shapes`, memoized coordinate descent); each rollout engine's memory is what the trainers leave,
split evenly (`rollout_shares`). It also considers the pipelines on disjoint sub-pools sized by their work
(`arrangements`: each pipeline alone, the arrangement verl-sync gives, and a few pipelines per sub-pool), each
sub-pool multiplexed as above, and the pipelines back to back on the whole pool (`back_to_back`: one pipeline per
turn, each turn starting once the one before has run all its steps), and keeps whichever the simulator finds
fastest: past two or three pipelines the whole pool's trainer work queues behind itself, and a sub-pool per pipeline
or pair wins; where the pipelines leave each other little to fill, back to back does (a run's `arrangement` may keep
it to one of the three). At run time, when several pipelines' trainer work wants the (compute-bound) pool, it rolls a
memoized stage-level model of the pool forward over each pipeline's current and next step for every candidate set and
takes the earliest mean completion, weighted by each pipeline's `priority`. `jigsaw-greedy`, the ablation, keeps the
cost-model default shape (tail at `tail_edge`, engine as wide as the home ones) and starts everything that fits now,
higher priorities first when not everything fits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from itertools import combinations
from operator import attrgetter

from dovetail.cost.calibration import DEFAULT
from dovetail.cost.model import CostModel
from dovetail.graph.flow import BF16, FlowShape
from dovetail.graph.lm import GB, LMShape, response_lengths
from dovetail.graph.node import Kind, Node, Role
from dovetail.graph.spec import FlowSpec, LMSpec, PipelineSpec
from dovetail.sched.colocated import flow_only
from dovetail.sched.lm_common import (
    TRAINER_KINDS,
    StagedLMPolicy,
    engine_devices,
    lm_only,
    lm_shape,
    rollout_engines,
    rollout_seconds,
    split_pool,
    trainer_seconds,
)
from dovetail.sched.policy import (
    Begin,
    Decision,
    DeviceView,
    Event,
    MemoryRefusal,
    Run,
    SearchContext,
    Setup,
    Shape,
    StartStep,
    SwitchRole,
    View,
    best_by_forecast,
    open_steps_on_publish,
)

HORIZON_STEPS = 1
"""Look-ahead horizon of the shape search: one step of every pipeline, the pipelines sharing the pool (the
freed devices taken by the other pipeline's work); on these scenarios it ranks candidates as a 3-step run does."""
FINALISTS = 2
"""Candidates of the one-step screen simulated again over the run's steps (each costs a full simulation)."""
SHARE = 0.475
"""Share of a device a rollout or trainer node reserves: two fit side by side ..."""
SCORE_SHARE = 0.05
"""... with room left for a rule reward."""
EPS = 1e-9


class Sliced(Shape):
    """A pipeline's jigsaw cut on its sub-pool: its kind's shape with devices `first_device` .. `first_device +
    trainer_devices - 1` (the whole pool: 0 and every device). Pipelines of the same sub-pool multiplex on it;
    sub-pools are disjoint. `turn`: pipelines take turns, a pipeline of turn k starting once every pipeline of the
    turns before it has run all its steps (every pipeline turn 0: all at once; one pipeline per turn on the whole
    pool: back to back)."""

    first_device: int
    turn: int

    def describe(self) -> str:
        """The sub-pool (and a later turn) first, then the kind's own cut."""
        devices = sub_pool(self)
        when = f"turn {self.turn}, " if self.turn else ""
        return f"{when}devices {devices[0]}-{devices[-1]}: " + base_shape(self).describe()


@dataclass(frozen=True)
class SlicedLMShape(Sliced, LMShape):
    """An LM pipeline's jigsaw cut on its sub-pool and turn."""

    first_device: int = 0
    turn: int = 0


@dataclass(frozen=True)
class SlicedFlowShape(Sliced, FlowShape):
    """A flow pipeline's jigsaw cut on its sub-pool and turn."""

    first_device: int = 0
    turn: int = 0


SLICED: Mapping[type[Shape], Callable[..., Sliced]] = {LMShape: SlicedLMShape, FlowShape: SlicedFlowShape}
"""Each kind's shape (of every kind jigsaw schedules, `Jigsaw.pipeline_kinds`) -> its cut on a sub-pool."""
UNSLICED: Mapping[type[Shape], Callable[..., Shape]] = {SlicedLMShape: LMShape, SlicedFlowShape: FlowShape}
"""`SLICED` the other way round."""

PLACE = ("first_device", "turn")
"""The fields a sliced shape adds to the kind's: where and when its pipeline runs."""


def on_slice(shape: Shape, first_device: int, turn: int = 0) -> Sliced:
    """`shape` (cut for its sub-pool's `trainer_devices`) placed on the sub-pool starting at `first_device`, in
    `turn`."""
    return SLICED[type(shape)](**asdict(shape), first_device=first_device, turn=turn)


def base_shape(shape: Sliced) -> Shape:
    """The shape without its sub-pool's place and turn (what `Jigsaw.shape` cuts for the sub-pool's size)."""
    fields = {key: value for key, value in asdict(shape).items() if key not in PLACE}
    return UNSLICED[type(shape)](**fields)


def turn_of(shape: Shape) -> int:
    """A jigsaw shape's turn (a shape cut without a slice: 0, with every pipeline)."""
    return shape.turn if isinstance(shape, Sliced) else 0


def sub_pool(shape: Shape) -> tuple[int, ...]:
    """The devices a jigsaw shape's pipeline runs on (a shape cut without a slice: its whole trainer pool)."""
    first = shape.first_device if isinstance(shape, Sliced) else 0
    return tuple(range(first, first + shape.trainer_devices))


def tail_edge(spec: LMSpec, shards: int) -> int | None:
    """The first length-band edge past which at most one engine's fair share of the step's responses is
    still running (or the last edge): where the long tail migrates. None without bands."""
    lengths = response_lengths(spec, 0, 0)
    fair = len(lengths) / shards
    for edge in spec.length_bands:
        if edge < spec.max_length and sum(n > edge for n in lengths) <= fair:
            return edge
    edges = [e for e in spec.length_bands if e < spec.max_length]
    return edges[-1] if edges else None


def generate_seconds(nodes: Sequence[Node], devices: int) -> float:
    """Wall time of a flow step's generate fragments spread over `devices`, at most one per device."""
    fragments = [n.cost_s for n in nodes if n.kind == Kind.GENERATE]
    return sum(fragments) / min(len(fragments), devices) if fragments else 0.0


PHASES = ("decode", "generate", "train")
"""The classes of work the look-ahead rolls forward: an LM's rollout, a flow pipeline's, and trainer work."""


def phase_slowdowns(slowdown: Callable[[str, str], float]) -> tuple[tuple[tuple[str, str], float], ...]:
    """The interference table (`Setup.slowdown`) between the look-ahead's classes of work, as `predict_completion`
    takes it: hashable, for its cache."""
    return tuple(((mine, other), slowdown(mine, other)) for mine in PHASES for other in PHASES)


@lru_cache(maxsize=65536)
def predict_completion(
    phases: tuple[tuple[tuple[str, float], ...], ...],
    running: frozenset[int],
    weights: tuple[float, ...],
    slowdowns: tuple[tuple[tuple[str, str], float], ...],
) -> float:
    """Weighted mean time at which each pipeline finishes its list of (class, seconds) phases, where rollout
    phases ("decode", "generate") always run, "train" phases run one pipeline at a time (first come, first
    served) except the pipelines in `running`, which are in a train phase now; co-running phases slow each
    other down by `slowdowns` (`phase_slowdowns` of the pool's interference table). `weights`: each pipeline's
    priority."""
    slowdown = dict(slowdowns)
    position = [0] * len(phases)
    left = [p[0][1] if p else 0.0 for p in phases]
    training = set(running)
    queue = [i for i, p in enumerate(phases) if p and p[0][0] == "train" and i not in training]
    now, finished = 0.0, [0.0] * len(phases)
    while True:
        if not training and queue:
            training.add(queue.pop(0))
        active = [
            i
            for i in range(len(phases))
            if position[i] < len(phases[i]) and (phases[i][position[i]][0] != "train" or i in training)
        ]
        if not active:
            return sum(w * f for w, f in zip(weights, finished)) / sum(weights)
        speed = {}
        for i in active:
            mine = phases[i][position[i]][0]
            others = [phases[j][position[j]][0] for j in active if j != i]
            speed[i] = 1.0 / max((slowdown[(mine, o)] for o in others), default=1.0)
        step = min(left[i] / speed[i] for i in active)
        now += step
        for i in active:
            left[i] -= step * speed[i]
            if left[i] <= EPS:
                training.discard(i)
                position[i] += 1
                if position[i] == len(phases[i]):
                    finished[i] = now
                    continue
                left[i] = phases[i][position[i]][1]
                if phases[i][position[i]][0] == "train":
                    queue.append(i)


def flow_cut(spec: FlowSpec, devices: int, cost: CostModel) -> FlowShape:
    """A flow step cut for the shared pool: whole-group fragments, one per device (at most the prompts, a multiple
    of the mini-batches) unless the spec fixes them, and the trainer on the whole pool. No old log-prob recompute:
    steps are on-policy (staleness 0), so the rollout's log-probs are the old ones (a KL term still gets its
    reference forward). The TSP chunk is the spec's, or the one that trains the step fastest by the cost model
    (ties: the larger) among those whose train node fits beside the pipeline's engines."""
    one_per_device = min(spec.prompts, devices)
    fragments = spec.fragments or max(spec.mini_batches, one_per_device - one_per_device % spec.mini_batches)
    shape = FlowShape(fragments, spec.tsp_chunk or 1, False, devices, shared=True)
    if spec.tsp_chunk:
        return shape
    capacity = cost.device.memory_bytes / GB
    resident = sum(shape.engines(spec, cost).resident_gb.values())
    timed = []
    for chunk in range(1, spec.trained_timesteps + 1):
        nodes = replace(shape, tsp_chunk=chunk).build(spec, 1, cost)
        if resident + max(n.memory_gb for n in nodes if n.kind == Kind.TRAIN) <= capacity:
            timed.append((trainer_seconds(nodes, devices), -chunk))
    if not timed:
        raise MemoryRefusal(
            f"{spec.name}: no train node fits beside the engines in {capacity:.0f} GB per device; "
            + ("use more devices (a smaller shard of the trainer state)" if spec.offload else "set offload: true")
        )
    return replace(shape, tsp_chunk=-min(timed)[1])


def lm_cut(spec: LMSpec, devices: int) -> LMShape:
    """An LM step cut for the shared pool, the cost-model default: the tail leaves at `tail_edge` for an engine as
    wide as the home ones; micro-batches in finishing order, so finished length bands train while the tail decodes."""
    shards = rollout_engines(spec, devices)
    return LMShape(
        shards, devices, tail_edge(spec, shards), stream=True, shared=True, tail_parallel=spec.tensor_parallel
    )


CUTS: Mapping[str, Callable[[PipelineSpec, int, CostModel], Shape]] = {
    "flow": lambda spec, devices, cost: flow_cut(flow_only("jigsaw", spec), devices, cost),
    "lm": lambda spec, devices, cost: lm_cut(lm_only("jigsaw", spec), devices),
}
"""How jigsaw cuts a step of each kind it schedules (`PipelineSpec.kind` -> the cut, on `devices`)."""


class Jigsaw(StagedLMPolicy):
    name = "jigsaw"
    pipeline_kinds = frozenset(CUTS)
    multiplexes = True
    look_ahead = True
    searches = True
    fixes = {"trainer_devices": "trains every pipeline on the whole pool"}

    @classmethod
    def shape(cls, spec: PipelineSpec, devices: int, trainer_devices: int | None, cost: CostModel) -> Shape:
        """Every pipeline on the whole pool, its cut by its kind (`CUTS`: `lm_cut`, `flow_cut`)."""
        return CUTS[spec.kind](spec, devices, cost)

    @classmethod
    def plan_shapes(cls, context: SearchContext) -> dict[str, Shape]:
        """Rollout memory from the memory model (for every step the run trains); then (`jigsaw`) the fastest in the
        simulator over the run's steps (at most `SEARCH_STEPS`) of: every pipeline on the whole pool, where each LM
        pipeline's tail migrates and how wide its engine is chosen by `_tail_search`; and the pipelines on disjoint
        sub-pools (`arrangements`: each pipeline its own, as verl-sync gives them, and mixtures of a few pipelines
        per sub-pool), each sub-pool sized by its pipelines' work. So jigsaw is never predicted below the split
        arrangement it considered, and no candidate it ranks over the run's steps beats the chosen one. The whole
        pool's tails and the mixtures are screened over `HORIZON_STEPS` steps first and only their `FINALISTS` best
        simulated over the run's (every pipeline alone always is): the whole pool shared by many pipelines is the
        slowest candidate to simulate and, past a few pipelines, the slowest to run. A run's `arrangement`
        (`PolicyOptions.arrangement`) keeps the search to the candidates of one arrangement: the whole pool shared,
        the sub-pools, or back to back."""
        specs = context.specs
        shared = rollout_shares(specs, dict(context.shapes), context.costs, context.steps)
        if not cls.searches:
            return shared
        memo: dict[tuple, float] = {}

        def forecast(candidate: dict[str, Shape], horizon: int) -> float:
            key = (tuple(sorted(candidate.items())), horizon)
            if key not in memo:
                memo[key] = context.forecast(dict(candidate), horizon)
            return memo[key]

        def beating(candidate: dict[str, Shape], horizon: int, rate: float) -> float:
            """A candidate already forecast over `horizon` keeps its figure; another is simulated only while it may
            beat `rate` (`SearchContext.forecast_beating`), its figure then not kept: it may be the bound."""
            if context.forecast_beating is None or (tuple(sorted(candidate.items())), horizon) in memo:
                return forecast(candidate, horizon)
            return context.forecast_beating(dict(candidate), horizon, rate)

        arrangement = context.options.arrangement
        whole = _tail_search(specs, shared, forecast) if arrangement in ("auto", "shared") else []
        split = arrangements(cls, context) if arrangement in ("auto", "split") else []
        alone = [c for c in split if len({sub_pool(shape) for shape in c.values()}) == len(c)]
        if arrangement == "back_to_back" or (arrangement == "auto" and len(specs) > 1):
            in_turn = [back_to_back(cls, context, home) for home in (False, True)]
            alone += [candidate for i, candidate in enumerate(in_turn) if candidate not in in_turn[:i]]
        mixtures = [c for c in split if c not in alone]
        screened = sorted(whole + mixtures, key=lambda candidate: -forecast(candidate, HORIZON_STEPS))
        return best_by_forecast(screened[:FINALISTS] + alone, forecast, context.horizon, beating)

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        everyone = tuple(range(setup.devices))
        self.pool = {name: sub_pool(setup.shapes[name]) if name in setup.shapes else everyone for name in setup.engines}
        """Each pipeline's devices: the whole pool, or the disjoint sub-pool its search gave it (`plan_shapes`)."""
        self.members = {
            pool: [name for name in setup.engines if self.pool[name] == pool] for pool in self.pool.values()
        }
        """The pipelines of each (sub-)pool, in the scenario's order."""
        self.resident_gb = dict.fromkeys(everyone, 0.0)
        """Per device, the engines of every pipeline whose sub-pool holds it."""
        self.wake_s = dict.fromkeys(everyone, 0.0)
        for name, engines in setup.engines.items():
            for d in self.pool[name]:
                for role in (Role.ROLLOUT, Role.TRAINER):
                    self.resident_gb[d] += engines.resident_gb.get(role, 0.0)
                    self.wake_s[d] += engines.wake_s.get(role, 0.0)
        if max(self.resident_gb.values()) > setup.memory_gb:
            raise MemoryRefusal(
                f"{self.name}: every pipeline's engines together need {max(self.resident_gb.values()):.0f} GB per "
                f"device, more than {setup.memory_gb:.0f} GB; multiplex fewer or smaller pipelines, or raise "
                "tensor_parallel"
            )
        self.tensor_parallel = {
            name: len(self.pool[name]) // count
            for name, shape in setup.shapes.items()
            if (count := shape.rollout_engines) is not None
        }
        """Devices per rollout engine of each pipeline whose rollout runs on engines (`Shape.rollout_engines`): its
        pool over its engines (`lm_common.tensor_parallel`). The others' rollout pieces go to any one device each."""
        self.priority = {name: setup.priorities.get(name, 1.0) for name in setup.engines}
        self.slowdowns = phase_slowdowns(setup.slowdown)
        self.tail_on: dict[tuple[str, int], tuple[int, ...]] = {}
        self.choices: list[tuple[float, tuple[str, ...]]] = []
        """(time, pipelines started) of every look-ahead choice among several, for the run's log."""
        self.turn = {name: turn_of(setup.shapes[name]) if name in setup.shapes else 0 for name in setup.engines}
        """Each pipeline's turn (`Sliced.turn`): the pipelines of a turn start once the earlier turns end."""
        self.turn_now = 0
        self._nodes: dict[str, list[str]] = {}
        self._rollouts: dict[tuple[str, int], list[str]] = {}

    def _turn(self, view: View) -> int:
        """The turn under way: the first with a pipeline not done (every node of it finished)."""
        last = max(self.turn.values())
        while self.turn_now < last and all(
            self._done(view, name) for name, turn in self.turn.items() if turn == self.turn_now
        ):
            self.turn_now += 1
        return self.turn_now

    def _done(self, view: View, pipeline: str) -> bool:
        if pipeline not in self._nodes:  # last nodes first: an unfinished pipeline is told at its first look
            self._nodes[pipeline] = [node.id for node in reversed(list(view.graph)) if node.pipeline == pipeline]
        return all(node in view.finished for node in self._nodes[pipeline])

    def _open_turn(self, view: View, turn: int) -> list[Decision]:
        """The first step of each pipeline of `turn` that has not started, on its published weights: a later turn's
        steps open when it comes, not at the run's start, so their step times are their own."""
        return [
            StartStep(name, step, view.published[name])
            for name in self.turn
            if self.turn[name] == turn and turn > 0 and name in view.published
            for step in [min(view.graph.steps(name))]
            if (name, step) not in view.started
        ]

    def _open_ahead(self, view: View, turn: int) -> list[Decision]:
        """With `PolicyOptions.staleness` above 0: each pipeline of `turn` whose latest step's rollout has begun
        (`_first_rollouts` all started) opens its next step on the latest published weights, if those are at most
        `staleness` versions behind it; so up to `staleness + 1` steps roll out at once, the oldest placed first."""
        decisions: list[Decision] = []
        for name in self.turn:
            if self.turn[name] != turn or name not in view.published:
                continue
            step = self._latest_started(view, name)
            if step is None or step + 1 not in view.graph.steps(name) or (name, step + 1) in view.started:
                continue
            if step + 1 - view.published[name] > self.setup.options.staleness:
                continue
            if all(n in view.running or n in view.finished for n in self._first_rollouts(view, name, step)):
                decisions.append(StartStep(name, step + 1, view.published[name]))
        return decisions

    def _latest_started(self, view: View, pipeline: str) -> int | None:
        steps = [s for (p, s) in view.started if p == pipeline]
        return max(steps) if steps else None

    def _first_rollouts(self, view: View, pipeline: str, step: int) -> list[str]:
        """The step's rollout nodes that follow no node of it: an LM step's prefills, a flow step's generate
        fragments (a turn after an environment's step follows the env node, of no role, and is not one)."""
        if not self._rollouts:  # every step's, in one pass over the graph
            graph = view.graph
            for n in graph:
                if n.role == Role.ROLLOUT and not any(graph[d].step == n.step for d in n.deps):
                    self._rollouts.setdefault((n.pipeline, n.step), []).append(n.id)
        return self._rollouts.get((pipeline, step), [])

    def decide(self, view: View, events: Sequence[Event]) -> list[Decision]:
        turn = self._turn(view)
        decisions: list[Decision] = [
            step for step in open_steps_on_publish(view, events) if self.turn[step.pipeline] == turn
        ]
        decisions += self._open_turn(view, turn)
        if self.setup.options.staleness:
            decisions += self._open_ahead(view, turn)
        if any(isinstance(e, Begin) for e in events):
            held = sorted({d for pool in self.pool.values() for d in pool})
            return decisions + [SwitchRole(d, Role.ANY, self.wake_s[d], self.resident_gb[d]) for d in held]
        if not view.ready:
            return decisions
        self.share_left = ReadOnFirstUse(view.devices, "free_share")
        self.memory = ReadOnFirstUse(view.devices, "memory_gb")
        ready: dict[str, list[Node]] = {}
        scores: list[Node] = []
        trainer_ready = False
        for node_id in view.ready:
            node = view.graph[node_id]
            if self.turn[node.pipeline] != turn:
                continue
            ready.setdefault(node.pipeline, []).append(node)
            if node.kind == Kind.SCORE:
                scores.append(node)
            trainer_ready = trainer_ready or node.kind in TRAINER_KINDS
        for pipeline in view.graph.pipelines():
            decisions += self._rollout(pipeline, [n for n in ready.get(pipeline, ()) if n.role == Role.ROLLOUT])
        # The pipelines with trainer work running, looked up only where some trainer work waits (else `_trainer`
        # starts nothing whatever runs): a large pool runs many rollout nodes.
        training = (
            {view.graph[n].pipeline for n in view.running if view.graph[n].kind in TRAINER_KINDS}
            if trainer_ready
            else set()
        )
        for pool in dict.fromkeys(self.pool.values()):
            decisions += self._trainer(view, pool, ready, training)
        for node in scores:
            if (device := self._roomiest(node, SCORE_SHARE)) is not None:
                decisions.append(self._take(node, (device,), SCORE_SHARE))
        return decisions

    # ------------------------------------------------------------ placement
    def _fits(self, node: Node, devices: Sequence[int], share: float) -> bool:
        return all(
            self.share_left[d] >= share - EPS and self.memory[d] + node.memory_gb <= self.setup.memory_gb + EPS
            for d in devices
        )

    def _take(self, node: Node, devices: tuple[int, ...], share: float) -> Run:
        for d in devices:
            self.share_left[d] -= share
            self.memory[d] += node.memory_gb
        return Run(node.id, devices, share)

    def _roomiest(self, node: Node, share: float) -> int | None:
        fitting = [d for d in self.pool[node.pipeline] if self._fits(node, (d,), share)]
        return max(fitting, key=lambda d: (self.share_left[d], -d), default=None)

    def _rollout(self, pipeline: str, ready: list[Node]) -> list[Decision]:
        """The pipeline's `ready` rollout nodes. LM: home shards on their engines; the migrated tail on the
        least-loaded engine, then decoded there. Flow: each generate fragment on the device with the most free share,
        as the migrated tail."""
        decisions: list[Decision] = []
        if pipeline not in self.tensor_parallel:
            for node in ready:
                if (device := self._roomiest(node, SHARE)) is not None:
                    decisions.append(self._take(node, (device,), SHARE))
            return decisions
        pool, tp = self.pool[pipeline], self.tensor_parallel[pipeline]
        for node in ready:
            shard = node.shard
            if shard is not None:
                devices = engine_devices(pool, shard, tp)
            elif node.kind == Kind.MIGRATE:
                width = lm_shape(self.name, self.setup.shapes[pipeline]).tail_parallel or tp
                engines = [engine_devices(pool, k, width) for k in range(len(pool) // width)]
                devices = max(engines, key=lambda e: (min(self.share_left[d] for d in e), -e[0]))
            else:
                devices = self.tail_on[(pipeline, node.step)]
            if self._fits(node, devices, SHARE):
                self.tail_on[(pipeline, node.step)] = devices
                decisions.append(self._take(node, devices, SHARE))
        return decisions

    def _trainer(
        self, view: View, pool: tuple[int, ...], ready: dict[str, list[Node]], training: set[str]
    ) -> list[Decision]:
        """Each pipeline's next trainer node on its whole (sub-)pool, one at a time per pipeline; which of the
        pool's waiting pipelines start now is the look-ahead's (or the greedy) choice. Candidates come largest first,
        higher priorities first among equal sizes: the greedy starts the first. Only as many as fit side by side
        (`SHARE` each) are combined, so the choice stays cheap with many pipelines. `ready`: every pipeline's ready
        nodes; `training`: the pipelines with trainer work running."""
        mine = self.members[pool]
        busy = training.intersection(mine)
        waiting: dict[str, Node] = {}
        for pipeline in mine:
            if pipeline not in busy:
                first = next((n for n in ready.get(pipeline, ()) if n.kind in TRAINER_KINDS), None)
                if first is not None:
                    waiting[pipeline] = first
        if not waiting:
            return []
        by_priority = sorted(waiting, key=lambda p: (-self.priority[p], p))
        least_free, most_memory = min(self.share_left.over(pool)), max(self.memory.over(pool))
        side_by_side = int((least_free + EPS) // SHARE)
        candidates = [
            group
            for size in range(min(len(waiting), side_by_side), -1, -1)
            for group in combinations(by_priority, size)
            if self._fits_all([waiting[p] for p in group], least_free, most_memory) and (group or busy)
        ]
        if not candidates:
            return []
        chosen = (
            candidates[0]
            if not self.look_ahead or len(candidates) == 1
            else self._look_ahead(view, mine, candidates, busy)
        )
        if len(candidates) > 1:
            self.choices.append((view.now, chosen))
        return [self._take(waiting[p], pool, SHARE) for p in chosen]

    def _fits_all(self, nodes: list[Node], least_free: float, most_memory: float) -> bool:
        """Whether `nodes` fit side by side on every device of a pool whose freest-taken device has `least_free` of
        its share and the fullest `most_memory` GB."""
        return (
            least_free >= SHARE * len(nodes) - EPS
            and most_memory + sum(n.memory_gb for n in nodes) <= self.setup.memory_gb + EPS
        )

    # ------------------------------------------------------------ look-ahead
    def _look_ahead(
        self, view: View, pipelines: list[str], candidates: list[tuple[str, ...]], busy: set[str]
    ) -> tuple[str, ...]:
        """The candidate with the earliest weighted mean completion of the pool's `pipelines`."""
        phases = tuple(self._phases(view, p) for p in pipelines)
        weights = tuple(self.priority[p] for p in pipelines)
        index = {p: i for i, p in enumerate(pipelines)}

        def predicted(group: tuple[str, ...]) -> float:
            return predict_completion(phases, frozenset(index[p] for p in (*group, *busy)), weights, self.slowdowns)

        return min(candidates, key=predicted)  # ties: the first candidate (largest, then highest priorities)

    def _phases(self, view: View, pipeline: str) -> tuple[tuple[str, float], ...]:
        """What is left of the pipeline's open step and its next one, as (class, seconds on its pool): a rollout on
        engines (an LM's) runs its shards' chains on them, independent pieces (a flow pipeline's generate
        fragments) spread one per device; its class is its shape's `rollout_kind`."""
        opened = [s for (p, s) in view.started if p == pipeline]
        if not opened:
            return ()
        step = max(opened)
        pool = self.pool[pipeline]
        tp = self.tensor_parallel.get(pipeline)
        phase = self.setup.shapes[pipeline].rollout_kind.value
        phases: list[tuple[str, float]] = []
        for s in (step, step + 1):
            nodes = [n for n in view.graph.of(pipeline, s) if n.id not in view.finished]
            rollout = generate_seconds(nodes, len(pool)) if tp is None else rollout_seconds(nodes, tp)
            if rollout > 0:
                phases.append((phase, round(rollout, 1)))
            train = trainer_seconds(nodes, len(pool))
            if train > 0:
                phases.append(("train", round(train, 1)))
        return tuple(phases)


class JigsawGreedy(Jigsaw):
    name = "jigsaw-greedy"
    look_ahead = False
    searches = False


def rollout_shares(
    specs: Sequence[PipelineSpec], shapes: Mapping[str, Shape], costs: Mapping[str, CostModel], steps: int = 1
) -> dict[str, Shape]:
    """Each rollout engine whose shape sizes its memory (`Shape.sizes_rollout_memory`: an LM's weights and KV cache)
    gets an even share of what the rest leaves of a device, at most the calibrated rollout memory fraction. The rest:
    every pipeline's resident FSDP trainer shard and the largest working memory of its trainer nodes over the run's
    `steps` (they may run side by side; a later step's longest micro-batch may need more than the first's), and
    each other rollout engine (a flow pipeline's) with its largest rollout piece's working memory (it may generate
    beside its trainer)."""
    capacity = costs[specs[0].name].device.memory_bytes / GB
    held = 0.0
    for spec in specs:
        shape, cost = shapes[spec.name], costs[spec.name]
        resident = shape.engines(spec, cost).resident_gb
        nodes = shape.build(spec, steps, cost)
        held += resident[Role.TRAINER] + max(n.memory_gb for n in nodes if n.kind in TRAINER_KINDS)
        if not shape.sizes_rollout_memory:
            held += resident[Role.ROLLOUT] + max(n.memory_gb for n in nodes if n.kind == shape.rollout_kind)
    if held >= capacity:
        raise MemoryRefusal(
            f"jigsaw: the pipelines' trainers and flow rollout engines alone need {held:.0f} GB per device, "
            f"more than {capacity:.0f} GB"
        )
    sized = [spec for spec in specs if shapes[spec.name].sizes_rollout_memory]
    if not sized:
        return dict(shapes)
    share = min(DEFAULT.rollout_memory_fraction, (capacity - held) / capacity / len(sized))
    for spec in sized:
        weights_gb = spec.catalogue_model().params * BF16 / GB / spec.rollout_engine_devices
        if weights_gb >= share * capacity:
            raise MemoryRefusal(
                f"{spec.name}: jigsaw keeps every pipeline's trainer resident, which leaves {share * capacity:.0f} GB "
                f"per device for its rollout engine, less than its weights ({weights_gb:.0f} GB at tensor_parallel="
                f"{spec.rollout_engine_devices}): add devices (the trainer's shard shrinks) or raise tensor_parallel"
            )
    return dict(shapes) | {spec.name: replace(shapes[spec.name], rollout_memory=share) for spec in sized}


def _tail_search(
    specs: Sequence[PipelineSpec], shapes: dict[str, Shape], forecast: Callable[[dict[str, Shape], int], float]
) -> list[dict[str, Shape]]:
    """Where each pipeline of the whole pool whose tail migrates (`Shape.tails_migrate`: an LM's) migrates it and how
    wide the tail's engine is, by rolling the simulator forward `HORIZON_STEPS` steps per candidate: coordinate
    descent over the tail engine's width (the home width doubled while it stays within one pipeline's fair share of
    the pool) and the migration edge (the length bands). Every candidate it scored, the best first; `shapes` alone
    without such a pipeline."""
    tails = [
        (lm_only("jigsaw", spec), lm_shape("jigsaw", shapes[spec.name]))
        for spec in specs
        if shapes[spec.name].tails_migrate
    ]
    if not tails:
        return [shapes]
    devices = next(iter(shapes.values())).trainer_devices
    choices: dict[str, tuple[list[int | None], list[int]]] = {}
    for spec, shape in tails:
        edges: list[int | None] = [e for e in spec.length_bands if e < spec.max_length] or [shape.migrate_at]
        widths = [spec.tensor_parallel]
        while widths[-1] * 2 <= devices // len(specs):
            widths.append(widths[-1] * 2)
        choices[spec.name] = (edges, widths)
    migrate_at = {spec.name: shape.migrate_at for spec, shape in tails}

    def candidate(point: tuple[int, ...]) -> dict[str, Shape]:
        return shapes | {
            name: replace(
                shapes[name],
                migrate_at=edges[min(point[0], len(edges) - 1)],
                tail_parallel=widths[min(point[1], len(widths) - 1)],
            )
            for name, (edges, widths) in choices.items()
        }

    scores: dict[tuple[int, ...], float] = {}

    def score(point: tuple[int, ...]) -> float:
        if point not in scores:
            scores[point] = forecast(candidate(point), HORIZON_STEPS)
        return scores[point]

    start = max(edges.index(migrate_at[n]) if migrate_at[n] in edges else 0 for n, (edges, _) in choices.items())
    sizes = [max(len(e) for e, _ in choices.values()), max(len(w) for _, w in choices.values())]
    point: tuple[int, ...] = (start, 0)
    for _ in range(2):
        before = point
        for axis in (0, 1):
            point = max(
                (tuple(value if a == axis else point[a] for a in range(2)) for value in range(sizes[axis])),
                key=lambda p: (score(p), -p[1], p[0]),
            )
        if point == before:
            break
    return [candidate(p) for p in sorted(scores, key=lambda p: (-scores[p], p != point, p[1], -p[0]))]


class ReadOnFirstUse(dict):
    """Device -> a figure of the view, read when a decision first looks at that device and kept (and updated by the
    decision's own placements) from then on: a decision looks at few of a large pool's devices."""

    def __init__(self, devices: Sequence[DeviceView], figure: str) -> None:
        super().__init__()
        self.devices = devices
        self.read = attrgetter(figure)

    def __missing__(self, device: int) -> float:
        value = self[device] = self.read(self.devices[device])
        return value

    def over(self, devices: Sequence[int]) -> Iterator[float]:
        """The figure of each of `devices`, read where not kept yet without keeping it: the view does not change
        during a decision, so a later first use reads the same, and a whole pool's minimum costs one pass."""
        read, states = self.read, self.devices
        if not self:  # nothing kept yet (a decision's first look): every figure straight from the view
            return map(read, map(states.__getitem__, devices))
        return (self[d] if d in self else read(states[d]) for d in devices)


def pool_size(context: SearchContext) -> int:
    """The devices the search arranges: the run's, else the whole pool the pipelines' default shapes train on."""
    return context.devices or next(iter(context.shapes.values())).trainer_devices


def arrangements(cls: type[Jigsaw], context: SearchContext) -> list[dict[str, Shape]]:
    """The pipelines on disjoint sub-pools: cut, in order, into k groups of consecutive pipelines (sizes differing by
    at most one) for k = 2, 4, 8, ... and every pipeline alone (k = N, the arrangement verl-sync gives, also with its
    even slices); each group multiplexes on a sub-pool sized by its pipelines' work (`slice_sizes`: device-seconds of
    a step, at least the widest rollout engine of the group), each also with its LM tails home and in stages
    (`tails_home`, `in_stages`). An arrangement whose sub-pools do not fit is left out."""
    specs = list(context.specs)
    devices = pool_size(context)
    work = {spec.name: step_work(spec, context.shapes[spec.name], context.costs[spec.name]) for spec in specs}
    least = {spec.name: spec.rollout_engine_devices for spec in specs}
    counts = sorted({k for k in (2**i for i in range(1, len(specs).bit_length())) if k < len(specs)} | {len(specs)})
    layouts: list[tuple[list[list[PipelineSpec]], list[int]]] = []
    for k in counts if len(specs) > 1 else []:
        groups = [specs[i : i + size] for i, size in _runs(len(specs), k)]
        minimums = [max(least[spec.name] for spec in group) for group in groups]
        sizes = slice_sizes([sum(work[spec.name] for spec in group) for group in groups], minimums, devices)
        if sizes is not None:
            layouts.append((groups, sizes))
        even = [len(part) for part in split_pool(devices, k)] if k <= devices else None
        if k == len(specs) and even is not None and even != sizes and all(map(int.__ge__, even, minimums)):
            layouts.append((groups, even))
    candidates = []
    for groups, sizes in layouts:
        candidate: dict[str, Shape] = {}
        first = 0
        try:
            for group, size in zip(groups, sizes):
                cut = {
                    spec.name: on_slice(cls.shape(spec, size, None, context.costs[spec.name]), first) for spec in group
                }
                candidate |= rollout_shares(group, cut, context.costs, context.steps)
                first += size
        except ValueError:  # a sub-pool too small for its pipelines' engines
            continue
        candidates += [c for c in (candidate, tails_home(candidate), in_stages(candidate)) if c not in candidates]
    return candidates


def with_tails_cut(candidate: dict[str, Shape], **fields: object) -> dict[str, Shape]:
    """`candidate` with `fields` changed in the shape of every pipeline whose tail migrates (`Shape.tails_migrate`)."""
    return {name: replace(shape, **fields) if shape.tails_migrate else shape for name, shape in candidate.items()}


def tails_home(candidate: dict[str, Shape]) -> dict[str, Shape]:
    """`candidate` with every LM pipeline's long tail kept on its own engines (no migration): what a pipeline alone
    on its (sub-)pool may prefer, the tail's engine being on the devices its own trainer work needs."""
    return with_tails_cut(candidate, migrate_at=None)


def in_stages(candidate: dict[str, Shape]) -> dict[str, Shape]:
    """`candidate` with every LM pipeline's step in stages, as verl-sync runs it: its tail home, and its micro-batches
    trained once every response is done, not streamed beside the decoding. On a sub-pool of its own, where nothing of
    another pipeline fills the decode's idle devices, that can be the faster cut: on a CPU core, work beside work runs
    slower than one after the other (the interference table's slowdowns above 2)."""
    return with_tails_cut(candidate, migrate_at=None, stream=False)


def back_to_back(cls: type[Jigsaw], context: SearchContext, home: bool = False) -> dict[str, Shape]:
    """Every pipeline alone on the whole pool, one after another in the scenario's order (turn k: the k-th): running
    them back to back, which multiplexing must beat to be worth it. With `home`, an LM pipeline's long tail
    stays on its engines (no migration: alone in its turn there is no other pipeline to give the freed devices to,
    only its own trainer work). Every pipeline's engines stay resident, as in any jigsaw arrangement, so rollout
    memory is shared as on the whole pool (`rollout_shares`)."""
    devices = pool_size(context)
    cut: dict[str, Shape] = {
        spec.name: on_slice(cls.shape(spec, devices, None, context.costs[spec.name]), 0, turn)
        for turn, spec in enumerate(context.specs)
    }
    return rollout_shares(context.specs, tails_home(cut) if home else cut, context.costs, context.steps)


def _runs(items: int, parts: int) -> list[tuple[int, int]]:
    """(start, length) of `parts` consecutive runs covering `items`, lengths differing by at most one."""
    base, extra = divmod(items, parts)
    runs, start = [], 0
    for i in range(parts):
        length = base + (1 if i < extra else 0)
        runs.append((start, length))
        start += length
    return runs


def step_work(spec: PipelineSpec, shape: Shape, cost) -> float:
    """Device-seconds of one step of `spec` as `shape` cuts it (collectives: their wall time): what a sub-pool is
    sized by."""
    return sum(n.seconds_on(1) for n in shape.build(spec, 1, cost))


def slice_sizes(works: Sequence[float], minimums: Sequence[int], devices: int) -> list[int] | None:
    """`devices` dealt to groups of `works` device-seconds, each at least its minimum: every further device to the
    group with the most work per device so far (largest averages), so sizes follow the work. None when the
    minimums alone exceed the pool."""
    sizes = list(minimums)
    if sum(sizes) > devices:
        return None
    for _ in range(devices - sum(sizes)):
        i = max(range(len(sizes)), key=lambda i: (works[i] / sizes[i], -i))
        sizes[i] += 1
    return sizes
