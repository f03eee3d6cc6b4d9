"""Expand GRPO steps of a language model into sub-stage nodes.

One step of pipeline P on S rollout engines (shards of whole prompt groups):

    prefill[shard] -> decode[shard, band 0] -> decode[shard, band 1] -> ... -> score[shard]
    score[shard] -> logprob old[shard], logprob ref[shard] -> train[shard] -> commit -> publish

A decode band holds the shard's sequences still running at the band's lower edge and generates
their tokens up to its upper edge, so long tails show up as small, late nodes (JigsawRL's
"imbalance inside a stage"). With `migrate_at`, every sequence still running at that length leaves
its shard: one `migrate` node re-prefills all of them on the destination and one `decode` node
finishes them there together, so the other engines are freed.

Step s trains weights version s; its log-prob and train nodes wait for step s-1's commit.
Micro-batches hold whole prompt groups: by prompt index, or with `stream` by when the group finishes
(shortest longest-response first), so the first micro-batches can be trained while the tail decodes.
With `shared`, every node may share its devices with other shareable nodes (pipeline multiplexing).
Decode costs are per engine: a node's `cost_s` is its seconds on one engine times the engine's
devices, so it runs for its predicted time on `tensor_parallel` devices.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from dovetail.cost.catalog import LanguageModel
from dovetail.cost.model import CostModel, lora_params
from dovetail.graph.node import Engines, Kind, Node, Role, SampleId
from dovetail.graph.shape import Shape
from dovetail.graph.spec import LMSpec, PipelineSpec

GB = 1e9


@dataclass(frozen=True)
class Sample:
    id: SampleId
    shard: int
    prompt_tokens: int
    response_tokens: int
    turns: int = 1
    """Model turns of a multi-turn trajectory (`LMSpec.turns`), at most one per token of it."""


def response_lengths(spec: LMSpec, step: int, seed: int) -> list[int]:
    """Seeded lengths of one step's responses, cut at max_length (same seed, same lengths): drawn once per step,
    seed and what the draws depend on (`_lengths`), as a search cuts the same step on many shard counts."""
    count = spec.batch * spec.draws * spec.group
    key = (seed, spec.name, step, count, spec.max_length, repr(spec.lengths))
    if key not in _lengths:
        if len(_lengths) >= ROLLOUTS_KEPT:
            _lengths.clear()
        _lengths[key] = _drawn_lengths(spec, step, seed, count)
    return list(_lengths[key])


_lengths: dict[tuple, tuple[int, ...]] = {}
"""Each step's drawn response lengths (`response_lengths`), by seed, pipeline, step, count, cap and distribution."""


def _drawn_lengths(spec: LMSpec, step: int, seed: int, count: int) -> tuple[int, ...]:
    rng = random.Random(f"{seed}/{spec.name}/{step}")
    dist = spec.lengths
    if dist.kind == "lognormal":
        median, sigma = dist.median, dist.sigma
        assert median is not None and sigma is not None  # LengthDistribution's validator requires both
        raw = [rng.lognormvariate(math.log(median), sigma) for _ in range(count)]
    else:
        values = dist.values
        assert values  # LengthDistribution's validator requires them
        raw = [rng.choice(values) for _ in range(count)]
    return tuple(min(spec.max_length, max(1, round(x))) for x in raw)


def turn_counts(spec: LMSpec, step: int, seed: int) -> list[int]:
    """Seeded model turns of one step's trajectories, its further draws' too (same seed, same counts): 1 each
    without `spec.turns`."""
    count = spec.batch * spec.draws * spec.group
    if spec.turns is None:
        return [1] * count
    rng = random.Random(f"{seed}/{spec.name}/{step}/turns")
    return [rng.choice(spec.turns.counts) for _ in range(count)]


def step_samples(spec: LMSpec, step: int, shards: int, seed: int) -> list[Sample]:
    """Whole prompt groups dealt round-robin to `shards` rollout engines: the step's `batch` prompts, and those of
    its further draws after them (`spec.draws`: draw d's at positions d·batch to d·batch + batch - 1)."""
    lengths = iter(response_lengths(spec, step, seed))
    turns = iter(turn_counts(spec, step, seed))
    samples = []
    for prompt in range(spec.batch * spec.draws):
        for index in range(spec.group):
            length = next(lengths)
            samples.append(
                Sample(
                    SampleId(step, prompt, index), prompt % shards, spec.prompt_length, length, min(next(turns), length)
                )
            )
    return samples


