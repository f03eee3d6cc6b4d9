"""A language-model run's engines in this process (`LMLocal`: the pipeline kind's `local`): the reference loop's GRPO
step (`lm_rl_step`) and the held-out evaluation. Loaded by the kind's registry, so a flow run never imports the
language-model stack.
"""

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dovetail.graph.node import SampleId
from dovetail.models.causal_lm import rollout_engine
from dovetail.models.engine import Request
from dovetail.models.training import load_trainer_state, stepped_lr, weights_of
from dovetail.pipelines.lm.adapter import commit_scale, further_update_metrics, lm_step_metrics
from dovetail.pipelines.lm.config import LMTrainConfig
from dovetail.pipelines.lm.dynamic_sampling import dynamic_sampling_metrics, enough, kept_samples, scores_of
from dovetail.pipelines.lm.engines import LMEngines
from dovetail.pipelines.lm.messages import (
    Decode,
    LMCriticTrain,
    LMLogProbs,
    LMTrain,
    LMValues,
    Prefill,
    Responses,
)
from dovetail.pipelines.lm.model import (
    encode_prompts,
    engine_length,
    lm_checkpoint_io,
    model_context,
    sampling_params,
    stop_strings,
)
from dovetail.pipelines.lm.multiturn import run_episodes, with_episode_rewards
from dovetail.rewards.text import score_text
from dovetail.run_dir import (
    RunDir,
)
from dovetail.runtime.messages import FurtherUpdate, Score, Scores
from dovetail.runtime.pipeline import memory_figures
from dovetail.tasks import final_answer, task
from dovetail.trackers import Evaluation

CRITIC_FILE = "critic.safetensors"
"""A PPO run's checkpoint's critic weights, beside the policy's."""
CRITIC_OPTIMIZER_FILE = "critic_optimizer.pt"
"""... and the critic's AdamW state, beside the policy's optimizer.pt."""


class LMLocal:
    """A language-model run's engines in this process (trainer, rollout engine, rewards). A PPO run's critic
    (`LMEngines.critic`) is part of its trainer state and checkpointed beside the policy (`CRITIC_FILE`), so a resumed
    run goes on with the critic it had."""

    def __init__(self, config: LMTrainConfig) -> None:
        self.config = config
        self.engines = LMEngines(config, torch.device("cpu"), True, None)
        self.model, self.optimizer = self.engines.trainer, self.engines.optimizer
        self._save, self._load = lm_checkpoint_io(config, self.model, self.engines.tokenizer)

    def trainer_state(self) -> dict:
        """The weights and optimizer state the Ray trainers start from, the critic's with them."""
        return self.engines.trainer_state()

    def load_trainer_state(self, state: dict) -> None:
        """A committed state into this process's model and optimizer, whole (a sharded run's members' joined: this
        process holds no shard, so none of it is kept aside for one), and the critic's where the run trains one."""
        load_trainer_state(self.model, self.optimizer, state)
        self.engines.load_critic_state(state)

    def save_weights(self, directory: Path) -> None:
        self._save(directory)
        critic, optimizer = self.engines.critic, self.engines.critic_optimizer
        if critic is not None and optimizer is not None:
            weights = {name: tensor.detach().cpu().contiguous() for name, tensor in critic.state_dict().items()}
            save_file(weights, directory / CRITIC_FILE)
            torch.save(optimizer.state_dict(), directory / CRITIC_OPTIMIZER_FILE)

    def load_weights(self, directory: Path):
        """The checkpoint's policy (`lm_checkpoint_io`'s loader); a PPO run's critic and its optimizer are restored in
        place from beside it, where the checkpoint has them (one of a run without a critic: the critic starts fresh)."""
        loaded = self._load(directory)
        critic, optimizer = self.engines.critic, self.engines.critic_optimizer
        if critic is not None and optimizer is not None and (directory / CRITIC_FILE).is_file():
            critic.load_state_dict(load_file(directory / CRITIC_FILE))
            optimizer.load_state_dict(torch.load(directory / CRITIC_OPTIMIZER_FILE, weights_only=True))
        return loaded

    def evaluate(self, run: RunDir, grid: str, step: int) -> Evaluation:
        scores, samples = lm_evaluate(self.engines, self.config)
        return Evaluation(step, scores, samples=samples)

    def rl_step(self, step: int) -> dict:
        return lm_rl_step(self.engines, self.config, step)


