"""Language-model pipelines (GRPO) on the Ray runtime: the driver's adapter and the worker's engines.

`LMAdapter` turns the nodes of `graph.llm` into typed work: a shard's prefill and decode bands on its rollout
engine (a decode band continues whatever is still running, up to the band's upper edge: lengths are learnt by
decoding), scores of a micro-batch of whole groups, old / reference log-probs and the train micro-batches on the
trainer devices. `LMEngines` holds the policy as trainer (a built-in task's tiny Llama, or a user's transformers model,
`models.causal_lm`), its rollout engine (`TorchEngine`, or transformers' own forward for an architecture it does not
compute), the frozen base model for a KL term and the rewards (`exec.lm_prompts` finds each sample's prompt row).

Each train part sums its loss (`lm_grpo_loss(loss_scale=1)`) and says how much it adds to the step's normaliser
(tokens, sequences, or sequences x max_new_tokens); the commit divides the all-reduced sum by the step's total, so
any split into micro-batches and devices, in any finishing order, trains what one batch would.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import ray
import torch

from dovetail.config.lm import LMTrainConfig
from dovetail.cost.model import CostModel
from dovetail.exec.interference import Span, time_work
from dovetail.exec.lm_prompts import Row, RunPrompts
from dovetail.exec.messages import (
    Decode,
    LMLogProbs,
    LMTrain,
    LogProbs,
    Prefill,
    Responses,
    Score,
    Scores,
    Trained,
    Work,
)
from dovetail.exec.pipeline import PROFILE_ROUNDS, Part, PipelineAdapter, PipelineEngines, RunContext
from dovetail.exec.plan import rollout_wake_s
from dovetail.graph.flow import split
from dovetail.graph.node import Kind, Node, SampleId
from dovetail.models.causal_lm import (
    HFTokenizer,
    StopStrings,
    causal_lm_config,
    context_of,
    export_builtin_lm,
    export_causal_lm,
    load_causal_lm,
    load_causal_lm_checkpoint,
    rollout_engine,
    rollout_state,
    save_causal_lm_checkpoint,
)
from dovetail.models.engine import Request, SamplingParams, engine_problem
from dovetail.models.lm import load_lm, load_tokenizer, read_lm_config, save_lm
from dovetail.models.lm_rl import accumulate_group_gradients, by_group, group_log_probs, policy_gradient
from dovetail.models.training import commit, set_summed_gradient, synchronize, tensors_of, trainer_state_of, weights_of
from dovetail.recipe import make_optimizer
from dovetail.rewards.text import columns_read, score_text, text_reward_fn
from dovetail.run_dir import load_checkpoint
from dovetail.scenario import Scenario
from dovetail.tasks import final_answer, task

STAT_MEANS = ("clip_frac", "approx_kl", "ratio_mean", "kl_ref", "entropy")
"""Per-token means each train part reports; the step's are weighted by the parts' tokens."""


def load_policy(config: LMTrainConfig):
    """The run's base policy and its tokenizer: a user's transformers model (`model.path`, with its LoRA adapter),
    or a built-in task's model."""
    if config.user_model:
        lora = None if config.model.lora is None else config.model.lora.model_dump()
        return load_causal_lm(config.model.path, lora=lora, seed=config.seed), HFTokenizer.load(config.model.path)
    model, tokenizer, _ = load_lm(config.model.checkpoint)
    return model, tokenizer


def load_reference(config: LMTrainConfig):
    """The frozen base model a KL term compares with: the policy's start, a user's model without its adapter."""
    if config.user_model:
        return load_causal_lm(config.model.path, lora=None, seed=config.seed)
    return load_policy(config)[0]


def load_run_tokenizer(config: LMTrainConfig):
    return HFTokenizer.load(config.model.path) if config.user_model else load_tokenizer(config.model.checkpoint)


def model_context(config: LMTrainConfig) -> int:
    """The positions the run's model reads: prompt and response together fit in them."""
    if config.user_model:
        return context_of(config.model.path)
    return read_lm_config(Path(config.model.checkpoint)).max_positions