def turn_tokens(sample: Sample, turn: int) -> int:
    """The model's tokens in turn `turn` of a trajectory: its length shared out evenly among its turns."""
    base, extra = divmod(sample.response_tokens, sample.turns)
    return base + (turn < extra)


def env_wait_s(spec: LMSpec, sample: Sample, turn: int, seed: int) -> float:
    """Seconds `sample` waits on its environment after its turn `turn`, drawn from the run's seed and who waits (as
    `envs.episode` keys a step's wait): the same in every graph of the same seed."""
    assert spec.turns is not None, "only a multi-turn spec with turns waits"
    return spec.turns.latency.draw(seed, spec.name, *sample.id, turn)


def _bands(spec: LMSpec, migrate_at: int | None) -> list[tuple[int, int]]:
    if spec.multi_turn:
        return [(0, spec.max_length)]
    edges = sorted({*spec.length_bands, spec.max_length} | ({migrate_at} if migrate_at else set()))
    return list(zip([0, *edges[:-1]], edges))


@dataclass(frozen=True)
class LMShape(Shape):
    """How a policy cuts an LM step: `shards` rollout engines (of `spec.tensor_parallel` devices
    each) the batch is dealt to, the trainer group size (sets collective costs), and `migrate_at`
    (tokens) where the long tail leaves its shard, None to keep every sequence home. `stream` orders
    micro-batches by finishing time, `shared` makes the nodes shareable, and `rollout_memory` is the
    fraction of a device the rollout engine may use (weights + KV cache; None: the calibrated default)."""

    shards: int
    trainer_devices: int
    migrate_at: int | None = None
    stream: bool = False
    shared: bool = False
    rollout_memory: float | None = None
    tail_parallel: int | None = None
    """Devices of the engine the migrated tail decodes on (tensor parallel); None: `spec.tensor_parallel`."""

    def check(self, spec: LMSpec) -> None:
        if not 0 < self.shards <= spec.batch:
            raise ValueError(
                f"{spec.name}: shards={self.shards} must be in 1..batch={spec.batch} (a shard holds whole groups)"
            )
        if self.trainer_devices < 1:
            raise ValueError(f"{spec.name}: trainer_devices must be >= 1")
        if self.migrate_at is not None and not 0 < self.migrate_at < spec.max_length:
            raise ValueError(
                f"{spec.name}: migrate_at={self.migrate_at} must be in 1..max_length-1={spec.max_length - 1}"
            )
        if spec.batch % spec.micro_batches:
            raise ValueError(f"{spec.name}: micro_batches={spec.micro_batches} must divide batch={spec.batch}")
        if self.tail_parallel is not None and self.tail_parallel < 1:
            raise ValueError(f"{spec.name}: tail_parallel={self.tail_parallel} must be >= 1")
        if self.rollout_memory is not None and not 0 < self.rollout_memory <= 1:
            raise ValueError(
                f"{spec.name}: rollout_memory={self.rollout_memory} must be a fraction of device memory in (0, 1]"
            )

    def cost_model(self, cost: CostModel) -> CostModel:
        return cost if self.rollout_memory is None else cost.with_rollout_memory(self.rollout_memory)

    # `build` and `engines` take any pipeline's spec, as `graph.shape.Shape` declares (a planner holds a shape and
    # its spec as a pair the checker cannot see): an LM shape refuses another kind's spec.
    def build(self, spec: PipelineSpec, steps: int, cost: CostModel, seed: int = 0) -> list[Node]:
        return build_lm(_lm_spec(spec), steps, self, cost, seed)

    def engines(self, spec: PipelineSpec, cost: CostModel) -> Engines:
        return engines(_lm_spec(spec), cost, self)

    def describe(self) -> str:
        text = f"trainer_devices={self.trainer_devices}, {self.shards} rollout engines"
        if self.migrate_at is not None:
            text += f", tail past {self.migrate_at} tokens on {self.tail_parallel} devices"
        return text

    @property
    def rollout_engines(self) -> int:
        return self.shards

    @property
    def rollout_kind(self) -> Kind:
        """Prefill is short beside the decode bands."""
        return Kind.DECODE

    @property
    def tails_migrate(self) -> bool:
        """Responses end at their own lengths: the few long ones run on after the rest finished."""
        return True

    @property
    def sizes_rollout_memory(self) -> bool:
        """The KV cache takes what `rollout_memory` leaves beside the weights."""
        return True