def lm_rl_step(engines, config: LMTrainConfig, step: int) -> dict:
    """One on-policy GRPO step of the reference path, in this process, through the very work the Ray workers do:
    every response to the end (an env run's: every trajectory, `pipelines.lm.multiturn`), scores, one train pass over
    the whole batch, one optimizer step (algo.num_iterations: that many, each after a train pass over the whole
    batch on the weights the one before left, the old log-probs the first pass's)."""

    pipeline, algo = config.pipeline_name, config.algo
    timings: dict[str, float] = {}

    def timed(phase: str, work):
        start = time.perf_counter()
        result = engines.run(work)
        timings[f"{phase}_s"] = timings.get(f"{phase}_s", 0.0) + time.perf_counter() - start
        return result

    weights = weights_of(engines.trainer)
    rollouts, scores, ids, sampling = drawn_rollouts(engines, config, step, weights, timed)
    # The old log-probs recomputed where the config says (vLLM, KL in the reward), as the graph's LOGPROB node.
    recompute = config.recomputes_old_log_probs
    old = [timed("logprob", LMLogProbs(pipeline, ids, rollouts, False))] if recompute else []
    ref = [timed("logprob", LMLogProbs(pipeline, ids, rollouts, True))] if algo.beta > 0 else []
    parts, critic_trained, critic_train = [], None, None
    values = [timed("values", LMValues(pipeline, ids, rollouts))] if engines.critic is not None else []
    if values:  # PPO: the critic trains on the step's GAE returns beside the actor, as verl's critic update
        critic_train = LMCriticTrain(pipeline, ids, rollouts, [scores], values, old, ref)
        critic_trained = timed("train_critic", critic_train)
        parts.append(engines.part_gradient())
    train = LMTrain(pipeline, ids, False, rollouts, [scores], old_log_probs=old, ref_log_probs=ref, values=values)
    trained = timed("train", train)
    start = time.perf_counter()
    parts.append(engines.part_gradient())
    scale = commit_scale([trained])
    engines.set_step_gradient(parts, scale)
    gradients = engines.memory(parts).gradients  # as a Ray device's commit counts them: the parts and the trainer's
    grad_norm = engines.step_optimizers(algo.num_iterations)
    further = []
    for _ in range(algo.num_iterations - 1):  # as a Ray device's commit does its further updates
        again, again_parts = [], []
        for work in ([] if critic_train is None else [critic_train]) + [train]:
            again.append(engines.train_again(work))
            again_parts.append(engines.part_gradient())
        engines.set_step_gradient(again_parts, scale)
        norm = engines.step_optimizers(algo.num_iterations)
        further.append(FurtherUpdate(norm, again))
    timings["commit_s"] = time.perf_counter() - start
    memory = replace(engines.memory(), gradients=gradients)
    seconds = sum(timings.values())
    return (
        lm_step_metrics(
            [scores], [trained] if critic_trained is None else [critic_trained, trained], config.clipping_budget
        )
        | further_update_metrics([further])
        | sampling
        | timings
        | {
            "grad_norm": grad_norm,
            "learning_rate": stepped_lr(engines.optimizer),
            "samples_per_s": len(ids) / seconds,
            "step_s": seconds,
        }
        | memory_figures([memory])
    )