def encode_prompts(config: LMTrainConfig, tokenizer, rows: list[Row], context: int) -> list[list[int]]:
    """The prompts' token ids (a longer one than prompts.max_tokens keeps its last tokens), each checked to leave
    room in the model's `context` for max_new_tokens: a prompt too long is the config's error, named before any work
    is sent."""
    limit = config.prompts.max_tokens if config.prompts is not None else None
    encoded = [tokenizer.prompt_ids(row.prompt) for row in rows]
    if limit is not None:
        encoded = [ids[-limit:] for ids in encoded]
    for row, ids in zip(rows, encoded):
        if not ids or len(ids) + config.max_new_tokens > context:
            where = config.model.path or config.model.checkpoint
            fix = "set prompts.max_tokens (keeps a prompt's last tokens) or " if config.user_model else ""
            raise ValueError(
                f"prompt {str(row.prompt)[:200]!r} ({len(ids)} tokens) and sampling.max_new_tokens="
                f"{config.max_new_tokens} exceed the model's context of {context} tokens ({where}): "
                f"{fix}lower sampling.max_new_tokens"
            )
    return encoded


def engine_length(config: LMTrainConfig, tokenizer, prompts: RunPrompts, context: int) -> int:
    """The positions a rollout engine's cache holds: the model's context, or for a dataset the longest prompt (at
    most prompts.max_tokens) and max_new_tokens, where that is less (a large model's context would be a cache of
    gigabytes)."""
    rows = prompts.all()
    if not rows:
        return context
    encoded = encode_prompts(config, tokenizer, rows, context)
    return min(context, max(map(len, encoded)) + config.max_new_tokens)


def sampling_params(config: LMTrainConfig, stop_ids: tuple[int, ...], seed: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=config.sampling.temperature,
        top_p=config.sampling.top_p,
        max_new_tokens=config.max_new_tokens,
        stop_ids=stop_ids,
        seed=config.seed if seed is None else seed,
    )


def stop_strings(config: LMTrainConfig, tokenizer) -> StopStrings | None:
    return StopStrings(tokenizer, config.sampling.stop) if config.sampling.stop else None


def lm_checkpoint_io(config: LMTrainConfig, model, tokenizer) -> tuple[Callable, Callable]:
    """(save_weights, load_weights) of an LM run's checkpoints for `RunDir`: the built-in model's own format, or a
    transformers model's trained tensors and where it came from."""
    if config.user_model:
        return (lambda directory: save_causal_lm_checkpoint(model, directory)), load_causal_lm_checkpoint
    lm_config = read_lm_config(Path(config.model.checkpoint))
    return (lambda directory: save_lm(model, tokenizer, lm_config, directory)), (lambda d: load_lm(d)[0])


def responses_of(requests: list[Request], version: int) -> Responses:
    return Responses(
        version=version,
        samples=[SampleId(*r.key) for r in requests],
        prompts=[r.prompt for r in requests],
        tokens=[r.tokens for r in requests],
        log_probs=[r.log_probs for r in requests],
        finished=[r.finished for r in requests],
    )


def requests_of(parts: list[Responses]) -> dict[SampleId, Request]:
    return {
        SampleId(*sample): Request(tuple(sample), prompt, list(tokens), list(log_probs), done)
        for part in parts
        for sample, prompt, tokens, log_probs, done in zip(
            part.samples, part.prompts, part.tokens, part.log_probs, part.finished
        )
    }