def _lm_spec(spec: PipelineSpec) -> LMSpec:
    if not isinstance(spec, LMSpec):
        raise TypeError(f"{spec.name}: an LM shape cuts a language model's steps, not a {type(spec).__name__}'s")
    return spec


STAGE_OF_KIND = {
    kind: "rollout" if kind in (Kind.PREFILL, Kind.DECODE, Kind.MIGRATE, Kind.ENV) else kind.value for kind in Kind
}
"""Node kind -> verl stage (a log-prob node's is `ref` or `old`, by the node; an environment's wait is the rollout's):
looked up, as the staged policies ask it of every node of a step at every decision."""

ROLLOUT_STAGE_KINDS = frozenset(kind for kind, name in STAGE_OF_KIND.items() if name == "rollout")
"""The kinds whose nodes are in the rollout stage (`stage(node) == "rollout"` exactly: a log-prob or train node's
stage, decided by the node, is never the rollout): what a policy placing the rollout tests for each ready node."""


def stage(node: Node) -> str:
    """The verl stage a node belongs to: rollout, score, old, ref, values (the critic's pass), critic (its train),
    train, commit or publish."""
    if node.kind is Kind.LOGPROB:
        return "values" if node.critic else "ref" if node.reference else "old"
    if node.kind is Kind.TRAIN and node.critic:
        return "critic"
    return STAGE_OF_KIND[node.kind]


def engines(spec: LMSpec, cost: CostModel, shape: LMShape) -> Engines:
    """Per-device resident memory of the rollout engine (weights / TP + its KV-cache share) and the
    FSDP trainer (weights, grads, optimizer / trainer group), and their sleep / wake costs."""

    model = spec.catalogue_model()
    tp = spec.tensor_parallel
    cost = shape.cost_model(cost)
    rollout = cost.rollout_memory(model, 0, tp).weights + cost.kv_cache_bytes(model, tp) / tp
    if spec.replicated_trainer:  # dovetail's runtime replicas: each holds the whole trainer
        trainer = cost.replicated_training_memory(model.params, trainable_params(spec)).total
    else:
        trainer = cost.training_memory(
            model.params, model.layers, model.hidden, 0, shape.trainer_devices, trainable=trainable_params(spec)
        ).total
    if spec.critic:  # PPO's value model: the policy's size, with its own gradients and AdamW moments
        trainer *= 2
    resident = {Role.ROLLOUT: rollout / GB, Role.TRAINER: trainer / GB}
    switch = {Role.ROLLOUT: cost.switch(rollout), Role.TRAINER: cost.switch(trainer)}
    return Engines(resident_gb=resident, wake_s=switch, sleep_s=switch)


def trainable_params(spec: LMSpec) -> float | None:
    """Parameters the trainer trains: None for the whole model, the adapter's count under LoRA."""
    return lora_params(spec.catalogue_model(), spec.lora.rank, spec.lora.targets) if spec.lora else None


def build_lm(spec: LMSpec, steps: int, shape: LMShape, cost: CostModel, seed: int = 0) -> list[Node]:
    """All nodes of `steps` consecutive GRPO steps of one language-model pipeline.

    A multi-turn spec's shards decode in one band and never migrate, whatever the shape says: a trajectory's turns
    alternate with its environment's steps, which run in its engine's environment process (`envs.host`) and hold
    the episode's state there, so a trajectory is neither paused at a length (a band's edge falls inside a turn or
    a wait) nor moved to another engine midway; its shard rolls it out whole."""

    shape.check(spec)
    if spec.multi_turn:
        shape = replace(shape, migrate_at=None)
    model = spec.catalogue_model()
    cost = shape.cost_model(cost)
    nodes: list[Node] = []
    previous_commit: str | None = None
    # What the rollout's memo is keyed by: the shape less its trainer fields, and less `stream` where the lengths are
    # known (it only says which level a run learns a sample finished at, `_finishing_levels`), so a streaming and a
    # fixed-batch policy (streamrl, areal) on one cut price its decoding once.
    rollout_cut = replace(shape, trainer_devices=1, stream=shape.stream and not spec.lengths_known)
    for step in range(steps):
        if spec.draws == 1 and not spec.dynamic_sampling:
            samples, rollout, last_of = _step_rollout(spec, cost, rollout_cut, step, seed)
            training = _training(spec, model, cost, shape, step, samples, last_of, previous_commit)
            nodes += [*rollout, *training]
        else:  # a step of draws (dynamic sampling, one or more): built here, each draw's rollout after the score before
            drawn = step_samples(spec, step, shape.shards, seed)
            draws, scores = _draws(spec, model, cost, shape, step, drawn, seed)
            first = [s for s in drawn if s.id.prompt < spec.batch]  # what its training is priced for: B groups
            training = _training(spec, model, cost, shape, step, first, {}, previous_commit, scores)
            nodes += [*_shareable(draws, shape.shared), *training]
        previous_commit = training[-2].id
    return nodes


