"""The reference RL loop (`policy: reference`): one process, no Ray, every step in order.

prompts -> G samples per prompt (SDE) -> rewards -> advantages -> train the selected timesteps
(batched) -> one optimizer step. Every other policy must reproduce these parameters.
"""

import time
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from dovetail.config.train import (
    FlowTrainConfig,
    LMTrainConfig,
    MultiplexConfig,
    PipelineConfig,
    TrainConfig,
    dump_config,
    pipeline_configs,
)
from dovetail.exec.driver import train_on_ray
from dovetail.exec.lm import LMEngines, encode_prompts, lm_step_metrics, sampling_params, success_rate, task_prompts
from dovetail.exec.messages import Decode, LMLogProbs, LMTrain, Prefill, Score
from dovetail.exec.pipeline import weights_of
from dovetail.graph.node import SampleId
from dovetail.models.engine import Request, TorchEngine
from dovetail.models.flow_rl import commit, generate, group_sample_ids, step_prompts
from dovetail.models.lm import load_lm, save_lm
from dovetail.models.pretrain import latents_to_images
from dovetail.models.t2i import load_model
from dovetail.recipe import advantages_of, evaluate, make_optimizer, policy_gradient, sde_settings, step_timesteps
from dovetail.rewards import RewardError, score
from dovetail.rewards.text import score_text
from dovetail.run_dir import RunDir, load_checkpoint
from dovetail.tasks import task


def rl_step(model, optimizer, config: FlowTrainConfig, step: int, reference_model=None) -> dict:
    """One on-policy step of the reference path; returns its metrics."""
    sde = sde_settings(config)
    algo = config.algo
    timings = {}

    start = time.perf_counter()
    prompts = step_prompts(config.seed, step, algo.prompts_per_step)
    ids = group_sample_ids(step, list(range(algo.prompts_per_step)), algo.group_size)
    sample_prompts = [prompts[s.prompt] for s in ids]
    trajectories = generate(
        model, sample_prompts, ids, sde, seed=config.seed, shared_group_noise=config.shared_group_noise
    )
    timings["generate_s"] = time.perf_counter() - start

    start = time.perf_counter()
    rewards = score(latents_to_images(trajectories.images), sample_prompts, config.reward, config.reward_timeout_s)
    advantages = advantages_of(config, rewards["total"], [s.prompt for s in ids])
    timings["score_s"] = time.perf_counter() - start

    start = time.perf_counter()
    timesteps = step_timesteps(config, step)
    total_pairs = config.pairs_per_step
    sums = policy_gradient(
        model,
        trajectories,
        advantages,
        timesteps,
        sde,
        config,
        total_pairs=total_pairs,
        reference_model=reference_model,
    )
    timings["train_s"] = time.perf_counter() - start

    start = time.perf_counter()
    grad_norm = commit(model, optimizer, config.train.max_grad_norm)
    timings["commit_s"] = time.perf_counter() - start

    step_seconds = sum(timings.values())
    metrics = {f"reward/{name}": float(values.mean()) for name, values in rewards.items()}
    metrics |= {
        name: value if name in ("ratio_min", "ratio_max") else value / total_pairs for name, value in sums.items()
    }
    metrics |= timings | {"grad_norm": grad_norm, "samples_per_s": len(ids) / step_seconds, "timesteps": timesteps}
    return metrics