class LMEngines(PipelineEngines):
    """A language-model pipeline's engines on one device."""

    def __init__(self, config: LMTrainConfig, device: torch.device, holds_policy: bool, trainer_state: dict | None):
        super().__init__(config, device)
        self.tokenizer = load_run_tokenizer(config)
        self.prompts = RunPrompts(config)
        if not holds_policy:
            return
        model, _ = load_policy(config)
        self.trainer = model.to(device)
        self.optimizer = make_optimizer(self.trainer, config)
        if trainer_state is not None:
            self.load_trainer_state(trainer_state)
        if config.algo.beta > 0:
            self.reference = load_reference(config).to(device).requires_grad_(False)
        context = model_context(config)
        self.rollout = rollout_engine(
            self.trainer,
            sampling_params(config, self.tokenizer.stop_ids),
            max_len=engine_length(config, self.tokenizer, self.prompts, context),
            device=device,
            stop=stop_strings(config, self.tokenizer),
        )

    def load_rollout(self, weights: dict) -> None:
        self.rollout.load_weights(rollout_state(self.trainer, tensors_of(weights)))

    def run(self, work: Work):
        if isinstance(work, Prefill):
            self.load_rollout_weights(work.version, work.weights)
            requests = [Request(tuple(s), list(p)) for s, p in zip(work.samples, work.prompts)]
            return responses_of(self.rollout.generate(requests, until=1), work.version)
        if isinstance(work, Decode):
            parts = self.fetch(work.rollouts)
            self.load_rollout_weights(parts[0].version, work.weights)
            requests = [r for r in requests_of(parts).values() if not (work.running_only and r.finished)]
            return responses_of(self.rollout.generate(requests, until=work.until), parts[0].version)
        if isinstance(work, (Score, LMLogProbs, LMTrain)) and work.samples == []:
            return self._nothing(work)
        if isinstance(work, Score):
            chosen = self._select(work.rollouts, work.samples)
            rows = [self.prompts.train(sample.step, sample.prompt) for sample in chosen]
            completions = [self.tokenizer.decode(r.tokens) for r in chosen.values()]
            context = self.prompts.context(rows, [len(r.tokens) for r in chosen.values()])
            scores = score_text(
                completions, [row.prompt for row in rows], self.config.rewards, self.config.reward_timeout_s, context
            )
            return Scores(list(chosen), scores)
        if isinstance(work, LMLogProbs):
            chosen = self._select(work.rollouts, work.samples)
            model = self.reference if work.reference else self.trainer
            rows = group_log_probs(model, chosen, self.config.sampling.temperature)
            return LogProbs(list(chosen), [rows[s].cpu().numpy() for s in chosen])
        if isinstance(work, LMTrain):
            return self._train(work)
        raise TypeError(f"language-model engines cannot do {type(work).__name__}")

    def _nothing(self, work: Work):
        """The answer of a streamed micro-batch left empty (its groups all finished later): no reward, no gradient."""
        if isinstance(work, Score):
            return Scores([], {name: np.zeros(0) for name in [*self.config.rewards, "total"]})
        if isinstance(work, LMLogProbs):
            return LogProbs([], [])
        self._gradient, _ = accumulate_group_gradients(self.trainer, [], lambda group: None)
        return Trained([], [0], merged_stats([]), 0.0)

    def _select(self, rollouts: list, samples: list | None) -> dict[SampleId, Request]:
        requests = requests_of(self.fetch(rollouts))
        return requests if samples is None else {SampleId(*s): requests[SampleId(*s)] for s in samples}

    def _train(self, work: LMTrain) -> Trained:
        """The part's groups trained one at a time (`models.lm_rl.policy_gradient`); `part_gradient` hands the fp64
        sum to the commit."""
        scores = self.fetch(work.scores)
        rewards = {SampleId(*s): r for part in scores for s, r in zip(part.samples, part.scores["total"])}
        samples = [SampleId(*s) for s in work.samples]

        def given(parts: list) -> dict:
            return {SampleId(*s): v for part in self.fetch(parts) for s, v in zip(part.samples, part.log_probs)}

        self._gradient, group_stats, normaliser = policy_gradient(
            self.trainer,
            self._select(work.rollouts, samples),
            rewards,
            given(work.old_log_probs),
            given(work.ref_log_probs),
            algo=self.config.algo,
            temperature=self.config.sampling.temperature,
            max_new_tokens=self.config.max_new_tokens,
            stale=work.stale,
        )
        return Trained(samples, [0], merged_stats(group_stats), normaliser)

    def part_gradient(self) -> torch.Tensor:
        gradient, self._gradient = self._gradient, None
        return gradient

    def profile(self, samples: int, carry: Callable[[dict], dict]) -> dict[str, float]:
        return profile_work(self, samples, carry)

    def time_kind(self, kind: str, samples: int, repeats: int, carry: Callable[[dict], dict]) -> list[Span]:
        with trainer_kept(self):
            return time_work(profile_works(self, samples, carry), kind, repeats, self.device)


@contextmanager
def trainer_kept(engines: LMEngines):
    """The profile's work trains and steps the engines' own trainer and loads its weights into the rollout engine:
    afterwards the trainer's weights and optimizer are put back and the next work reloads the rollout's."""
    saved = trainer_state_of(engines.trainer, engines.optimizer)
    try:
        yield
    finally:
        engines.load_trainer_state(saved)
        engines.rollout_version = None