def _shareable(nodes: list[Node], shared: bool) -> list[Node]:
    """`nodes`, each made shareable (not exclusive) where the shape is `shared`."""
    return [replace(node, exclusive=False) for node in nodes] if shared else nodes


ROLLOUTS_KEPT = 512
"""Steps' rollouts `_step_rollout` keeps (the most recently asked for)."""
_rollouts: OrderedDict[tuple, tuple[tuple[Sample, ...], tuple[Node, ...], Mapping[SampleId, Any]]] = OrderedDict()


def _step_rollout(
    spec: LMSpec, cost: CostModel, shape: LMShape, step: int, seed: int
) -> tuple[tuple[Sample, ...], tuple[Node, ...], Mapping[SampleId, Any]]:
    """One step's samples, its rollout nodes and, per sample, where it finishes (`_rollout`): memoized, as they
    depend only on the rollout's part of the shape (`shape` comes with its trainer pool cleared, `cost` as the shape
    sizes the rollout's memory; the nodes are made shareable once here where the shape is `shared`), so the many
    cuts a search weighs that differ only in their trainer pool (`sched.lm_common.SplitLMPolicy.shape`, jigsaw's
    candidates) price a step's decoding once. The spec is keyed by its fields (it holds lists), the cost model by
    identity. Callers only read what it returns."""
    key = (spec.model_dump_json(), cost, shape, step, seed)
    if key in _rollouts:
        _rollouts.move_to_end(key)
        return _rollouts[key]
    samples = step_samples(spec, step, shape.shards, seed)
    rollout, last_of = _rollout(spec, spec.catalogue_model(), cost, shape, step, samples, seed)
    rollout = _shareable(rollout, shape.shared)
    made = _rollouts[key] = (tuple(samples), tuple(rollout), MappingProxyType(last_of))
    if len(_rollouts) > ROLLOUTS_KEPT:
        _rollouts.popitem(last=False)
    return made


def _id(spec: LMSpec, step: int, *parts: object) -> str:
    return "/".join([spec.name, str(step), *map(str, parts)])


def _decode(
    spec, model, cost, step, node_id, deps, members: list[Sample], low: int, high: int, tp: int, shard: int | None
) -> Node:
    new_tokens = [min(s.response_tokens, high) - low for s in members]
    seconds = cost.decode(model, [s.prompt_tokens + low for s in members], new_tokens, devices=tp)
    return Node(
        node_id,
        spec.name,
        step,
        Kind.DECODE,
        Role.ROLLOUT,
        deps,
        version=step,
        samples=tuple(s.id for s in members),
        band=(low, high),
        cost_s=seconds * tp,
        fixed_s=cost.fixed("decode"),
        tokens=sum(new_tokens),
        shard=shard,
        max_width=tp,
    )


