"""The Policy interface: events in, decisions out.

A policy is the whole scheduling brain of dovetail. An executor (the simulator, or the Ray runtime)
calls `decide(view, events)` whenever something happened; the policy answers with decisions that the
executor validates and carries out. A policy never sleeps, never computes a model and never imports
torch, and it is deterministic given the events — so the very same object plans a 64-GPU run in the
simulator in seconds and drives real devices.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Literal, Protocol, cast, get_args

from dovetail.cost.calibration import DEFAULT
from dovetail.cost.model import CostModel
from dovetail.graph.node import Engines, Graph, Kind, Node, Role
from dovetail.graph.shape import Shape
from dovetail.graph.spec import PipelineSpec

# ---------------------------------------------------------------- events (executor -> policy)


@dataclass(frozen=True, slots=True)
class Begin:
    """The run starts: every device is empty (no role). Sent once, at time 0."""

    time: float


@dataclass(frozen=True, slots=True)
class NodeReady:
    """All dependencies of `node` finished and its step has been started."""

    time: float
    node: str


@dataclass(frozen=True, slots=True)
class NodeStarted:
    time: float
    node: str
    devices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NodeFinished:
    """`seconds` is the measured wall time of the node (all segments when it migrated)."""

    time: float
    node: str
    devices: tuple[int, ...]
    seconds: float


@dataclass(slots=True, unsafe_hash=True)
class DeviceIdle:
    """The device runs nothing and is not switching. Never changed once made, but not frozen: one is made per device
    a node leaves (a whole trainer pool's), and a frozen dataclass's `__init__` costs several times a plain one's."""

    time: float
    device: int


@dataclass(frozen=True, slots=True)
class RoleSwitched:
    time: float
    device: int
    role: Role


@dataclass(frozen=True, slots=True)
class StepCommitted:
    """The optimizer step of `step` finished: the trainer now holds weights `version` (= step + 1)."""

    time: float
    pipeline: str
    step: int
    version: int


@dataclass(frozen=True, slots=True)
class VersionPublished:
    """Weights `version` reached the rollout engines; version 0 (the initial weights) is published at Begin."""

    time: float
    pipeline: str
    version: int


Event = Begin | NodeReady | NodeStarted | NodeFinished | DeviceIdle | RoleSwitched | StepCommitted | VersionPublished

# ---------------------------------------------------------------- decisions (policy -> executor)


@dataclass(frozen=True, slots=True)
class Run:
    """Run a ready node on `devices`. A shareable node gets `share` of each device's compute (its
    duration grows by 1 / share); an exclusive node needs share 1 and devices running nothing else."""

    node: str
    devices: tuple[int, ...]
    share: float = 1.0


@dataclass(frozen=True, slots=True)
class SwitchRole:
    """Put away the device's engine and bring up `role`'s (sleep / wake / offload). The device must be
    idle; it is busy for `cost_s` and then holds `resident_gb` of engine memory."""

    device: int
    role: Role
    cost_s: float
    resident_gb: float


@dataclass(frozen=True, slots=True)
class StartStep:
    """Open a step: its nodes become ready as their dependencies finish, and its rollouts use weights
    `version` (step - version is their staleness; the executor refuses more than one)."""

    pipeline: str
    step: int
    version: int


@dataclass(frozen=True, slots=True)
class Migrate:
    """Move a running node's remaining work to `devices`, paying `cost_s` first (re-prefill of the KV
    cache for a decode node). The samples stay the same: nothing is generated twice."""

    node: str
    devices: tuple[int, ...]
    cost_s: float
    share: float = 1.0


Decision = Run | SwitchRole | StartStep | Migrate


class MemoryRefusal(ValueError):
    """No cut of a pipeline fits a device's memory: the one-line refusal of a memory check (a search's prune, the
    planner's check of every node beside its engine). The planner adds the scenario value that makes the plan fit
    (`plan.prepare.what_fits`): only it knows the pool and the device the policy was asked to cut for."""


# ---------------------------------------------------------------- what a policy may look at


class Tag(StrEnum):
    """What a run lets TAG (digen's trainer-assisted generation: idle trainer devices generate fragments) do."""

    AUTO = "auto"
    """Lend trainer devices where the predicted step shortens enough (`sched.digen.TAG_MIN_GAIN`)."""
    OFF = "off"
    FORCE = "force"
    """Lend one whenever a trainer idles while fragments wait, even where it does not pay: for the tests that TAG
    changes no number, and only under GAP's schedule (digen's search then considers no staged one)."""


Arrangement = Literal["auto", "shared", "split", "back_to_back"]
ARRANGEMENTS: tuple[str, ...] = get_args(Arrangement)
"""How jigsaw may arrange several pipelines on one pool: every pipeline on the whole pool at once (`shared`), each
on a sub-pool of its own (`split`), one after another on the whole pool (`back_to_back`), or whichever of them its
search predicts fastest (`auto`)."""


MAX_STALENESS = 4
"""The most versions jigsaw lets a step's rollouts lag (`PolicyOptions.staleness`): AReaL's default bound."""


@dataclass(frozen=True)
class PolicyOptions:
    """The run's own choices a policy honours beyond the scenario's fields."""

    tag: Tag | None = None
    """TAG fixed by the run; None: a searching policy chooses per shape (`DigenShape.tag`)."""
    arrangement: Arrangement = "auto"
    """How jigsaw arranges several pipelines on the pool (`ARRANGEMENTS`); auto: the fastest its search predicts."""
    staleness: int = 0
    """Versions jigsaw lets a step's rollouts lag its training: 0 keeps every step on-policy; above, a pipeline's next
    step opens on the latest published weights once its step's rollout has begun, if those are at most `staleness`
    versions behind it (1: streamrl's bound), so the next steps' rollouts fill the devices while a step trains."""

    @classmethod
    def of(cls, options: PolicyOptions | Mapping[str, object] | None) -> PolicyOptions:
        """The options of `options`, or of the mapping a run config's `policy_options()` and earlier callers give:
        {"tag": True (auto) | False (off) | "force", "arrangement": one of `ARRANGEMENTS`}, each key optional."""
        if options is None:
            return cls()
        if isinstance(options, PolicyOptions):
            return options
        unknown = sorted(set(options) - {"tag", "arrangement", "staleness"})
        if unknown:
            raise ValueError(f"policy option {unknown[0]!r}: not an option; known: tag, arrangement, staleness")
        arrangement = options.get("arrangement", "auto")
        if arrangement not in ARRANGEMENTS:
            raise ValueError(f"arrangement {arrangement!r}: use one of {', '.join(ARRANGEMENTS)}")
        staleness = options.get("staleness", 0)
        if not isinstance(staleness, int) or isinstance(staleness, bool) or not 0 <= staleness <= MAX_STALENESS:
            raise ValueError(
                f"staleness {staleness!r}: use 0 (on-policy) to {MAX_STALENESS} (a step's rollouts that many versions "
                "behind at most)"
            )
        given, tag = options.get("tag"), None
        if isinstance(given, bool):
            tag = Tag.AUTO if given else Tag.OFF
        elif isinstance(given, str):
            tag = Tag(given)
        elif "tag" in options:
            raise ValueError(f"{given!r} is not a valid Tag")  # the enum's own refusal, for a value of another type
        return cls(tag=tag, arrangement=cast(Arrangement, arrangement), staleness=cast(int, staleness))


@dataclass(frozen=True)
class Setup:
    """What a policy knows before the run: the cluster, each pipeline's engines, and the user's choices."""

    devices: int
    memory_gb: float
    engines: Mapping[str, Engines]
    trainer_devices: int | None = None
    """Size of the trainer pool for disaggregated policies; None lets the policy choose."""
    reward_devices: int = 0
    """Devices kept for reward engines (the last ones): they score every sample and nothing else. 0: reward
    engines are co-resident on the devices that generate (policies with `supports_reward_pool` take a pool)."""
    trainer_groups: Mapping[str, int] = field(default_factory=dict)
    """Trainer group size each pipeline's step was cut for (pipeline -> devices)."""
    options: PolicyOptions = PolicyOptions()
    priorities: Mapping[str, float] = field(default_factory=dict)
    """Weight of each pipeline's step latency when pipelines compete for devices (1 when absent)."""
    shapes: Mapping[str, Shape] = field(default_factory=dict)
    """The shape each pipeline's steps were cut with (pipeline -> e.g. `graph.lm.LMShape`)."""
    max_staleness: int = 1
    """Versions a step's rollouts may lag its training (the executor refuses more); AReaL's bound eta."""
    node_size: int | None = None
    """Devices per machine (the cluster's device type's `node_size`); None: one machine holds them all. A policy
    that cuts FSDP groups places each group no larger than a node inside one (digen's `trainer_layout`)."""
    slowdown: Callable[[str, str], float] = DEFAULT.slowdown
    """How much a node of one kind slows down beside another kind on its devices: slowdown(kind, alongside)
    (`Calibration.slowdown`). One table for the pool: `plan.prepare.prepare` takes the first pipeline's cost model's
    (a multiplexed run measures its table once, on its own devices, and gives it to every pipeline)."""

    @property
    def compute_devices(self) -> int:
        """Devices left to the rollout and trainer engines."""
        return self.devices - self.reward_devices

    @property
    def reward_pool(self) -> tuple[int, ...]:
        return tuple(range(self.compute_devices, self.devices))

    def switch(self, device: int, pipeline: str, old: Role | None, new: Role) -> SwitchRole:
        """The decision that moves a device from `old` to `new` for `pipeline`, with its cost."""
        engines = self.engines[pipeline]
        sleep = engines.sleep_s.get(old, 0.0) if old is not None else 0.0
        return SwitchRole(device, new, sleep + engines.wake_s.get(new, 0.0), engines.resident_gb.get(new, 0.0))


class DeviceView(Protocol):
    """One device as a policy sees it (read-only; `plan.state.DeviceState`)."""

    @property
    def index(self) -> int: ...

    @property
    def role(self) -> Role | None: ...

    @property
    def running(self) -> Mapping[str, float]:
        """Node id -> share of the device it holds."""
        ...

    @property
    def memory_gb(self) -> float: ...

    @property
    def capacity_gb(self) -> float: ...

    @property
    def switching(self) -> bool: ...

    @property
    def idle(self) -> bool: ...

    @property
    def free_share(self) -> float: ...


class RunningView(Protocol):
    """A running node as a policy sees it (`plan.state.Running`)."""

    @property
    def devices(self) -> tuple[int, ...]: ...


class View(Protocol):
    """The read-only state a policy decides from. Executors implement it (see `plan.state.ClusterState`); its
    members are read-only properties here, so an executor's own (mutable, concrete) attributes conform."""

    @property
    def now(self) -> float: ...

    @property
    def graph(self) -> Graph: ...

    @property
    def devices(self) -> Sequence[DeviceView]: ...

    @property
    def ready(self) -> Mapping[str, None]:
        """Ready, not yet started node ids, in the order they became ready."""
        ...

    @property
    def ready_by_kind(self) -> Mapping[Kind, Mapping[str, None]]:
        """`ready` split by node kind (every kind a key), each in the order its nodes became ready."""
        ...

    @property
    def running(self) -> Mapping[str, RunningView]:
        """Running node ids, each with where it runs."""
        ...

    @property
    def finished(self) -> Set[str]: ...

    @property
    def published(self) -> Mapping[str, int]:
        """Latest weights version the rollout engines of each pipeline can use."""
        ...

    @property
    def started(self) -> Mapping[tuple[str, int], int]:
        """(pipeline, step) -> the weights version its rollouts use, for every started step."""
        ...


def can_run(node: Node, role: Role | None) -> bool:
    """Reward engines are small and co-resident everywhere; other nodes need their own role's engine, which
    a device holding role ANY (every engine resident, for multiplexing) has."""
    return node.role in (Role.ANY, Role.REWARD) or role in (node.role, Role.ANY)


class CostTracker:
    """Predicted seconds of a node, corrected online: the measured/predicted ratio per (pipeline, kind),
    as an exponential moving average. The simulator and the Ray runtime feed it the same events."""

    def __init__(self, smoothing: float = DEFAULT.correction_rate) -> None:
        self.smoothing = smoothing
        self.ratio: dict[tuple[str, Kind], float] = {}

    def observe(self, node: Node, devices: int, seconds: float) -> None:
        predicted = node.seconds_on(devices)
        if predicted <= 0:
            return
        key = (node.pipeline, node.kind)
        old = self.ratio.get(key, 1.0)
        self.ratio[key] = (1 - self.smoothing) * old + self.smoothing * seconds / predicted

    def seconds(self, node: Node, devices: int = 1) -> float:
        """`Node.seconds_on` times the measured correction: work spreads over at most the node's `max_width`
        devices, so a decode's prediction never falls below its engine's tensor-parallel time."""
        return node.seconds_on(devices) * self.ratio.get((node.pipeline, node.kind), 1.0)


Forecast = Callable[[dict[str, Shape], int], float]
"""Shapes (pipeline -> shape) and a horizon in steps -> the samples/s the simulator predicts for them."""

ForecastBeating = Callable[[dict[str, Shape], int, float], float]
"""A `Forecast` also given a samples/s to beat: it gives up on a candidate once the simulated run provably cannot
beat that figure and then returns the figure itself, an upper bound of the candidate's samples/s. A search that only
keeps its best (`best_by_forecast`) simulates no loser to its end that way."""

SEARCH_STEPS = 6
"""Longest horizon a search simulates a candidate over: a run of at most this many steps is ranked on exactly the
run the executor will carry out (so the chosen shape is never slower than a candidate it could have taken); a
longer one on its first `SEARCH_STEPS` (TCSS overlaps two steps; three reach the steady state)."""


def search_horizon(steps: int) -> int:
    return min(steps, SEARCH_STEPS)


@dataclass(frozen=True)
class SearchContext:
    """What a policy's search (`Policy.plan_shapes`) works from: the pipelines, the shape each got from the policy's
    own `shape` (cut for `devices`, trainer pool `trainer_devices`), their cost models, the simulator's `forecast`, the
    run's steps and options."""

    specs: Sequence[PipelineSpec]
    shapes: Mapping[str, Shape]
    costs: Mapping[str, CostModel]
    forecast: Forecast
    steps: int = 1
    devices: int | None = None
    """Devices each pipeline's steps are cut for (None: the policy's shapes say)."""
    trainer_devices: int | None = None
    """The scenario's trainer pool; None lets the policy choose."""
    options: PolicyOptions = PolicyOptions()
    forecast_beating: ForecastBeating | None = None
    """The `forecast` that gives up on a candidate that cannot beat a figure; None where every candidate's figures
    are kept whole (`dovetail plan` shows each)."""

    @property
    def horizon(self) -> int:
        """Steps a candidate is simulated over: the run's, at most `SEARCH_STEPS`."""
        return search_horizon(self.steps)


def best_by_forecast(
    candidates: Sequence[dict[str, Shape]],
    forecast: Forecast,
    horizon: int,
    beating: ForecastBeating | None = None,
) -> dict[str, Shape]:
    """The candidate the simulator predicts the most samples/s for over `horizon` steps; ties: the earlier one (a
    search lists its candidates best first by its own cost model). Each candidate is simulated once; with `beating`
    (`SearchContext.forecast_beating`), each after the first only until it provably cannot beat the best so far: what
    it returns then is at most that best, so it is not chosen, as it would not have been simulated to its end."""
    best, best_rate = candidates[0], forecast(candidates[0], horizon)
    for candidate in candidates[1:]:
        rate = forecast(candidate, horizon) if beating is None else beating(candidate, horizon, best_rate)
        if rate > best_rate:
            best, best_rate = candidate, rate
    return best


class Policy(ABC):
    """Base of every policy: the whole contract an executor and the planner rely on.

    A subclass sets `name`, says how it cuts a pipeline's step (`shape`) and decides (`decide`). The class
    attributes below describe it to the planner (`plan.prepare.prepare`), which reads nothing else."""

    name: ClassVar[str]
    pipeline_kinds: ClassVar[frozenset[str]]
    """Kinds of pipeline (`dovetail.kinds`: `flow`, `lm`) the policy can schedule."""
    multiplexes: ClassVar[bool] = False
    """Fits several pipelines' sub-stages together on one pool: a `kind: multiplex` run takes it (it runs one
    pipeline alone too)."""
    supports_reward_pool: ClassVar[bool] = False
    """Whether it can give the reward engines their own devices (`Setup.reward_devices`)."""
    splits_pool: ClassVar[bool] = False
    """Each pipeline gets its own even slice of the pool (verl-sync, streamrl, areal), and its steps are cut for
    that slice; otherwise every pipeline's steps are cut for the whole pool (less the reward devices)."""
    max_staleness: ClassVar[int] = 1
    """Versions a step's rollouts may lag its training (the executor refuses more)."""
    assists_generation: ClassVar[bool] = False
    """Lends idle trainer devices to the rollout (trainer-assisted generation, digen's TAG): its choices are kept in
    `tag_decisions`, which a run's metrics report."""
    searches: ClassVar[bool] = False
    """Chooses its shapes by simulating candidates (`plan_shapes`); `dovetail plan` shows what it considered."""
    fixes: ClassVar[Mapping[str, str]] = {}
    """Scenario fields (of a pipeline or the schedule) this policy's schedule decides itself, with why: a scenario
    that sets one is refused by name (`plan.prepare.prepare`) instead of planned as something else."""

    @classmethod
    @abstractmethod
    def shape(cls, spec: PipelineSpec, devices: int, trainer_devices: int | None, cost: CostModel) -> Shape:
        """How this policy cuts `spec`'s steps on `devices` (trainer pool `trainer_devices`, None: its choice)."""

    @classmethod
    def plan_shapes(cls, context: SearchContext) -> dict[str, Shape]:
        """The shapes to run the context's steps with: a policy that searches (digen, jigsaw) ranks its candidates
        here by rolling the simulator forward with the context's `forecast`; the others keep the shapes given."""
        return dict(context.shapes)

    @classmethod
    def simulates_as(cls, shapes: Mapping[str, Shape]) -> str:
        """The policy whose schedule this one runs on `shapes`: itself, or one it runs exactly as (digen+tcss on a
        shape without TCSS runs digen's), so a plan that weighs both simulates such a candidate once
        (`plan.prepare.prepare`'s `simulations`)."""
        return cls.name

    @classmethod
    def with_reward_pool(cls, specs: Sequence[PipelineSpec], shapes: dict[str, Shape]) -> dict[str, Shape]:
        """The shapes to run with reward devices of their own (`Setup.reward_devices` > 0): a policy whose rollout
        would otherwise finish all at once cuts it finer, so the reward pool scores early pieces while later ones
        generate; the others keep them."""
        return shapes

    def __init__(self, setup: Setup) -> None:
        if setup.reward_devices and not self.supports_reward_pool:
            raise ValueError(
                f"policy {self.name} co-locates reward engines; reward_devices={setup.reward_devices} "
                "needs a flow policy"
            )
        if not 0 <= setup.reward_devices < setup.devices:
            raise ValueError(
                f"reward_devices={setup.reward_devices} must leave 1..{setup.devices} devices for rollout and training"
            )
        self.setup = setup
        self.costs = CostTracker()
        self.tag_decisions: list[tuple[float, int]] = []
        """(time, fragments) of each trainer-assisted generation the policy chose (`assists_generation`)."""

    def react(self, view: View, events: Sequence[Event]) -> list[Decision]:
        """What executors call: learn from the events, then decide."""
        self.observe(view, events)
        return self.decide(view, events)

    def observe(self, view: View, events: Sequence[Event]) -> None:
        """Feed measured durations to the cost tracker; subclasses extend this to keep their own state."""
        for event in events:
            if isinstance(event, NodeFinished):
                self.costs.observe(view.graph[event.node], len(event.devices), event.seconds)

    @abstractmethod
    def decide(self, view: View, events: Sequence[Event]) -> list[Decision]:
        """Everything that happened since the last call (in order) -> what to do now. Called again at the
        same time after the decisions are applied, with the events they caused, until nothing changes."""


# ---------------------------------------------------------------- small helpers shared by policies


def idle_devices(view: View, devices: Sequence[int], role: Role | None = None) -> list[int]:
    """Devices among `devices` that run nothing, are not switching and (if given) hold `role`."""
    states = view.devices
    if role is None:
        return [d for d in devices if states[d].idle]
    return [d for d in devices if states[d].idle and states[d].role == role]


def all_idle(view: View, devices: Sequence[int]) -> bool:
    states = view.devices
    return all(states[d].idle for d in devices)


def ready_of(view: View, kind: Kind, pipeline: str | None = None) -> list[Node]:
    """Ready nodes of one kind, in the order they became ready."""
    ready = view.ready_by_kind[kind]
    if not ready:  # most asks, most of the time
        return []
    nodes = map(view.graph.nodes.__getitem__, ready)
    return list(nodes) if pipeline is None else [node for node in nodes if node.pipeline == pipeline]


def score_on_reward_pool(view: View, setup: Setup, pipeline: str) -> list[Decision]:
    """Idle reward devices take the ready score nodes, oldest first."""
    scores = ready_of(view, Kind.SCORE, pipeline)
    return [Run(node.id, (device,)) for node, device in zip(scores, idle_devices(view, setup.reward_pool, Role.REWARD))]


def reward_roles(setup: Setup, pipeline: str) -> list[Decision]:
    """At Begin: bring up the reward engine on every reward device."""
    return [setup.switch(device, pipeline, None, Role.REWARD) for device in setup.reward_pool]


def open_steps_on_publish(view: View, events: Sequence[Event]) -> list[StartStep]:
    """The synchronous rule: once weights `v` are published, start step v on them (staleness 0)."""
    decisions: list[StartStep] = []
    for event in events:
        if isinstance(event, VersionPublished) and (event.pipeline, event.version) not in view.started:
            if event.version in view.graph.steps(event.pipeline):
                decisions.append(StartStep(event.pipeline, event.version, event.version))
    return decisions