def profile_works(
    engines: LMEngines, samples: int, carry: Callable[[dict], dict]
) -> dict[str, Callable[[dict], object]]:
    """The start-up profile's work of each kind, in the order it runs, each taking the earlier ones' results by
    kind: `samples` responses of RL step -1 (never trained) prefilled (the trainer's weights loaded into the rollout
    engine first), decoded, scored, their log-probs, a train and an optimizer step of the engines' own trainer (run
    them `trainer_kept`), a publication to the rollout engine."""
    config, name = engines.config, engines.config.pipeline_name
    ids = [SampleId(-1, p, 0) for p in range(samples)]
    rows = [engines.prompts.train(-1, p) for p in range(samples)]
    encoded = encode_prompts(config, engines.tokenizer, rows, model_context(config))
    engines.rollout_version = None
    weights = carry(weights_of(engines.trainer))

    def train(done: dict) -> Trained:
        trained = engines.run(LMTrain(name, ids, False, [done["decode"]], [done["score"]]))
        set_summed_gradient(engines.trainer, [engines.part_gradient()], 1.0)
        return trained

    return {
        "prefill": lambda done: engines.run(Prefill(name, ids, encoded, -1, weights)),
        "decode": lambda done: engines.run(Decode(name, [done["prefill"]], config.max_new_tokens, weights)),
        "score": lambda done: engines.run(Score(name, [done["decode"]], None)),
        "logprob": lambda done: engines.run(LMLogProbs(name, ids, [done["decode"]], False)),
        "train": train,
        "optimizer": lambda done: commit(engines.trainer, engines.optimizer, config.train.max_grad_norm),
        "publish": lambda done: engines.load_rollout(carry(weights_of(engines.trainer))),
    }


def profile_work(engines: LMEngines, samples: int, carry: Callable[[dict], dict]) -> dict[str, float]:
    """Measured seconds of each kind of LM work here (`profile_works`): medians of PROFILE_ROUNDS after a warm-up."""

    def one_round() -> tuple[dict[str, float], dict[str, object]]:
        seconds, done = {}, {}
        for name, work in profile_works(engines, samples, carry).items():
            synchronize(engines.device)
            start = time.perf_counter()
            done[name] = work(done)
            synchronize(engines.device)
            seconds[name] = time.perf_counter() - start
        return seconds, done

    with trainer_kept(engines):
        one_round()
        rounds = [one_round() for _ in range(PROFILE_ROUNDS)]
    measured = {name: statistics.median(seconds[name] for seconds, _ in rounds) for name in rounds[0][0]}
    _, done = rounds[0]
    return measured | {
        "lengths": [len(t) for t in done["decode"].tokens],
        "prompt_tokens": [len(p) for p in done["prefill"].prompts],
    }


def fitted_cost(config: LMTrainConfig, scenario: Scenario, measured: dict) -> CostModel:
    """The analytic cost model with one correction per kind of work, fitted to a device's measured seconds. A role
    switch is fitted too: the catalogue's switch moves the engine's whole memory budget (gigabytes for a GPU's KV
    cache), where a CPU core's engines stay resident and a switch is a round trip."""
    spec = scenario.pipelines[0]
    analytic = CostModel(config.cluster.device)
    model = spec.catalogue_model()
    prompts, lengths = measured["prompt_tokens"], measured["lengths"]
    full = [p + n for p, n in zip(prompts, lengths)]
    predicted = {
        "prefill": analytic.prefill(model, prompts),
        "decode": analytic.decode(model, prompts, lengths),
        "score": analytic.rule_score(len(prompts)),
        "logprob": analytic.logprob(model, full),
        "train": analytic.train(model, full),
        "optimizer": analytic.optimizer_step(model.params),
        "publish": analytic.publish(model.params),
        "switch": rollout_wake_s(scenario, analytic),
    }
    records = [(kind, predicted[kind], max(measured[kind], 1e-9)) for kind in predicted if predicted[kind] > 0]
    return CostModel.from_measurements(config.cluster.device, records)


