"""The driver's side of a language-model pipeline on the Ray runtime: `LMAdapter` turns the nodes of `graph.lm`
into typed work (a shard's prefill and decode bands on its rollout engine: a decode band continues whatever is still
running, up to the band's upper edge, so lengths are learnt by decoding; scores of a micro-batch of whole groups;
old / reference log-probs and the train micro-batches on the trainer devices), books what comes back in the ledger,
and reports a committed step's scale and figures (the reference loop's too).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import ray

from dovetail.graph.flow import split
from dovetail.graph.lm import LMShape
from dovetail.graph.node import Kind, Node, SampleId
from dovetail.models.engine import Request
from dovetail.models.lm_rl import by_group
from dovetail.pipelines.lm.config import LMTrainConfig
from dovetail.pipelines.lm.dynamic_sampling import dynamic_sampling_metrics, enough, kept_samples, scores_of
from dovetail.pipelines.lm.engines import merged_critic_stats, merged_stats, requests_of
from dovetail.pipelines.lm.messages import (
    CRITIC_UNIT,
    CriticTrained,
    Decode,
    DecodeTurn,
    LMCriticTrain,
    LMLogProbs,
    LMTrain,
    LMValues,
    Prefill,
    ResetEpisodes,
    Responses,
    StepEpisodes,
)
from dovetail.pipelines.lm.model import encode_prompts, load_run_tokenizer, model_context
from dovetail.pipelines.lm.multiturn import episode_metrics
from dovetail.pipelines.lm.prompts import RunPrompts
from dovetail.runtime.messages import FurtherUpdate, Score, Scores, Trained
from dovetail.runtime.pipeline import Part, PipelineAdapter, RunContext
from dovetail.sched.policy import Shape


class LMAdapter(PipelineAdapter):
    """The driver side of a language-model pipeline."""

    def __init__(self, config: LMTrainConfig, first_step: int) -> None:
        super().__init__(config, first_step)
        self.tokenizer = load_run_tokenizer(config)
        self.run_prompts = RunPrompts(config)
        self.context = model_context(config)
        self._prompts: dict[int, list[list[int]]] = {}
        self._assigned: dict[tuple[str, int], tuple[dict[str, list[SampleId]], set[int]]] = {}
        """(pipeline, graph step) -> streamed micro-batches' samples by score node, and the groups they took."""
        self._shape: LMShape | None = None
        """The shape of the steps whose nodes `parts` last cut (`book` reads it for their results)."""
        self._drawn: dict[tuple[int, int], bool] = {}
        """Dynamic sampling: (RL step, draw) -> whether the step drew it (`_needed`)."""
        self._kept: dict[int, set[SampleId]] = {}
        """Dynamic sampling: RL step -> the samples it trains (`dynamic_sampling.kept_samples`)."""
        self._last_turns: set[str] = set()
        """With free waits: the turn nodes that end their shard's chain (`_ends_chain`)."""

    @property
    def draws(self) -> bool:
        """Whether a step samples dynamically (algo.dynamic_sampling: `graph.lm` builds it of draws, one or more,
        whose scores its training reads: the spec's `dynamic_sampling`)."""
        return self.config.algo.dynamic_sampling

    def units_of(self, sample: SampleId) -> list[int] | None:
        """A response's policy update (0), and with a critic its critic update (`CRITIC_UNIT`). With dynamic
        sampling, a sample of a group its step dropped (or did not keep) trains nowhere ([]), and one of a draw its
        step did not need was never drawn (None)."""
        units = [0] if self.config.critic is None else [0, CRITIC_UNIT]
        if not self.draws:
            return units
        if not self._drawn[(sample.step, sample.prompt // self.config.algo.prompts_per_step)]:
            return None
        return units if sample in self._kept[sample.step] else []

    def parts(self, node: Node, devices: tuple[int, ...], run: RunContext) -> list[Part]:
        pipeline, graph = node.pipeline, run.graph
        version = run.rollout_version(pipeline, node.step)
        shape = self._shape = lm_shape(run.shape_of(pipeline))
        if node.kind == Kind.PREFILL:
            step = self.rl_step(node)
            samples = [SampleId(step, p, i) for (_, p, i) in node.samples]
            if self.draws and not self._needed(node, run):
                samples = []
            prompts = self._prompts_of(samples)
            weights = run.weights(pipeline, version)
            rolled = self.first_step + version
            episodes = run.off_device(pipeline, ResetEpisodes(pipeline, samples, rolled)) if self.free_waits else None
            return [Part(node.id, devices[0], Prefill(pipeline, samples, prompts, rolled, weights, episodes))]
        if node.kind in (Kind.DECODE, Kind.MIGRATE):
            weights = run.weights(pipeline, version)
            rollouts = run.outputs_of(node.deps)
            if self.free_waits:  # one turn of the shard's trajectories, after its reset or its last env node
                if not any(run.graph[child].kind == Kind.ENV for child in run.graph.dependants[node.id]):
                    self._last_turns.add(node.id)
                return [Part(node.id, devices[0], DecodeTurn(pipeline, rollouts, weights))]
            if node.kind == Kind.MIGRATE:  # the tail leaves its engines: re-prefilled here, one token decoded
                assert shape.migrate_at is not None, "a step has a migrate node only where its shape migrates"
                return [Part(node.id, devices[0], Decode(pipeline, rollouts, shape.migrate_at + 1, weights, True))]
            return [Part(node.id, devices[0], Decode(pipeline, rollouts, band_end(node), weights))]
        if self.draws and node.kind != Kind.SCORE:
            rollouts, samples, scores = self._kept_of(node, run)
        else:
            score = (
                node if node.kind == Kind.SCORE else next(graph[d] for d in node.deps if graph[d].kind == Kind.SCORE)
            )
            rollouts = self._rollouts(score, run)
            samples = self._members(score, run)
            if node.kind == Kind.SCORE:
                if self.draws and not self._needed(node, run):
                    samples = []  # a draw its step did not need: nothing was generated
                return [Part(node.id, devices[0], Score(pipeline, rollouts, samples))]
            scores = run.outputs_of([score.id])  # done: a log-prob or train node follows its micro-batch's score
        if node.kind == Kind.LOGPROB and node.critic:
            shares, lockstep = self.trainer_shares(samples, devices, scores, trainer=True)  # a sharded critic's
            return [Part(node.id, d, LMValues(pipeline, ids, rollouts, **lockstep)) for d, ids in shares]
        if node.kind == Kind.LOGPROB:
            shares, lockstep = self.trainer_shares(samples, devices, scores, trainer=not node.reference)
            return [
                Part(node.id, d, LMLogProbs(pipeline, ids, rollouts, node.reference, **lockstep)) for d, ids in shares
            ]
        if node.kind == Kind.TRAIN:
            logprobs = [graph[d] for d in node.deps if graph[d].kind == Kind.LOGPROB]
            old = run.outputs_of([n.id for n in logprobs if not n.reference and not n.critic])
            ref = run.outputs_of([n.id for n in logprobs if n.reference])
            values = run.outputs_of([n.id for n in logprobs if n.critic])
            shares, lockstep = self.trainer_shares(samples, devices, scores, trainer=True)
            if node.critic:
                return [
                    Part(node.id, d, LMCriticTrain(pipeline, ids, rollouts, scores, values, old, ref, **lockstep))
                    for d, ids in shares
                ]
            stale = version < node.version
            return [
                Part(node.id, d, LMTrain(pipeline, ids, stale, rollouts, scores, old, ref, values=values, **lockstep))
                for d, ids in shares
            ]
        raise ValueError(f"node {node.id}: the language-model runtime does not run {node.kind} nodes yet")

    @property
    def free_waits(self) -> bool:
        """Whether an env run's turns are nodes of their own, its environment's steps and waits off the devices
        (`env.free_waits`; `graph.lm._turns`)."""
        return self.config.env is not None and self.config.env.free_waits

    def wait_work(self, node: Node, run: RunContext) -> StepEpisodes:
        """An env node: the episodes of its shard's trajectories stepped on the turn its dependency decoded, off the
        devices (`multiturn.Episodes`)."""
        return StepEpisodes(node.pipeline, run.outputs_of(node.deps))

    def _needed(self, node: Node, run: RunContext) -> bool:
        """Whether the step of a further draw's node (a prefill, or its score) draws it: the draws before it, scored
        (its prefill follows the previous draw's score, `graph.lm`), hold fewer than B groups that differ."""
        step, size = self.rl_step(node), self.config.algo.prompts_per_step
        draw = min(p for (_, p, _) in node.samples) // size
        if (step, draw) not in self._drawn:
            earlier = [
                n.id
                for n in run.graph.of(node.pipeline, node.step, Kind.SCORE)
                if min(p for (_, p, _) in n.samples) // size < draw
            ]
            self._drawn[(step, draw)] = not enough(ray.get(run.outputs_of(earlier)), size)
        return self._drawn[(step, draw)]

    def _kept_of(self, node: Node, run: RunContext) -> tuple[list, list[SampleId], list]:
        """A log-prob or train node of a step that drew more prompts: every draw's responses, its micro-batch's share
        of the samples the step keeps (`dynamic_sampling.kept_samples`, from every draw's scores: the kept groups in
        prompt order, cut into `algo.micro_batches` runs whose sizes differ by at most one) and one ref of their
        scores. Any split of the groups commits the same gradient (`tests/test_lm_exactness.py`)."""
        scored = [run.graph[d] for d in node.deps if run.graph[d].kind == Kind.SCORE]
        drawn = ray.get(run.outputs_of([n.id for n in scored]))
        kept = kept_samples(drawn, self.config.algo.prompts_per_step)
        self._kept[self.rl_step(node)] = set(kept)
        groups = by_group(kept)
        assert node.micro_batch is not None, f"node {node.id}: a log-prob or train node without its micro-batch"
        rows = split(len(groups), self.config.algo.micro_batches)[node.micro_batch]
        mine = [sample for g in rows for sample in groups[g]]
        rollouts = [ref for score in scored for ref in self._rollouts(score, run)]
        return rollouts, mine, [ray.put(scores_of(drawn, mine))]

    def trained_scores(self, scores: list[Scores]) -> list[Scores]:
        """The scores of the samples a step trained: with dynamic sampling, the groups it kept of every draw."""
        if not self.draws:
            return scores
        return [scores_of(scores, kept_samples(scores, self.config.algo.prompts_per_step))]

    def _prompts_of(self, samples: list[SampleId]) -> list[list[int]]:
        """The token ids of `samples`' prompts (a step's, encoded at its first prefill). An env run's are its
        episodes' first observations, written on the device as each episode resets: none here."""
        if self.config.env is not None:
            return []
        for step in {sample.step for sample in samples} - set(self._prompts):
            algo = self.config.algo
            drawn = algo.prompts_per_step * (algo.dynamic_sampling_max_draws if algo.dynamic_sampling else 1)
            rows = [self.run_prompts.train(step, position) for position in range(drawn)]
            self._prompts[step] = encode_prompts(self.config, self.tokenizer, rows, self.context)
        return [self._prompts[sample.step][sample.prompt] for sample in samples]

    def trainer_shares(
        self, samples: list[SampleId], devices: tuple[int, ...], scores: list, trainer: bool
    ) -> tuple[list[tuple[int, list[SampleId]]], dict]:
        """A trainer node's groups shared out to `devices` (`spread_groups`), and what its parts say besides. A
        sharded trainer's node (`trainer`: the trainer's work, not the reference model's) runs on its whole FSDP group
        at once: a part for every member, even one without groups, each making as many passes as the member with the
        most groups (`runtime.messages.TrainerWork`)."""
        shares = self.spread_groups(samples, devices, scores)
        if not (trainer and self.config.train.sharding == "fsdp"):
            return shares, {}
        group = tuple(sorted(devices))
        held = dict(shares)
        every = [(device, held.get(device, [])) for device in group]
        return every, {"group": group, "passes": max(len(by_group(ids)) for _, ids in every)}

    def spread_groups(
        self, samples: list[SampleId], devices: tuple[int, ...], scores: list
    ) -> list[tuple[int, list[SampleId]]]:
        """Whole groups (the trainer's unit of work, `models.lm_rl`) shared out to `devices` so that each trains about
        as many tokens (`balanced`, as verl's `balance_batch` does for its data-parallel ranks), by the response
        lengths the micro-batch's score reported (`scores`: its one result). A node ends when its slowest device
        does; by count, one device of two trained 40 % more tokens than the other in some sort steps. Where the
        groups go does not change the step's gradient: parts add up to the same bits in any order."""
        groups = by_group(samples)
        if len(devices) == 1:
            return [(devices[0], [sample for group in groups for sample in group])]
        (scored,) = ray.get(scores)
        length = {SampleId(*s): tokens for s, tokens in zip(scored.samples, scored.response_tokens.tolist())}
        costs = [self._group_tokens(group, length) for group in groups]
        spread = [
            (device, [sample for g in share for sample in groups[g]])
            for device, share in zip(devices, balanced(costs, len(devices)))
            if share
        ]
        return spread or [(devices[0], [])]  # a node of no groups still has one (empty) part, so that it finishes

    def _group_tokens(self, group: list[SampleId], length: dict[SampleId, int]) -> int:
        """The tokens a trainer passes over for a group: its prompt once, each response padded to the group's longest
        (`models.lm_rl.group_response_log_probs`)."""
        first = group[0]  # the step's prompts were encoded at its prefill; an env run's are unknown here
        prompt = 0 if self.config.env is not None else len(self._prompts[first.step][first.prompt])
        return prompt + len(group) * max(length[s] for s in group)

    def _rollouts(self, score: Node, run: RunContext) -> list:
        """The responses a micro-batch reads: the home engines' outputs at its level, and the migrated tail's after
        them (a response the tail finished replaces its paused copy)."""
        graph = run.graph
        ends = list(score.deps)
        if len(ends) == 1 and graph[ends[0]].shard is None:  # the migrated tail: its migrate node reads the homes
            migrate = graph[graph[ends[0]].deps[0]]
            ends = [*migrate.deps, *ends]
        return run.outputs_of(ends)

    def _members(self, score: Node, run: RunContext) -> list[SampleId]:
        """A micro-batch's samples. Fixed micro-batches hold the graph's; streamed ones, with lengths learnt by
        decoding, hold the whole groups that finished by their level, in finishing order (`_assign`). A draw's score
        (dynamic sampling) holds its whole draw, streamed or not: it follows the draw's last level."""
        if self.draws or not lm_shape(run.shape_of(score.pipeline)).stream:
            return [SampleId(self.rl_step(score), p, i) for (_, p, i) in score.samples]
        return self._assign(score, run)[score.id]

    def _assign(self, score: Node, run: RunContext) -> dict[str, list[SampleId]]:
        """Whole groups to the step's streamed micro-batches, level by level up to the score's (a level: the decode
        nodes after which a micro-batch may start, ordered by their band's upper edge, the migrated tail last). A
        level's micro-batches take the groups finished by then and not taken before, shortest longest-response
        first, `B / micro_batches` each; the last level takes every group left. Sizes may differ from the planned
        ones (even be empty): the commit divides by the step's normaliser, so the gradient is the batch's whatever
        the split. Deterministic: a level reads only its own nodes' outputs and what the levels below took."""
        graph, algo = run.graph, self.config.algo
        per_micro = algo.prompts_per_step // algo.micro_batches
        levels: dict[tuple[str, ...], list[Node]] = {}
        for micro in graph.of(score.pipeline, score.step, Kind.SCORE):
            levels.setdefault(micro.deps, []).append(micro)
        ordered = sorted(levels, key=lambda deps: band_end(graph[deps[0]]))
        assignment, taken = self._assigned.setdefault((score.pipeline, score.step), ({}, set()))
        for rank, deps in enumerate(ordered[: ordered.index(score.deps) + 1]):
            micros = levels[deps]
            if micros[0].id in assignment:
                continue
            groups: dict[int, list[Request]] = {}
            for sample, request in requests_of(ray.get(self._rollouts(micros[0], run))).items():
                groups.setdefault(sample.prompt, []).append(request)
            finished = [
                prompt
                for _, prompt in sorted(
                    (max(len(r.tokens) for r in members), prompt)
                    for prompt, members in groups.items()
                    if prompt not in taken and all(r.finished for r in members)
                )
            ]
            if rank == len(ordered) - 1:
                runs = split(len(finished), len(micros))
            else:
                finished = finished[: per_micro * len(micros)]
                runs = [range(i * per_micro, min(len(finished), (i + 1) * per_micro)) for i in range(len(micros))]
            for micro, rows in zip(micros, runs):
                step = self.rl_step(micro)
                assignment[micro.id] = [SampleId(step, finished[r], i) for r in rows for i in range(algo.group_size)]
            taken.update(finished)
        return assignment

    def book(self, node: Node, part: Part, result, ledger) -> None:
        if isinstance(result, Responses) and node.kind == Kind.MIGRATE:
            ledger.migrated.append((self.rl_step(node), len(result.samples), part.device))
        elif isinstance(result, Responses) and node.kind == Kind.DECODE and self._ends_chain(node):
            for sample, done in zip(result.samples, result.finished):
                if done:
                    ledger.generated.setdefault(SampleId(*sample), []).append((part.device, result.version))
        elif isinstance(result, Scores):
            for sample in result.samples:
                ledger.scored[SampleId(*sample)] = ledger.scored.get(SampleId(*sample), 0) + 1

    def _ends_chain(self, node: Node) -> bool:
        """A response is generated where it finishes: in its shard's last band before the migration edge (or the
        end), or in the migrated tail. An env run's shard rolls its trajectories out whole in its one band, or with
        free waits in its chain of turns, whose last node hands every trajectory on, each ended."""
        if self.free_waits:
            return node.id in self._last_turns
        if node.shard is None or self.config.env is not None:
            return True
        assert self._shape is not None, "`parts` cut the node, and set the shape, before its result is booked"
        return band_end(node) == (self._shape.migrate_at or self.config.max_new_tokens)

    def commit_scale(self, trained: list[Trained]) -> float:
        return commit_scale(trained)

    @property
    def updates_per_step(self) -> int:
        return self.config.algo.num_iterations

    def further_metrics(self, further: list[list[FurtherUpdate]]) -> dict:
        return further_update_metrics(further)

    def step_metrics(self, scores: list[Scores], trained: list[Trained]) -> dict:
        budget = self.config.clipping_budget
        if not self.draws:
            return lm_step_metrics(scores, trained, budget)
        size = self.config.algo.prompts_per_step
        kept = kept_samples(scores, size)
        return lm_step_metrics([scores_of(scores, kept)], trained, budget) | dynamic_sampling_metrics(
            scores, kept, size
        )


def lm_shape(shape: Shape) -> LMShape:
    """A language-model pipeline's shape: the planner cuts its steps with an `LMShape` (`graph.lm`)."""
    assert isinstance(shape, LMShape), f"a language-model pipeline cut by a {type(shape).__name__}"
    return shape


def band_end(node: Node) -> int:
    """The upper edge of a decode node's length band (`graph.lm` gives every decode node one)."""
    assert node.band is not None, f"node {node.id}: a decode node without a length band"
    return node.band[1]


def balanced(costs: Sequence[float], shares: int) -> list[list[int]]:
    """The indices of `costs` cut into `shares` lists of about equal total cost, each in index order: the longest
    processing time rule (the costliest item first, to the share with the least so far; ties to the lower index),
    whose largest share exceeds the mean share by at most one item's cost. With fewer items than shares, the shares
    left over are empty."""
    loads = [0.0] * shares
    members: list[list[int]] = [[] for _ in range(shares)]
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        lightest = min(range(shares), key=lambda s: (loads[s], s))
        loads[lightest] += costs[item]
        members[lightest].append(item)
    return [sorted(share) for share in members]


def commit_scale(trained: list[Trained]) -> float:
    """What a step's summed gradient is multiplied by: 1 / the step's loss normaliser (its parts' contributions
    are whole numbers, so their sum is exact in any order)."""
    return 1.0 / sum(t.normaliser for t in trained)


def further_update_metrics(further: list[list[FurtherUpdate]]) -> dict:
    """The updates after a step's first (algo.num_iterations), each as `update_K/...` (K = 2, 3, ...): its pre-clip
    `grad_norm`, and its parts' loss statistics over the step (`clip_frac`, `ratio_mean`, `ratio_min`, `ratio_max`,
    `approx_kl`, `loss`), from every trainer device's answer (`further`: per device, its updates in order). The
    step's own `clip_frac`, `loss`... are its first update's, whose ratio is 1 on policy. A PPO run's critic
    figures likewise (`update_K/critic/vf_loss`...)."""
    metrics: dict[str, float] = {}
    for index, updates in enumerate(zip(*further)):
        trained = [t for update in updates for t in update.trained]
        actor = [t for t in trained if not isinstance(t, CriticTrained)]
        merged = merged_stats([t.stats for t in actor if t.samples])
        normaliser = sum(t.normaliser for t in trained)
        loss = merged["loss"] / normaliser if normaliser else merged["loss"]
        figures = {"grad_norm": float(updates[0].grad_norm), "loss": loss}
        figures |= {name: merged[name] for name in ("clip_frac", "ratio_mean", "ratio_min", "ratio_max", "approx_kl")}
        figures |= critic_metrics([t for t in trained if isinstance(t, CriticTrained)], normaliser)
        metrics |= {f"update_{index + 2}/{name}": value for name, value in figures.items()}
    return metrics


def lm_step_metrics(scores: list[Scores], trained: list[Trained], budget: int | None) -> dict:
    """Rewards (each and their total), their spread, the responses' lengths and the loss statistics as per-token
    means over the step: what tells a run that learns from one with a bug, under the names TRL logs them by.

    `loss` is the objective the step's gradient descends (the parts' summed losses over the step's normaliser);
    `reward_std` the total reward's standard deviation over the batch; `frac_reward_zero_std` the share of prompt
    groups whose rewards are all equal, which carry no GRPO signal (their advantages are 0);
    `completions/{mean,min,max}_length` the responses' tokens, and `completions/clipped_ratio` the share that used
    the whole `budget` (`sampling.max_new_tokens`), as verl's `response_length/clip_ratio` counts them: a run whose
    responses grow into the budget is cut off, not learning to stop. An env run (`budget` None: its budget holds
    the observations too) adds its episodes' figures (`multiturn.episode_metrics`) instead of the clipped share."""
    metrics = {
        f"reward/{name}": float(np.concatenate([s.scores[name] for s in scores]).mean()) for name in scores[0].scores
    }
    totals = np.concatenate([s.scores["total"] for s in scores])
    lengths = np.concatenate([s.response_tokens for s in scores if s.response_tokens is not None])
    completions = {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
    }
    if budget is not None:
        completions["completions/clipped_ratio"] = float((lengths >= budget).mean())
    groups: dict[tuple[int, int], list[float]] = {}
    for sample, total in zip((sample for s in scores for sample in s.samples), totals):
        groups.setdefault((sample.step, sample.prompt), []).append(float(total))
    flat = sum(1 for rewards in groups.values() if max(rewards) == min(rewards))
    episodes = {name: np.concatenate([s.figures[name] for s in scores]) for name in scores[0].figures}
    actor = [t for t in trained if not isinstance(t, CriticTrained)]
    merged = merged_stats([t.stats for t in actor if t.samples])  # a streamed micro-batch may be empty
    tokens = merged.pop("tokens")
    normaliser = sum(t.normaliser for t in trained)
    loss = merged.pop("loss") / normaliser if normaliser else merged.pop("loss")
    return (
        metrics
        | {"loss": loss, "reward_std": float(totals.std()), "frac_reward_zero_std": flat / len(groups)}
        | merged
        | {"response_tokens": tokens}
        | completions
        | episode_metrics(episodes)
        | critic_metrics([t for t in trained if isinstance(t, CriticTrained)], normaliser)
    )


def critic_metrics(trained: list[CriticTrained], normaliser: float) -> dict[str, float]:
    """A PPO step's critic figures, under verl's names: `critic/vf_loss` (the objective its gradient descends, over
    the step's normaliser as the actor's), `critic/vf_clipfrac` (share of tokens whose clipped value error is the
    larger) and `critic/vpred_mean` (its mean value of a response token); none without a critic."""
    if not trained:
        return {}
    merged = merged_critic_stats([t.stats for t in trained if t.samples])
    return {
        "critic/vf_loss": merged["loss"] / normaliser if normaliser else merged["loss"],
        "critic/vf_clipfrac": merged["vf_clipfrac"],
        "critic/vpred_mean": merged["vpred_mean"],
    }