class StepLog:
    """What happens after every optimizer step of a pipeline, whoever ran it: metrics, evaluation, checkpoints,
    progress; and the pipeline's summary.json when the run ends."""

    def __init__(
        self,
        run: RunDir,
        config: PipelineConfig,
        local,
        last_step: int,
        base_eval: dict,
        eval_reward: float,
        progress: Progress,
    ):
        """`local` is the pipeline's model in this process (`FlowLocal`, `LMLocal`): what is evaluated and saved;
        `eval_reward` its latest evaluation."""
        self.run, self.config, self.local = run, config, local
        self.model, self.optimizer = local.model, local.optimizer
        self.last_step = last_step
        self.summary = {"base_eval_reward": base_eval["total"], "base_eval": base_eval}
        self.eval_reward = eval_reward
        self.samples_per_s: list[float] = []
        self.progress = progress
        self.task = progress.add_task(config.pipeline_name, total=last_step, reward=0.0, eval=self.eval_reward, sps=0.0)

    @classmethod
    def open(cls, config: PipelineConfig, run: RunDir, resume: Path | None, last_step: int, progress: Progress):
        """The pipeline's model: fresh, evaluated once before its first step, or from a checkpoint, whose state.json
        holds the run's base and latest evaluations (a resumed run reports the base its run started from). Returns
        the log and the number of steps already done."""
        local = FlowLocal(config) if config.kind == "flow" else LMLocal(config)
        state = None if resume is None else load_checkpoint(resume, local.model, local.optimizer, local.load_weights)
        run.begin(None if state is None else state["step"])
        run.write_config(dump_config(config))
        if state is None:
            base = local.evaluate(run, "eval_base.png")
            state = {"step": 0, "base_eval": base, "eval_reward": base["total"]}
        log = cls(run, config, local, last_step, state["base_eval"], state["eval_reward"], progress)
        progress.update(log.task, completed=state["step"])
        return log, state["step"]

    def checkpoint(self, done: int, extra: dict | None = None) -> Path:
        """Save step `done` with the run's base and latest evaluations, which a run resumed from it reports."""
        state = {"base_eval": self.summary["base_eval"], "eval_reward": self.eval_reward} | (extra or {})
        return self.run.save_checkpoint(done, self.model, self.optimizer, state, self.local.save_weights)

    def stop(self, done: int, error: RewardError) -> str:
        """Save step `done`, the last one completed, of a run whose reward failed; returns what to tell the user."""
        checkpoint = self.checkpoint(done)
        return (
            f"{error}; pipeline {self.config.pipeline_name} stopped, its last completed step is saved in {checkpoint}: "
            f"fix the reward and resume with `dovetail train {self.run.path / 'config.yaml'} --resume {self.run.path}`"
        )

    def needs_weights(self, done: int) -> bool:
        """Whether step `done` evaluates or checkpoints (the Ray driver then fetches the trainer state)."""
        return self._eval_due(done) or done % self.config.checkpoint.every == 0 or done == self.last_step

    def _eval_due(self, done: int) -> bool:
        return done % self.config.eval.every == 0 or done == self.last_step

    def record(self, done: int, metrics: dict, checkpoint_extra: dict | None = None) -> None:
        metrics = {"step": done} | metrics
        self.samples_per_s.append(metrics["samples_per_s"])
        if self._eval_due(done):
            start = time.perf_counter()
            eval_scores = self.local.evaluate(self.run, "eval_latest.png")
            self.eval_reward = eval_scores["total"]
            metrics |= {"eval_reward": self.eval_reward, "eval_s": time.perf_counter() - start}
            metrics |= {f"eval/{name}": value for name, value in eval_scores.items()}
        self.run.append_metrics(metrics)
        if done % self.config.checkpoint.every == 0 or done == self.last_step:
            self.checkpoint(done, checkpoint_extra)
        self.progress.update(
            self.task,
            completed=done,
            reward=metrics["reward/total"],
            eval=self.eval_reward,
            sps=metrics["samples_per_s"],
        )

    def finish(self, extra: dict | None = None) -> dict:
        """The pipeline's summary.json: its evaluations before and after, and its mean throughput."""
        mean_sps = float(np.mean(self.samples_per_s)) if self.samples_per_s else 0.0
        self.summary |= {"final_eval_reward": self.eval_reward, "steps": self.last_step, "samples_per_s": mean_sps}
        self.summary |= extra or {}
        self.run.write_summary(self.summary)
        return self.summary


class FlowLocal:
    """A flow run's model in this process: the reference loop trains it; evaluations and checkpoints read it."""

    save_weights = load_weights = None  # the run directory's default: the flow model's own format

    def __init__(self, config: FlowTrainConfig) -> None:
        self.config = config
        self.model = load_model(config.model.checkpoint)
        self.optimizer = make_optimizer(self.model, config)
        self._reference_model = None

    def evaluate(self, run: RunDir, grid: str) -> dict[str, float]:
        """ODE samples on the held-out seeds, drawn as one grid image."""
        scores, images, prompts = evaluate(self.model, self.config)
        run.save_eval_grid(images, prompts, grid)
        return scores

    def rl_step(self, step: int) -> dict:
        if self.config.algo.beta > 0 and self._reference_model is None:
            self._reference_model = load_model(self.config.model.checkpoint).requires_grad_(False)
        return rl_step(self.model, self.optimizer, self.config, step, self._reference_model)


class LMLocal:
    """A language-model run's engines in this process (trainer, rollout engine, rewards)."""

    def __init__(self, config: LMTrainConfig) -> None:
        self.config = config
        self.engines = LMEngines(config, torch.device("cpu"), True, None)
        self.model, self.optimizer = self.engines.trainer, self.engines.optimizer

    def evaluate(self, run: RunDir, grid: str) -> dict[str, float]:
        return lm_evaluate(self.engines, self.config)

    def rl_step(self, step: int) -> dict:
        return lm_rl_step(self.engines, self.config, step)

    def save_weights(self, directory: Path) -> None:
        save_lm(self.engines.trainer, self.engines.tokenizer, self.engines.lm_config, directory)

    @staticmethod
    def load_weights(directory: Path):
        return load_lm(directory)[0]