def check_checkpoint(config: LMTrainConfig) -> None:
    """What every run meets as it starts, whatever its policy (the dry run's check): the model loads (a user's: its
    config is a causal LM's, its weights are not read), its tokenizer loads, the dataset reads, the prompts it encodes
    (a dataset's every one; a task's first: the base evaluation's, the first step's) leave max_new_tokens in the
    model's context, and the rewards' columns are the dataset's. A model our engine does not compute is said in one
    line on stderr: its rollouts run on transformers' own forward."""
    if config.user_model:  # its config and tokenizer: a large model's weights are the run's to load
        model_config, tokenizer = causal_lm_config(config.model.path), HFTokenizer.load(config.model.path)
    else:
        model, tokenizer = load_policy(config)
        model_config = model.config
    prompts = RunPrompts(config)
    encode_prompts(config, tokenizer, prompts.all() or [*prompts.eval(), *prompts.step(0)], model_context(config))
    check_columns(config, prompts)
    problem = engine_problem(model_config, model_context(config))
    if config.user_model and problem is not None:
        print(
            f"note: {config.model.path}: our rollout engine does not compute {problem}; rollouts run on "
            "transformers' own forward (slower)",
            file=sys.stderr,
        )


def check_columns(config: LMTrainConfig, prompts: RunPrompts) -> None:
    """Every column a dataset run's reward reads (`columns_read`) is one of the dataset's: else one line naming the
    reward, the columns and the file, before any work."""
    if config.prompts is None:
        return
    columns = {name for row in prompts.all() for name in row.columns}
    for name in config.rewards:
        missing = columns_read(name, text_reward_fn(name, dataset=True)) - columns
        if missing:
            raise ValueError(
                f"reward {name!r} reads the column {', '.join(sorted(missing))}, which {config.prompts.path} has not "
                f"(its columns: {sorted(columns)}): add it, or set prompts.prompt_field to the prompt's column"
            )


def profile_here(config: LMTrainConfig, carry: Callable[[dict], dict]) -> dict:
    """The start-up profile in this process (the dry run's)."""
    return LMEngines(config, torch.device("cpu"), True, None).profile(config.runtime.profile_samples, carry)


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
        self._shape = None

    def units_of(self, sample: SampleId) -> list[int]:
        return [0]

    def parts(self, node: Node, devices: tuple[int, ...], run: RunContext) -> list[Part]:
        pipeline, graph = node.pipeline, run.graph
        version = run.rollout_version(pipeline, node.step)
        self._shape = run.shape_of(pipeline)
        if node.kind == Kind.PREFILL:
            step = self.rl_step(node)
            if step not in self._prompts:
                rows = self.run_prompts.step(step)
                self._prompts[step] = encode_prompts(self.config, self.tokenizer, rows, self.context)
            samples = [SampleId(step, p, i) for (_, p, i) in node.samples]
            prompts = [self._prompts[step][s.prompt] for s in samples]
            weights = run.weights(pipeline, version)
            return [Part(node.id, devices[0], Prefill(pipeline, samples, prompts, self.first_step + version, weights))]
        if node.kind in (Kind.DECODE, Kind.MIGRATE):
            weights = run.weights(pipeline, version)
            rollouts = run.outputs_of(node.deps)
            if node.kind == Kind.MIGRATE:  # the tail leaves its engines: re-prefilled here, one token decoded
                return [
                    Part(node.id, devices[0], Decode(pipeline, rollouts, self._shape.migrate_at + 1, weights, True))
                ]
            return [Part(node.id, devices[0], Decode(pipeline, rollouts, node.band[1], weights))]
        score = node if node.kind == Kind.SCORE else next(graph[d] for d in node.deps if graph[d].kind == Kind.SCORE)
        rollouts = self._rollouts(score, run)
        samples = self._members(score, run)
        if node.kind == Kind.SCORE:
            return [Part(node.id, devices[0], Score(pipeline, rollouts, samples))]
        if node.kind == Kind.LOGPROB:
            return [
                Part(node.id, d, LMLogProbs(pipeline, ids, rollouts, node.reference))
                for d, ids in self.spread_groups(samples, devices)
            ]
        if node.kind == Kind.TRAIN:
            logprobs = [graph[d] for d in node.deps if graph[d].kind == Kind.LOGPROB]
            old = run.outputs_of([n.id for n in logprobs if not n.reference])
            ref = run.outputs_of([n.id for n in logprobs if n.reference])
            stale = version < node.version
            scores = run.outputs_of([score.id])
            return [
                Part(node.id, d, LMTrain(pipeline, ids, stale, rollouts, scores, old, ref))
                for d, ids in self.spread_groups(samples, devices)
            ]
        raise ValueError(f"node {node.id}: the language-model runtime does not run {node.kind} nodes yet")

    def spread_groups(self, samples: list[SampleId], devices: tuple[int, ...]) -> list[tuple[int, list[SampleId]]]:
        """Whole groups dealt to `devices` (`spread`): a group is the trainer's unit of work (`models.lm_rl`)."""
        spread = self.spread(by_group(samples), devices, keep_empty=True)
        return [(device, [sample for group in groups for sample in group]) for device, groups in spread]

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
        decoding, hold the whole groups that finished by their level, in finishing order (`_assign`)."""
        if not run.shape_of(score.pipeline).stream:
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
        ordered = sorted(levels, key=lambda deps: graph[deps[0]].band[1])
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
        end), or in the migrated tail."""
        return node.shard is None or node.band[1] == (self._shape.migrate_at or self.config.max_new_tokens)

    def commit_scale(self, trained: list[Trained]) -> float:
        return commit_scale(trained)

    def step_metrics(self, scores: list[Scores], trained: list[Trained]) -> dict:
        return lm_step_metrics(self.config, scores, trained)