def _draws(
    spec: LMSpec, model: LanguageModel, cost: CostModel, shape: LMShape, step: int, samples: list[Sample], seed: int
) -> tuple[list[Node], list[Node]]:
    """A step that draws more prompts (`spec.draws`, dynamic sampling): each draw's rollout and one score node of its
    samples, draw d's prefills after draw d - 1's score (whose rewards say whether it is needed); returns the nodes
    and the draws' score nodes, which the step's training reads."""
    nodes: list[Node] = []
    scores: list[Node] = []
    for draw in range(spec.draws):
        mine = [s for s in samples if s.id.prompt // spec.batch == draw]
        after = (scores[-1].id,) if scores else ()
        rollout, last_of = _rollout(spec, model, cost, shape, step, mine, seed, draw, after)
        score = Node(
            _id(spec, step, "score", f"draw{draw}"),
            spec.name,
            step,
            Kind.SCORE,
            Role.ANY,
            _finished_after(mine, last_of, spec.lengths_known),
            version=step,
            samples=tuple(s.id for s in mine),
            cost_s=cost.rule_score(len(mine)),
            fixed_s=cost.fixed("score"),
        )
        nodes += [*rollout, score]
        scores.append(score)
    return nodes, scores


def _rollout(
    spec: LMSpec,
    model: LanguageModel,
    cost: CostModel,
    shape: LMShape,
    step: int,
    samples: list[Sample],
    seed: int,
    draw: int = 0,
    after: tuple[str, ...] = (),
):
    """Prefill and decode bands per shard, plus the migrated tail (a multi-turn spec with turns: its turns and
    environment waits, `_turns`); returns the nodes and, per sample, the decode node that finishes it. A further
    draw's (`draw` > 0: its ids say which) prefills follow `after`."""
    tag = () if draw == 0 else (f"draw{draw}",)
    tp = spec.tensor_parallel
    migrate_at = shape.migrate_at
    home_bands = [b for b in _bands(spec, migrate_at) if migrate_at is None or b[1] <= migrate_at]
    nodes: list[Node] = []
    last_of: dict[SampleId, str] = {}
    tail_deps: list[str] = []
    by_shard: dict[int, list[Sample]] = {shard: [] for shard in range(shape.shards)}
    for sample in samples:  # each shard's samples in their order, dealt in one pass (not one pass per shard)
        by_shard[sample.shard].append(sample)
    for shard, mine in by_shard.items():
        prefill = Node(
            _id(spec, step, *tag, "prefill", shard),
            spec.name,
            step,
            Kind.PREFILL,
            Role.ROLLOUT,
            after,
            version=step,
            samples=tuple(s.id for s in mine),
            cost_s=cost.prefill(model, [s.prompt_tokens for s in mine], devices=tp) * tp,
            fixed_s=cost.fixed("prefill"),
            shard=shard,
            max_width=tp,
        )
        nodes.append(prefill)
        previous = prefill.id
        if spec.turns is not None:
            turns = _turns(spec, model, cost, step, shard, mine, prefill.id, seed)
            nodes += turns
            last_of.update((s.id, turns[-1].id) for s in mine)
            tail_deps.append(turns[-1].id)
            continue
        for low, high in home_bands:
            members = [s for s in mine if s.response_tokens > low]
            if not members and spec.lengths_known:
                break
            node = _decode(
                spec,
                model,
                cost,
                step,
                _id(spec, step, *tag, "decode", shard, low),
                (previous,),
                members,
                low,
                high,
                tp,
                shard,
            )
            nodes.append(node)
            last_of.update((s.id, node.id) for s in (members if spec.lengths_known else mine))
            previous = node.id
        tail_deps.append(previous)
    tail = [s for s in samples if migrate_at is not None and s.response_tokens > migrate_at]
    # A run learns which responses outlive the migration edge only by decoding: its tail nodes are always there
    # (costed by the drawn lengths), and carry whatever is still running, if anything.
    if migrate_at is not None and (tail or not spec.lengths_known):  # a tail exists only with migrate_at
        tp = shape.tail_parallel or tp
        migrate = Node(
            _id(spec, step, *tag, "migrate"),
            spec.name,
            step,
            Kind.MIGRATE,
            Role.ROLLOUT,
            tuple(tail_deps),
            version=step,
            samples=tuple(s.id for s in tail),
            cost_s=cost.migrate(model, [s.prompt_tokens + migrate_at for s in tail], devices=tp) * tp,
            fixed_s=cost.fixed("migrate"),
            max_width=tp,
        )
        decode = _decode(
            spec,
            model,
            cost,
            step,
            _id(spec, step, *tag, "decode", "tail"),
            (migrate.id,),
            tail,
            migrate_at,
            spec.max_length,
            tp,
            None,
        )
        nodes += [migrate, decode]
        last_of.update((s.id, decode.id) for s in tail)
    if not spec.lengths_known and spec.turns is not None:  # a run learns where each trajectory ends by decoding
        return nodes, {s.id: (0, tuple(tail_deps)) for s in samples}
    if not spec.lengths_known:
        return nodes, _finishing_levels(samples, nodes, shape)
    return nodes, last_of


def _turns(
    spec: LMSpec,
    model: LanguageModel,
    cost: CostModel,
    step: int,
    shard: int,
    mine: list[Sample],
    prefill: str,
    seed: int,
) -> list[Node]:
    """A shard's multi-turn rollout after its prefill: per turn t, a decode node of the trajectories still going at t
    (each its turn's tokens after what it holds so far; from the second turn each re-prefilled, as our engine does),
    then, where some go on, an env node of their wait (the longest of theirs: the turn's next round starts when the
    last of them is answered; exact for a constant latency, where they all wait alike). A run learns its turns by
    decoding (`TurnsSpec.max_turns`): its chain covers them all, a turn past the forecast ones decoding nothing after
    an env node that waits none, at no cost. The decode's fixed cost (what a profile of the runtime's whole-rollout
    decode measures once per call: its rounds' overheads, the environment's steps among them) is shared out among
    a shard's forecast turns, so its turn nodes pay it once, as its one held node does.
    With `waits_hold_device`, one decode node that holds its engine through every turn and wait
    (`_held_rollout`): the Ray runtime's rollout, one call that sleeps only while every trajectory waits."""
    assert spec.turns is not None, "only a multi-turn spec with turns is cut into turns"
    tp = spec.tensor_parallel
    if spec.turns.waits_hold_device:
        return [_held_rollout(spec, model, cost, step, shard, mine, prefill, seed)]
    nodes: list[Node] = []
    previous = prefill
    held_so_far = {s.id: s.prompt_tokens for s in mine}
    forecast = max(s.turns for s in mine)
    covered = max(forecast, spec.turns.max_turns or 0)
    for turn in range(covered):
        members = [s for s in mine if s.turns > turn]
        context = [held_so_far[s.id] for s in members]
        new_tokens = [turn_tokens(s, turn) for s in members]
        seconds = cost.decode(model, context, new_tokens, devices=tp) if members else 0.0
        if turn and members:
            seconds += cost.reprefill(model, context, devices=tp)
        going_on = [s for s in members if s.turns > turn + 1]
        for s, generated in zip(members, new_tokens):
            held_so_far[s.id] += generated + spec.turns.observation_tokens
        wait = max((env_wait_s(spec, s, turn, seed) for s in going_on), default=0.0)
        decode = Node(
            _id(spec, step, "decode", shard, 0) if turn == 0 else _id(spec, step, "turn", shard, turn),
            spec.name,
            step,
            Kind.DECODE,
            Role.ROLLOUT,
            (previous,),
            version=step,
            samples=tuple(s.id for s in members),
            band=(0, spec.max_length),
            cost_s=seconds * tp,
            fixed_s=cost.fixed("decode") / forecast if members else 0.0,
            tokens=sum(new_tokens),
            shard=shard,
            max_width=tp,
        )
        nodes.append(decode)
        previous = decode.id
        if going_on or turn + 1 < covered:
            env = Node(
                _id(spec, step, "env", shard, turn),
                spec.name,
                step,
                Kind.ENV,
                Role.ANY,
                (decode.id,),
                version=step,
                samples=tuple(s.id for s in going_on),
                wait_s=wait,
                shard=shard,
            )
            nodes.append(env)
            previous = env.id
    return nodes


def _held_rollout(
    spec: LMSpec,
    model: LanguageModel,
    cost: CostModel,
    step: int,
    shard: int,
    mine: list[Sample],
    prefill: str,
    seed: int,
) -> Node:
    """A shard's multi-turn rollout as the Ray runtime's one decode call rolls it out (`pipelines.lm.multiturn.
    run_episodes`), which holds its engine throughout: in rounds, each decoding as one batch every trajectory whose
    wait has ended (its next turn's tokens after what it holds; from its second turn re-prefilled), each of them
    then waiting its own draw; the engine sleeps only while every unfinished trajectory waits. So a trajectory
    whose wait ends first decodes its next turn during the others' waits: the node's `cost_s` is its rounds'
    seconds, its `wait_s` only what the engine slept, their sum the rollout's span (not each turn's decode plus its
    longest wait)."""
    assert spec.turns is not None, "only a multi-turn spec with turns waits"
    tp = spec.tensor_parallel
    held_so_far = {s.id: s.prompt_tokens for s in mine}
    turns_done = {s.id: 0 for s in mine}
    ready_at = {s.id: 0.0 for s in mine}
    going = list(mine)
    clock = busy = slept = 0.0
    while going:
        ready = [s for s in going if ready_at[s.id] <= clock]
        if not ready:
            woken = min(ready_at[s.id] for s in going)
            slept += woken - clock
            clock = woken
            continue
        context = [held_so_far[s.id] for s in ready]
        new_tokens = [turn_tokens(s, turns_done[s.id]) for s in ready]
        seconds = cost.decode(model, context, new_tokens, devices=tp)
        again = [held for s, held in zip(ready, context) if turns_done[s.id]]
        if again:
            seconds += cost.reprefill(model, again, devices=tp)
        clock += seconds
        busy += seconds
        for s, generated in zip(ready, new_tokens):
            held_so_far[s.id] += generated + spec.turns.observation_tokens
            turns_done[s.id] += 1
            if turns_done[s.id] < s.turns:
                ready_at[s.id] = clock + env_wait_s(spec, s, turns_done[s.id] - 1, seed)
        going = [s for s in going if turns_done[s.id] < s.turns]
    return Node(
        _id(spec, step, "decode", shard, 0),
        spec.name,
        step,
        Kind.DECODE,
        Role.ROLLOUT,
        (prefill,),
        version=step,
        samples=tuple(s.id for s in mine),
        band=(0, spec.max_length),
        cost_s=busy * tp,
        fixed_s=cost.fixed("decode"),
        wait_s=slept,
        tokens=sum(s.response_tokens for s in mine),
        shard=shard,
        max_width=tp,
    )


def _finishing_levels(samples: list[Sample], rollout: list[Node], shape: LMShape) -> dict[SampleId, tuple]:
    """Where a run learns that a sample finished, when lengths are learnt by decoding: at the end of its band on
    every shard (the engine that holds it is known only at run time), or of the migrated tail. Per sample, the
    level (band edge, or past every edge for the tail) and the nodes after which its drawn length says it is done.
    Only streamed micro-batches wait for the predicted level: the runtime fills them with whichever whole groups
    have finished by then (`pipelines.lm.adapter`), the last level taking the rest; fixed micro-batches wait for the
    end."""
    migrate_at = shape.migrate_at
    bands: dict[int, list[str]] = {}
    tail: tuple[str, ...] = ()
    for node in rollout:
        if node.kind == Kind.DECODE and node.shard is not None:
            assert node.band is not None  # _decode gives every decode node its band
            bands.setdefault(node.band[1], []).append(node.id)
        elif node.kind == Kind.DECODE:
            tail = (node.id,)
    edges = sorted(bands)
    level: dict[SampleId, tuple] = {}
    final = (len(edges), tail) if tail else (len(edges) - 1, tuple(bands[edges[-1]]))
    for s in samples:
        if not shape.stream:
            level[s.id] = final  # a micro-batch of fixed members waits for all of them, however long they run
        elif migrate_at is not None and s.response_tokens > migrate_at:
            level[s.id] = final
        else:
            edge = next((e for e in edges if s.response_tokens <= e), edges[-1])
            level[s.id] = (edges.index(edge), tuple(bands[edge]))
    return level


def _finished_after(members: list[Sample], last_of: Mapping, lengths_known: bool) -> tuple[str, ...]:
    """The decode nodes after which every member has finished: their shards' last bands; with lengths learnt at
    run time, the latest finishing level among them."""
    if lengths_known:
        return tuple(sorted({last_of[s.id] for s in members}))
    return max(last_of[s.id] for s in members)[1]


def _prompt_order(samples: Sequence[Sample]) -> list[int]:
    """Prompts by the length of their group's longest response (ties by index): the order groups finish."""
    longest: dict[int, int] = {}
    for s in samples:
        longest[s.id[1]] = max(longest.get(s.id[1], 0), s.response_tokens)
    return sorted(longest, key=lambda prompt: (longest[prompt], prompt))


def _training(
    spec,
    model,
    cost,
    shape: LMShape,
    step,
    samples: Sequence[Sample],
    last_of,
    previous_commit: str | None,
    draw_scores: list[Node] | None = None,
) -> list[Node]:
    """Score, log-probs and train per micro-batch (whole prompt groups), then commit and publish. A step that draws
    more prompts has scored each draw already (`draw_scores`): each of its micro-batches reads them all (which groups
    it keeps is known once every draw is scored), and they are priced for the `batch` groups the step trains."""
    per_micro = spec.batch // spec.micro_batches
    exclusive = not shape.shared  # each node made shareable as it is made: a search builds many cuts' steps
    trainable = trainable_params(spec)
    trained = model.params if trainable is None else trainable
    order = _prompt_order(samples) if shape.stream else list(range(spec.batch))
    rank = {prompt: position for position, prompt in enumerate(order)}
    after_commit = (previous_commit,) if previous_commit else ()
    nodes: list[Node] = []
    trains: list[str] = []
    for micro in range(spec.micro_batches):
        members = [s for s in samples if rank[s.id[1]] // per_micro == micro]
        ids = tuple(s.id for s in members)
        lengths = [s.prompt_tokens + s.response_tokens for s in members]
        if draw_scores is None:
            score = Node(
                _id(spec, step, "score", micro),
                spec.name,
                step,
                Kind.SCORE,
                Role.ANY,
                _finished_after(members, last_of, spec.lengths_known),
                version=step,
                samples=ids,
                cost_s=cost.rule_score(len(members)),
                fixed_s=cost.fixed("score"),
                exclusive=exclusive,
            )
            nodes.append(score)
            scored: tuple[str, ...] = (score.id,)
        else:
            scored = tuple(score.id for score in draw_scores)
        before_train = [*scored, *after_commit]
        for which, wanted in (("old", spec.recompute_logprob), ("ref", spec.reference)):
            if wanted:
                logprob = Node(
                    _id(spec, step, "logprob", which, micro),
                    spec.name,
                    step,
                    Kind.LOGPROB,
                    Role.TRAINER,
                    (*scored, *after_commit),
                    version=step,
                    samples=ids,
                    cost_s=cost.logprob(model, lengths, reference=which == "ref"),
                    fixed_s=cost.fixed("logprob"),
                    micro_batch=micro,
                    reference=which == "ref",
                    exclusive=exclusive,
                )
                nodes.append(logprob)
                before_train.append(logprob.id)
        if spec.critic:  # the critic's values of the micro-batch's tokens, then its train beside the actor's
            values = Node(
                _id(spec, step, "values", micro),
                spec.name,
                step,
                Kind.LOGPROB,
                Role.TRAINER,
                tuple(before_train),
                version=step,
                samples=ids,
                cost_s=cost.logprob(model, lengths),
                fixed_s=cost.fixed("logprob"),
                micro_batch=micro,
                critic=True,
                exclusive=exclusive,
            )
            nodes.append(values)
            before_train.append(values.id)
        tokens_per_device = math.ceil(sum(lengths) / shape.trainer_devices)
        activations = cost.training_memory(
            model.params, model.layers, model.hidden, tokens_per_device, shape.trainer_devices
        ).activations
        # the actor's train, and PPO's critic's beside it: a whole model (no LoRA), as large as the policy
        updates = [("train", spec.lora is not None, False)] + ([("train_critic", False, True)] if spec.critic else [])
        for name, lora, critic in updates:
            train = Node(
                _id(spec, step, name, micro),
                spec.name,
                step,
                Kind.TRAIN,
                Role.TRAINER,
                tuple(before_train),
                version=step,
                samples=ids,
                micro_batch=micro,
                cost_s=cost.train(model, lengths, lora=lora),
                fixed_s=cost.fixed("train"),
                memory_gb=activations / GB,
                critic=critic,
                exclusive=exclusive,
            )
            nodes.append(train)
            trains.append(train.id)
    if spec.critic:  # the critic's AdamW steps at the commit beside the actor's, over all of its parameters
        trained += model.params
    update_s = (
        cost.optimizer_step(trained) + cost.replica_allreduce_seconds(trained, 1, shape.trainer_devices)
        if spec.replicated_trainer
        else cost.optimizer_step(trained, devices=shape.trainer_devices)
    )
    # each update after the first trains the step's responses again on the trainer devices, inside the commit
    retrain_s = sum(n.cost_s for n in nodes if n.kind == Kind.TRAIN) / shape.trainer_devices
    commit = Node(
        _id(spec, step, "commit"),
        spec.name,
        step,
        Kind.COMMIT,
        Role.TRAINER,
        tuple(trains),
        version=step,
        cost_s=update_s + (spec.updates - 1) * (retrain_s + update_s),
        fixed_s=cost.fixed("optimizer"),
        collective=True,
        exclusive=exclusive,
    )
    publish = Node(
        _id(spec, step, "publish"),
        spec.name,
        step,
        Kind.PUBLISH,
        Role.TRAINER,
        (commit.id,),
        version=step,
        cost_s=cost.publish(model.params if trainable is None else trainable),  # the critic is not published
        fixed_s=cost.fixed("publish"),
        collective=True,
        exclusive=exclusive,
    )
    return nodes + [commit, publish]