def drawn_rollouts(
    engines, config: LMTrainConfig, step: int, weights, timed: Callable[[str, Any], Any]
) -> tuple[list[Responses], Scores, list[SampleId], dict[str, float]]:
    """The step's responses decoded to the end and scored: its B prompts' groups (an env run's: their trajectories,
    `LMEngines._episodes`; `timed` runs each work). With `algo.dynamic_sampling` (`pipelines.lm.dynamic_sampling`)
    further batches of B prompts are drawn until B groups differ or `dynamic_sampling_max_draws` batches were drawn,
    and the step trains the groups kept. Returns the rollouts, the scores of the samples kept, those samples, and
    with dynamic sampling its metrics."""
    algo, pipeline = config.algo, config.pipeline_name
    size, group = algo.prompts_per_step, algo.group_size
    draws = algo.dynamic_sampling_max_draws if algo.dynamic_sampling else 1
    rollouts: list[Responses] = []
    scored: list[Scores] = []
    for draw in range(draws):
        samples = [SampleId(step, draw * size + p, i) for p in range(size) for i in range(group)]
        if config.env is None:
            rows = [engines.prompts.train(step, draw * size + p) for p in range(size)]
            prompts = encode_prompts(config, engines.tokenizer, rows, model_context(config))
            encoded = [prompts[s.prompt - draw * size] for s in samples]
        else:  # its prompts are its episodes' first observations: the decode rolls each trajectory out whole
            encoded = []
        started = timed("prefill", Prefill(pipeline, samples, encoded, step, weights))
        rollouts.append(timed("decode", Decode(pipeline, [started], config.max_new_tokens, weights)))
        scored.append(timed("score", Score(pipeline, [rollouts[-1]], None)))
        if not algo.dynamic_sampling or enough(scored, size):
            break
    if not algo.dynamic_sampling:
        return rollouts, scored[0], scored[0].samples, {}
    chosen = kept_samples(scored, size)
    return rollouts, scores_of(scored, chosen), chosen, dynamic_sampling_metrics(scored, chosen, size)


def success_rate(config: LMTrainConfig, completions: list[str], prompts: list[str]) -> float:
    """Share of completions whose final answer solves its (task) prompt."""
    the_task = task(config.task)
    return float(
        np.mean(
            [(a := final_answer(c)) is not None and the_task.is_correct(p, a) for c, p in zip(completions, prompts)]
        )
    )


def lm_evaluate(engines, config: LMTrainConfig) -> tuple[dict[str, float], list[tuple[str, str]]]:
    """One response per held-out prompt (an env run's: one trajectory), sampled as in training from the eval seed;
    their scores (the total: a task's success rate, a dataset's or an environment's mean reward) and the (prompt,
    completion) pairs (an env run's prompt: the environment's first observation, as the model read it)."""
    rows = engines.prompts.eval()
    context = model_context(config)
    params = sampling_params(config, engines.tokenizer.stop_ids, seed=config.eval.seed)
    stop = stop_strings(config, engines.tokenizer, engines.tools)

    def engine_of(max_len: int):
        return rollout_engine(engines.trainer, params, max_len=max_len, device=torch.device("cpu"), stop=stop)

    prompts = [row.prompt for row in rows]
    trajectories = None
    if config.env is None:
        encoded = encode_prompts(config, engines.tokenizer, rows, context)
        engine = engine_of(min(context, max(map(len, encoded)) + config.max_new_tokens))
        responses = [r.tokens for r in engine.generate([Request((0, i, 0), ids) for i, ids in enumerate(encoded)])]
        shown = [p if isinstance(p, str) else engines.tokenizer.decode(ids) for p, ids in zip(prompts, encoded)]
    else:
        engine = engine_of(engine_length(config, engines.tokenizer, engines.prompts, context))
        samples = [SampleId(0, i, 0) for i in range(len(rows))]
        episode_rows = [engines.prompts.episode_row(row) for row in rows]
        trajectories, _ = run_episodes(engine, engines.environments, engines.conversation, samples, episode_rows)
        responses = [t.tokens for t in trajectories]
        shown = [engines.tokenizer.decode(t.prompt) for t in trajectories]
    completions = [engines.tokenizer.decode(tokens) for tokens in responses]
    reward_context = engines.prompts.context(rows, [list(tokens) for tokens in responses])
    scores = score_text(
        completions, prompts, config.rewards, config.reward_timeout_s, reward_context, engines.reward_sources
    )
    if trajectories is not None:
        scores = with_episode_rewards(scores, [t.reward for t in trajectories])
    if config.user_model or trajectories is not None:
        total = {"total": float(scores["total"].mean())}
    else:
        total = {"total": success_rate(config, completions, prompts)}
    return total | {f"reward/{name}": float(values.mean()) for name, values in scores.items()}, list(
        zip(shown, completions)
    )
