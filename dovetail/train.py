"""The reference RL loop (`policy: reference`): one process, no Ray, every step in order.

prompts -> G samples per prompt (SDE) -> rewards -> advantages -> train the selected timesteps
(batched) -> one optimizer step. Every other policy must reproduce these parameters.
"""

import time
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from dovetail.config.train import FlowTrainConfig, dump_config
from dovetail.models.flow_rl import commit, generate, group_sample_ids, step_prompts
from dovetail.models.pretrain import latents_to_images
from dovetail.models.t2i import load_model
from dovetail.recipe import advantages_of, evaluate, make_optimizer, policy_gradient, sde_settings, step_timesteps
from dovetail.rewards import score
from dovetail.run_dir import RunDir


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
    rewards = score(latents_to_images(trajectories.images), sample_prompts, config.reward)
    advantages = advantages_of(config, rewards["total"], [s.prompt for s in ids])
    timings["score_s"] = time.perf_counter() - start

    start = time.perf_counter()
    timesteps = step_timesteps(config, step)
    total_pairs = len(ids) * len(timesteps)
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
    """What happens after every optimizer step, whoever ran it: metrics, evaluation, checkpoints, progress."""

    def __init__(
        self,
        run: RunDir,
        config: FlowTrainConfig,
        model,
        optimizer,
        last_step: int,
        eval_reward: float,
        progress: Progress,
    ):
        self.run, self.config, self.model, self.optimizer = run, config, model, optimizer
        self.last_step = last_step
        self.eval_reward = eval_reward
        self.samples_per_s: list[float] = []
        self.progress = progress
        self.task = progress.add_task("train", total=last_step, reward=0.0, eval=eval_reward, sps=0.0)

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
            eval_scores, images, prompts = evaluate(self.model, self.config)
            self.eval_reward = eval_scores["total"]
            metrics |= {"eval_reward": self.eval_reward, "eval_s": time.perf_counter() - start}
            metrics |= {f"eval/{name}": value for name, value in eval_scores.items()}
            self.run.save_eval_grid(images, prompts, "eval_latest.png")
        self.run.append_metrics(metrics)
        if done % self.config.checkpoint.every == 0 or done == self.last_step:
            self.run.save_checkpoint(done, self.model, self.optimizer, checkpoint_extra)
        self.progress.update(
            self.task,
            completed=done,
            reward=metrics["reward/total"],
            eval=self.eval_reward,
            sps=metrics["samples_per_s"],
        )


def train(
    config: FlowTrainConfig, out: Path, *, steps: int | None = None, resume: Path | None = None, after_part=None
) -> dict:
    """Train to `steps` (default config.train.steps) under config.policy; returns the summary.
    `after_part` is the Ray executor's fault-injection hook, for tests."""
    torch.set_num_threads(1)
    run = RunDir(out)
    model = load_model(config.model.checkpoint)
    optimizer = make_optimizer(model, config)
    first_step = 0
    if resume is not None:
        first_step = run.load_checkpoint(resume, model, optimizer)
    else:
        run.start_fresh()
    run.write_config(dump_config(config))
    last_step = steps if steps is not None else config.train.steps

    summary = run.read_summary()
    if "base_eval_reward" not in summary:
        base, images, prompts = evaluate(model, config)
        summary |= {"base_eval_reward": base["total"], "base_eval": base}
        run.save_eval_grid(images, prompts, "eval_base.png")

    with Progress(
        TextColumn("[bold]step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("reward {task.fields[reward]:.3f}  eval {task.fields[eval]:.3f}  {task.fields[sps]:.1f} samples/s"),
        TimeElapsedColumn(),
    ) as progress:
        log = StepLog(
            run,
            config,
            model,
            optimizer,
            last_step,
            summary.get("final_eval_reward", summary["base_eval_reward"]),
            progress,
        )
        progress.update(log.task, completed=first_step)
        if config.policy == "reference":
            reference_model = (
                load_model(config.model.checkpoint).requires_grad_(False) if config.algo.beta > 0 else None
            )
            for step in range(first_step, last_step):
                log.record(step + 1, rl_step(model, optimizer, config, step, reference_model))
        else:
            from dovetail.exec.driver import train_on_ray

            summary |= train_on_ray(config, log, first_step, last_step, after_part=after_part)

    summary |= {
        "final_eval_reward": log.eval_reward,
        "steps": last_step,
        "samples_per_s": float(np.mean(log.samples_per_s)) if log.samples_per_s else summary.get("samples_per_s", 0.0),
    }
    run.write_summary(summary)
    return summary