def commit_scale(trained: list[Trained]) -> float:
    """What a step's summed gradient is multiplied by: 1 / the step's loss normaliser (its parts' contributions
    are whole numbers, so their sum is exact in any order)."""
    return 1.0 / sum(t.normaliser for t in trained)


def lm_step_metrics(config: LMTrainConfig, scores: list[Scores], trained: list[Trained]) -> dict:
    """Rewards (each and their total), and the loss statistics as per-token means over the step."""
    metrics = {
        f"reward/{name}": float(np.concatenate([s.scores[name] for s in scores]).mean()) for name in scores[0].scores
    }
    merged = merged_stats([t.stats for t in trained if t.samples])  # a streamed micro-batch may be empty
    tokens = merged.pop("tokens")
    merged.pop("loss")
    return metrics | merged | {"response_tokens": tokens}


def merged_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """Loss statistics of several groups or parts as one: per-token means weighted by tokens, the ratio's extremes,
    token and loss sums."""
    parts = [p for p in parts if p["tokens"] > 0]
    if not parts:
        return dict.fromkeys([*STAT_MEANS, "tokens", "loss"], 0.0) | {"ratio_min": np.inf, "ratio_max": -np.inf}
    tokens = sum(p["tokens"] for p in parts)
    means = {name: sum(p[name] * p["tokens"] for p in parts) / tokens for name in STAT_MEANS if name in parts[0]}
    return means | {
        "tokens": tokens,
        "loss": sum(p["loss"] for p in parts),
        "ratio_min": min(p["ratio_min"] for p in parts),
        "ratio_max": max(p["ratio_max"] for p in parts),
    }


def success_rate(config: LMTrainConfig, completions: list[str], prompts: list[str]) -> float:
    """Share of completions whose final answer solves its (task) prompt."""
    the_task = task(config.task)
    return float(
        np.mean(
            [(a := final_answer(c)) is not None and the_task.is_correct(p, a) for c, p in zip(completions, prompts)]
        )
    )


def exporter(config: LMTrainConfig) -> Callable[[Path, Path], None]:
    """`dovetail export` of an LM run: a transformers directory of a checkpoint's model (`models.causal_lm`): a
    user's model with its tokenizer (a LoRA adapter merged in, and in peft's layout in lora/), or a built-in task's
    model with its character tokenizer as a transformers tokenizer."""

    def write(checkpoint: Path, out: Path) -> None:
        model, tokenizer = load_policy(config)
        _, load_weights = lm_checkpoint_io(config, model, tokenizer)
        load_checkpoint(checkpoint, model, make_optimizer(model, config), load_weights)
        if config.user_model:
            export_causal_lm(model, out)
        else:
            export_builtin_lm(model, tokenizer, out)

    return write


Adapter, Engines = LMAdapter, LMEngines