def train(
    config: TrainConfig,
    out: Path,
    *,
    steps: int | None = None,
    resume: Path | None = None,
    after_start=None,
    after_part=None,
) -> dict:
    """Train every pipeline of the run to `steps` (default config.train.steps) under config.policy; returns the
    summary. A multiplexed run keeps each pipeline in its own sub-directory of `out` (and resumes each from there).
    `after_start` / `after_part` are the Ray runtime's fault-injection hooks, for tests."""
    torch.set_num_threads(1)
    root = RunDir(out)
    multiplexed = isinstance(config, MultiplexConfig)
    last_step = steps if steps is not None else config.train.steps
    logs, first_steps = {}, {}
    with _progress() as progress:
        for name, pipeline in pipeline_configs(config).items():
            run = RunDir(root.path / name) if multiplexed else root
            checkpoint = None if resume is None else (Path(resume) / name if multiplexed else resume)
            logs[name], first_steps[name] = StepLog.open(pipeline, run, checkpoint, last_step, progress)
        if multiplexed:
            root.write_config(dump_config(config))
        if config.policy == "reference":
            (log,) = logs.values()
            for step in range(first_steps[log.config.pipeline_name], last_step):
                try:
                    metrics = log.local.rl_step(step)
                except RewardError as error:  # the step changed nothing yet: its reward comes before its training
                    raise RewardError(log.stop(step, error)) from error
                log.record(step + 1, metrics)
            run_figures = {}
        else:
            run_figures = train_on_ray(
                config, logs, first_steps, last_step, after_start=after_start, after_part=after_part
            )
    if not multiplexed:
        return next(iter(logs.values())).finish(run_figures)
    stopped = run_figures.get("stopped", {})
    summary = {
        "pipelines": {
            name: log.finish({"stopped": stopped[name]} if name in stopped else {}) for name, log in logs.items()
        }
    }
    summary |= run_figures
    root.write_summary(summary)
    return summary


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description} step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("reward {task.fields[reward]:.3f}  eval {task.fields[eval]:.3f}  {task.fields[sps]:.1f} samples/s"),
        TimeElapsedColumn(),
    )


def lm_rl_step(engines, config: LMTrainConfig, step: int) -> dict:
    """One on-policy GRPO step of the reference path, in this process, through the very work the Ray workers do:
    every response to the end, scores, one train pass over the whole batch, one optimizer step."""

    pipeline, algo = config.task, config.algo
    start = time.perf_counter()
    ids = [SampleId(step, p, i) for p in range(algo.prompts_per_step) for i in range(algo.group_size)]
    prompts = encode_prompts(config, engines.tokenizer, task_prompts(config, step))
    weights = weights_of(engines.trainer)
    started = engines.run(Prefill(pipeline, ids, [prompts[s.prompt] for s in ids], step, weights))
    responses = engines.run(Decode(pipeline, [started], config.max_new_tokens, weights))
    scores = engines.run(Score(pipeline, [responses], None))
    ref = [engines.run(LMLogProbs(pipeline, ids, [responses], True))] if algo.beta > 0 else []
    engines.trainer.zero_grad(set_to_none=True)
    trained = engines.run(LMTrain(pipeline, ids, False, [responses], [scores], ref_log_probs=ref))
    for p in engines.trainer.parameters():
        if p.grad is not None:
            p.grad /= trained.normaliser
    grad_norm = commit(engines.trainer, engines.optimizer, config.train.max_grad_norm)
    seconds = time.perf_counter() - start
    return lm_step_metrics(config, [scores], [trained]) | {
        "grad_norm": grad_norm,
        "samples_per_s": len(ids) / seconds,
        "step_s": seconds,
    }


def lm_evaluate(engines, config: LMTrainConfig) -> dict[str, float]:
    """Held-out success: one response per eval-split prompt, sampled as in training from the eval seed."""

    the_task = task(config.task)
    prompts = the_task.prompts("eval", config.eval.seed, 0, config.eval.prompts)
    engine = TorchEngine.from_model(
        engines.trainer, sampling_params(config, engines.tokenizer.eos_id, seed=config.eval.seed), max_batch=64
    )
    encoded = encode_prompts(config, engines.tokenizer, prompts)
    requests = [Request((0, i, 0), ids) for i, ids in enumerate(encoded)]
    completions = [engines.tokenizer.decode(r.tokens) for r in engine.generate(requests)]
    scores = score_text(completions, prompts, config.rewards, config.reward_timeout_s)
    return {"total": success_rate(config, completions, prompts)} | {
        f"reward/{name}": float(values.mean()) for name, values in scores.items()
    }
