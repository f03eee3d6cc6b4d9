"""`jigsaw`: JigsawRL's pipeline multiplexing (LLM GRPO, flow GRPO beside it), and `jigsaw-greedy`, its ablation.

Several RL pipelines share one pool. Every device holds every pipeline's rollout engine (with a reduced
KV-cache budget) and FSDP trainer shard (role ANY), so nothing is ever put to sleep. Each step is the
sub-stage graph of `graph.llm` with shareable nodes: a pipeline's rollout runs on all devices as one
engine per `tensor_parallel` devices, its trainer work on the whole pool. Complementary sub-stages of
different pipelines — bandwidth-bound decode beside compute-bound log-prob / training — share devices
(share `SHARE` each) and slow each other down by the pool's interference table (`Setup.slowdown`: the calibrated
default, or the table a multiplexed run measures on its own devices, `exec.interference`). Long-tail responses
migrate at `migrate_at` tokens (re-prefill counted) onto one engine of `tail_parallel` devices, freeing the
others for the other pipeline's decode and trainer work; micro-batches are whole prompt groups in finishing
order, so finished length bands get their log-probs and gradients while the tail decodes (one optimizer
step per batch: steps stay on-policy, staleness 0). A flow (text-to-image) pipeline multiplexes the same way:
its generate fragments (whole prompt groups, one per device) are rollout work on the roomiest devices, its
log-prob, train, commit and publish nodes trainer work on the whole pool.

`jigsaw` chooses where the tail migrates and how wide its engine is by rolling the simulator forward one
step per candidate (`plan_shapes`, memoized coordinate descent); each rollout engine's memory is what the
trainers leave, split evenly (`rollout_shares`). At run time, when several pipelines' trainer work wants
the (compute-bound) pool, it rolls a memoized stage-level model of the pool forward over each pipeline's
current and next step for every candidate set and takes the earliest mean completion, weighted by each
pipeline's `priority`. `jigsaw-greedy`, the ablation, keeps the cost-model default shape (tail at `tail_edge`,
engine as wide as the home ones) and starts everything that fits now, higher priorities first when not
everything fits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import lru_cache
from itertools import combinations

from dovetail.cost.calibration import DEFAULT
from dovetail.graph.flow import BF16, FlowShape
from dovetail.graph.llm import GB, LLMShape, response_lengths
from dovetail.graph.node import Kind, Node, Role
from dovetail.graph.spec import FlowSpec, LLMSpec, PipelineSpec
from dovetail.sched.llm_common import (
    TRAINER_KINDS,
    StagedLLMPolicy,
    engine_devices,
    rollout_engines,
    rollout_seconds,
    tensor_parallel,
    trainer_seconds,
)
from dovetail.sched.policy import (
    Begin,
    Decision,
    Event,
    Run,
    SearchContext,
    Setup,
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


def tail_edge(spec, shards: int) -> int | None:
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
"""The classes of work the look-ahead rolls forward: an LLM's rollout, a flow pipeline's, and trainer work."""


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


def flow_shape(spec: FlowSpec, devices: int, cost) -> FlowShape:
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
        raise ValueError(
            f"{spec.name}: no train node fits beside the engines in {capacity:.0f} GB per device; set offload: true"
        )
    return replace(shape, tsp_chunk=-min(timed)[1])


class Jigsaw(StagedLLMPolicy):
    name = "jigsaw"
    pipeline_kinds = frozenset({"lm", "flow"})
    multiplexes = True
    look_ahead = True
    searches = True
    fixes = {"trainer_devices": "trains every pipeline on the whole pool"}

    @classmethod
    def shape(cls, spec: PipelineSpec, devices: int, trainer_devices: int | None, cost) -> LLMShape | FlowShape:
        """LLM, the cost-model default: the tail leaves at `tail_edge` for an engine as wide as the home ones;
        micro-batches in finishing order, so finished length bands train while the tail decodes. Flow: `flow_shape`."""
        if isinstance(spec, FlowSpec):
            return flow_shape(spec, devices, cost)
        shards = rollout_engines(spec, devices)
        return LLMShape(
            shards, devices, tail_edge(spec, shards), stream=True, shared=True, tail_parallel=spec.tensor_parallel
        )

    @classmethod
    def plan_shapes(cls, context: SearchContext) -> dict[str, LLMShape | FlowShape]:
        """Rollout memory from the memory model (for every step the run trains); then (`jigsaw`) where each LLM
        pipeline's tail migrates and how wide its engine is, by rolling the simulator forward `HORIZON_STEPS` steps
        per candidate (`forecast(shapes, steps)` -> samples/s; memoized): coordinate descent over the tail engine's
        width (the home width doubled while it stays within one pipeline's fair share of the pool) and the migration
        edge (the length bands). The `FINALISTS` best of that screen are simulated again over the run's steps (at
        most `SEARCH_STEPS`) and the fastest kept, so no candidate the search ranks over the run's steps beats the
        chosen one. Flow shapes pass through."""
        specs, forecast = context.specs, context.forecast
        shapes = rollout_shares(specs, dict(context.shapes), context.costs, context.steps)
        llm_specs = [spec for spec in specs if isinstance(spec, LLMSpec)]
        if not cls.searches or not llm_specs:
            return shapes
        devices = next(iter(shapes.values())).trainer_devices
        choices: dict[str, tuple[list[int | None], list[int]]] = {}
        for spec in llm_specs:
            edges = [e for e in spec.length_bands if e < spec.max_length] or [shapes[spec.name].migrate_at]
            widths = [spec.tensor_parallel]
            while widths[-1] * 2 <= devices // len(specs):
                widths.append(widths[-1] * 2)
            choices[spec.name] = (edges, widths)

        def candidate(point: tuple[int, int]) -> dict[str, LLMShape | FlowShape]:
            return shapes | {
                name: replace(
                    shapes[name],
                    migrate_at=edges[min(point[0], len(edges) - 1)],
                    tail_parallel=widths[min(point[1], len(widths) - 1)],
                )
                for name, (edges, widths) in choices.items()
            }

        memo: dict[tuple[int, int], float] = {}

        def score(point: tuple[int, int]) -> float:
            if point not in memo:
                memo[point] = forecast(candidate(point), HORIZON_STEPS)
            return memo[point]

        start = [
            max(
                edges.index(shapes[n].migrate_at) if shapes[n].migrate_at in edges else 0
                for n, (edges, _) in choices.items()
            ),
            0,
        ]
        sizes = [max(len(e) for e, _ in choices.values()), max(len(w) for _, w in choices.values())]
        point = tuple(start)
        for _ in range(2):
            before = point
            for axis in (0, 1):
                point = max(
                    (tuple(value if a == axis else point[a] for a in range(2)) for value in range(sizes[axis])),
                    key=lambda p: (score(p), -p[1], p[0]),
                )
            if point == before:
                break
        horizon = context.horizon
        if horizon == HORIZON_STEPS:
            return candidate(point)
        screened = sorted(memo, key=lambda p: (-memo[p], p != point, p[1], -p[0]))
        return best_by_forecast([candidate(p) for p in screened[:FINALISTS]], forecast, horizon)

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        held = [
            gb
            for engines in setup.engines.values()
            for role, gb in engines.resident_gb.items()
            if role in (Role.ROLLOUT, Role.TRAINER)
        ]
        self.resident_gb = sum(held)
        if self.resident_gb > setup.memory_gb:
            raise ValueError(
                f"{self.name}: every pipeline's engines together need {self.resident_gb:.0f} GB per device, more than "
                f"{setup.memory_gb:.0f} GB; multiplex fewer or smaller pipelines, or raise tensor_parallel"
            )
        self.wake_s = sum(
            s
            for engines in setup.engines.values()
            for role, s in engines.wake_s.items()
            if role in (Role.ROLLOUT, Role.TRAINER)
        )
        self.everyone = tuple(range(setup.devices))
        self.flow = {name for name, shape in setup.shapes.items() if isinstance(shape, FlowShape)}
        """Flow pipelines: their rollout is generate fragments, not LLM engines."""
        self.priority = {name: setup.priorities.get(name, 1.0) for name in setup.engines}
        self.slowdowns = phase_slowdowns(setup.slowdown)
        self.tail_on: dict[tuple[str, int], tuple[int, ...]] = {}
        self.choices: list[tuple[float, tuple[str, ...]]] = []
        """(time, pipelines started) of every look-ahead choice among several, for the run's log."""

    def decide(self, view: View, events: Sequence[Event]) -> list[Decision]:
        decisions: list[Decision] = open_steps_on_publish(view, events)
        if any(isinstance(e, Begin) for e in events):
            return decisions + [SwitchRole(d, Role.ANY, self.wake_s, self.resident_gb) for d in self.everyone]
        if not view.ready:
            return decisions
        self.free = {d: view.devices[d].free_share for d in self.everyone}
        self.memory = {d: view.devices[d].memory_gb for d in self.everyone}
        for pipeline in view.graph.pipelines():
            decisions += self._rollout(view, pipeline)
        decisions += self._trainer(view)
        for node in (view.graph[n] for n in view.ready):
            if node.kind == Kind.SCORE and (device := self._roomiest(node, SCORE_SHARE)) is not None:
                decisions.append(self._take(node, (device,), SCORE_SHARE))
        return decisions

    # ------------------------------------------------------------ placement
    def _fits(self, node: Node, devices: Sequence[int], share: float) -> bool:
        return all(
            self.free[d] >= share - EPS and self.memory[d] + node.memory_gb <= self.setup.memory_gb + EPS
            for d in devices
        )

    def _take(self, node: Node, devices: tuple[int, ...], share: float) -> Run:
        for d in devices:
            self.free[d] -= share
            self.memory[d] += node.memory_gb
        return Run(node.id, devices, share)

    def _roomiest(self, node: Node, share: float) -> int | None:
        fitting = [d for d in self.everyone if self._fits(node, (d,), share)]
        return max(fitting, key=lambda d: (self.free[d], -d), default=None)

    def _rollout(self, view: View, pipeline: str) -> list[Decision]:
        """LLM: home shards on their engines; the migrated tail on the least-loaded engine, then decoded there.
        Flow: each generate fragment on the device with the most free share, as the migrated tail."""
        decisions: list[Decision] = []
        ready = [node for node in self.ready_nodes(view, pipeline) if node.role == Role.ROLLOUT]
        if pipeline in self.flow:
            for node in ready:
                if (device := self._roomiest(node, SHARE)) is not None:
                    decisions.append(self._take(node, (device,), SHARE))
            return decisions
        tp = tensor_parallel(view, pipeline, self.everyone)
        for node in ready:
            shard = node.shard
            if shard is not None:
                devices = engine_devices(self.everyone, shard, tp)
            elif node.kind == Kind.MIGRATE:
                width = self.setup.shapes[pipeline].tail_parallel or tp
                engines = [engine_devices(self.everyone, k, width) for k in range(len(self.everyone) // width)]
                devices = max(engines, key=lambda e: (min(self.free[d] for d in e), -e[0]))
            else:
                devices = self.tail_on[(pipeline, node.step)]
            if self._fits(node, devices, SHARE):
                self.tail_on[(pipeline, node.step)] = devices
                decisions.append(self._take(node, devices, SHARE))
        return decisions

    def _trainer(self, view: View) -> list[Decision]:
        """Each pipeline's next trainer node on the whole pool, one at a time per pipeline; which of the
        waiting pipelines start now is the look-ahead's (or the greedy) choice. Candidates come largest first,
        higher priorities first among equal sizes: the greedy starts the first."""
        busy = {view.graph[n].pipeline for n in view.running if view.graph[n].kind in TRAINER_KINDS}
        waiting: dict[str, Node] = {}
        for node_id in view.ready:
            node = view.graph[node_id]
            if node.kind in TRAINER_KINDS and node.pipeline not in busy and node.pipeline not in waiting:
                waiting[node.pipeline] = node
        by_priority = sorted(waiting, key=lambda p: (-self.priority[p], p))
        candidates = [
            group
            for size in range(len(waiting), -1, -1)
            for group in combinations(by_priority, size)
            if self._fits_all([waiting[p] for p in group]) and (group or busy)
        ]
        if not candidates:
            return []
        chosen = (
            candidates[0] if not self.look_ahead or len(candidates) == 1 else self._look_ahead(view, candidates, busy)
        )
        if len(candidates) > 1:
            self.choices.append((view.now, chosen))
        return [self._take(waiting[p], self.everyone, SHARE) for p in chosen]

    def _fits_all(self, nodes: list[Node]) -> bool:
        """Whether `nodes` fit side by side on every device (share and memory)."""
        return (
            min(self.free.values()) >= SHARE * len(nodes) - EPS
            and max(self.memory.values()) + sum(n.memory_gb for n in nodes) <= self.setup.memory_gb + EPS
        )

    # ------------------------------------------------------------ look-ahead
    def _look_ahead(self, view: View, candidates: list[tuple[str, ...]], busy: set[str]) -> tuple[str, ...]:
        pipelines = view.graph.pipelines()
        phases = tuple(self._phases(view, p) for p in pipelines)
        weights = tuple(self.priority[p] for p in pipelines)
        index = {p: i for i, p in enumerate(pipelines)}

        def predicted(group: tuple[str, ...]) -> float:
            return predict_completion(phases, frozenset(index[p] for p in (*group, *busy)), weights, self.slowdowns)

        return min(candidates, key=predicted)  # ties: the first candidate (largest, then highest priorities)

    def _phases(self, view: View, pipeline: str) -> tuple[tuple[str, float], ...]:
        """What is left of the pipeline's open step and its next one, as (class, seconds on the pool): an LLM's
        rollout decodes on its engines, a flow pipeline's generate fragments spread one per device."""
        opened = [s for (p, s) in view.started if p == pipeline]
        if not opened:
            return ()
        step = max(opened)
        devices = len(self.everyone)
        flow = pipeline in self.flow
        tp = None if flow else tensor_parallel(view, pipeline, self.everyone)
        phases: list[tuple[str, float]] = []
        for s in (step, step + 1):
            nodes = [n for n in view.graph.of(pipeline, s) if n.id not in view.finished]
            rollout = generate_seconds(nodes, devices) if flow else rollout_seconds(nodes, tp)
            if rollout > 0:
                phases.append(("generate" if flow else "decode", round(rollout, 1)))
            train = trainer_seconds(nodes, devices)
            if train > 0:
                phases.append(("train", round(train, 1)))
        return tuple(phases)


class JigsawGreedy(Jigsaw):
    name = "jigsaw-greedy"
    look_ahead = False
    searches = False


def rollout_shares(
    specs: Sequence[PipelineSpec], shapes: dict[str, LLMShape | FlowShape], costs, steps: int = 1
) -> dict[str, LLMShape | FlowShape]:
    """Each LLM pipeline's rollout engine (weights and KV cache) gets an even share of what the rest leaves of a
    device, at most the calibrated rollout memory fraction. The rest: every pipeline's resident FSDP trainer shard
    and the largest working memory of its trainer nodes over the run's `steps` (they may run side by side; a
    later step's longest micro-batch may need more than the first's), and a flow pipeline's rollout engine with
    its largest generate fragment's working memory (it may generate beside its trainer)."""
    capacity = costs[specs[0].name].device.memory_bytes / GB
    held = 0.0
    for spec in specs:
        shape, cost = shapes[spec.name], costs[spec.name]
        resident = shape.engines(spec, cost).resident_gb
        nodes = shape.build(spec, steps, cost)
        held += resident[Role.TRAINER] + max(n.memory_gb for n in nodes if n.kind in TRAINER_KINDS)
        if isinstance(spec, FlowSpec):
            held += resident[Role.ROLLOUT] + max(n.memory_gb for n in nodes if n.kind == Kind.GENERATE)
    if held >= capacity:
        raise ValueError(
            f"jigsaw: the pipelines' trainers and flow rollout engines alone need {held:.0f} GB per device, "
            f"more than {capacity:.0f} GB"
        )
    llm = [spec for spec in specs if isinstance(spec, LLMSpec)]
    if not llm:
        return shapes
    share = min(DEFAULT.rollout_memory_fraction, (capacity - held) / capacity / len(llm))
    for spec in llm:
        weights_gb = spec.catalogue_model().params * BF16 / GB / spec.tensor_parallel
        if weights_gb >= share * capacity:
            raise ValueError(
                f"{spec.name}: jigsaw keeps every pipeline's trainer resident, which leaves {share * capacity:.0f} GB "
                f"per device for its rollout engine, less than its weights ({weights_gb:.0f} GB at tensor_parallel="
                f"{spec.tensor_parallel}): add devices (the trainer's shard shrinks) or raise tensor_parallel"
            )
    return shapes | {spec.name: replace(shapes[spec.name], rollout_memory=share) for spec in llm}
