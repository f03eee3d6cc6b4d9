"""The reference RL loop (`policy: reference`): one process, no Ray, every step in order.

prompts -> G samples per prompt (SDE) -> rewards -> advantages -> train the selected timesteps
(batched) -> one optimizer step. Every other policy must reproduce these parameters.
"""

import copy
import json
import time
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from dovetail.algo import group_advantages, select_train_timesteps
from dovetail.config.train import TrainConfig, dump_config
from dovetail.models.flow_rl import SDESettings, accumulate_policy_gradient, commit, generate, group_sample_ids, step_prompts
from dovetail.models.pretrain import latents_to_images
from dovetail.models.sampling import keyed_normal, sample_key, sample_ode
from dovetail.models.t2i import flow_sigmas, load_model
from dovetail.rewards import score
from dovetail.run_dir import RunDir


def sde_settings(config: TrainConfig) -> SDESettings:
    return SDESettings(
        flow_sigmas(config.sampling.num_steps, config.sampling.shift), config.noise_level, config.sde_kind
    )


def step_timesteps(config: TrainConfig, step: int) -> list[int]:
    generator = torch.Generator().manual_seed(sample_key(config.seed, "timesteps", step))
    return select_train_timesteps(
        config.sampling.num_steps, fraction=config.algo.timestep_fraction, mode=config.timestep_mode, generator=generator
    )


def evaluate(model, config: TrainConfig) -> tuple[dict[str, float], np.ndarray, list[str]]:
    """ODE samples on fixed held-out seeds, the same at every evaluation."""
    prompts = [f"digit {d}" for d in range(10) for _ in range(config.eval.per_digit)]
    noise = keyed_normal([sample_key(config.eval.seed, i) for i in range(len(prompts))], model.latent_shape)
    images = latents_to_images(sample_ode(model, prompts, sde_settings(config).sigmas, noise))
    scores = score(images, prompts, config.reward)
    return {name: float(values.mean()) for name, values in scores.items()}, images, prompts


def rl_step(model, optimizer, config: TrainConfig, step: int, reference_model=None) -> dict:
    """One on-policy step of the reference path; returns its metrics."""
    sde = sde_settings(config)
    algo = config.algo
    timings = {}

    start = time.perf_counter()
    prompts = step_prompts(config.seed, step, algo.prompts_per_step)
    ids = group_sample_ids(step, list(range(algo.prompts_per_step)), algo.group_size)
    sample_prompts = [prompts[s.prompt] for s in ids]
    trajectories = generate(model, sample_prompts, ids, sde, seed=config.seed, shared_group_noise=config.shared_group_noise)
    timings["generate_s"] = time.perf_counter() - start

    start = time.perf_counter()
    rewards = score(latents_to_images(trajectories.images), sample_prompts, config.reward)
    advantages = group_advantages(
        torch.tensor(rewards["total"]), torch.tensor([s.prompt for s in ids]),
        std_scope=algo.std_scope, clip=algo.adv_clip,
    )
    timings["score_s"] = time.perf_counter() - start

    start = time.perf_counter()
    timesteps = step_timesteps(config, step)
    total_pairs = len(ids) * len(timesteps)
    sums = accumulate_policy_gradient(
        model, trajectories, advantages, timesteps, sde, chunk_size=config.train.chunk_size, total_pairs=total_pairs,
        clip_range=algo.clip_range, beta=algo.beta, reference_model=reference_model,
    )
    timings["train_s"] = time.perf_counter() - start

    start = time.perf_counter()
    grad_norm = commit(model, optimizer, config.train.max_grad_norm)
    timings["commit_s"] = time.perf_counter() - start

    step_seconds = sum(timings.values())
    metrics = {f"reward/{name}": float(values.mean()) for name, values in rewards.items()}
    metrics |= {name: value if name in ("ratio_min", "ratio_max") else value / total_pairs for name, value in sums.items()}
    metrics |= timings | {"grad_norm": grad_norm, "samples_per_s": len(ids) / step_seconds, "timesteps": timesteps}
    return metrics


def make_optimizer(model, config: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=config.train.lr, weight_decay=config.train.weight_decay)


def train(config: TrainConfig, out: Path, *, steps: int | None = None, resume: Path | None = None) -> dict:
    """Run the reference loop to `steps` (default config.train.steps); returns the summary."""
    torch.set_num_threads(1)
    run = RunDir(out)
    model = load_model(config.model.checkpoint)
    optimizer = make_optimizer(model, config)
    reference_model = copy.deepcopy(model).requires_grad_(False) if config.algo.beta > 0 else None
    first_step = 0
    if resume is not None:
        first_step = run.load_checkpoint(resume, model, optimizer)
    run.write_config(dump_config(config))
    last_step = steps if steps is not None else config.train.steps

    summary = run.read_summary()
    if "base_eval_reward" not in summary:
        base, images, prompts = evaluate(model, config)
        summary |= {"base_eval_reward": base["total"], "base_eval": base}
        run.save_eval_grid(images, prompts, "eval_base.png")

    eval_reward = summary.get("final_eval_reward", summary["base_eval_reward"])
    samples_per_s = []
    with Progress(
        TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
        TextColumn("reward {task.fields[reward]:.3f}  eval {task.fields[eval]:.3f}  {task.fields[sps]:.1f} samples/s"),
        TimeElapsedColumn(),
    ) as progress:
        task = progress.add_task("train", total=last_step, completed=first_step, reward=0.0, eval=eval_reward, sps=0.0)
        for step in range(first_step, last_step):
            metrics = {"step": step + 1} | rl_step(model, optimizer, config, step, reference_model)
            samples_per_s.append(metrics["samples_per_s"])
            done = step + 1
            if done % config.eval.every == 0 or done == last_step:
                start = time.perf_counter()
                eval_scores, images, prompts = evaluate(model, config)
                eval_reward = eval_scores["total"]
                metrics |= {"eval_reward": eval_reward, "eval_s": time.perf_counter() - start}
                metrics |= {f"eval/{name}": value for name, value in eval_scores.items()}
                run.save_eval_grid(images, prompts, "eval_latest.png")
            run.append_metrics(metrics)
            if done % config.checkpoint.every == 0 or done == last_step:
                run.save_checkpoint(done, model, optimizer)
            progress.update(task, completed=done, reward=metrics["reward/total"], eval=eval_reward, sps=metrics["samples_per_s"])

    summary |= {
        "final_eval_reward": eval_reward,
        "steps": last_step,
        "samples_per_s": float(np.mean(samples_per_s)) if samples_per_s else summary.get("samples_per_s", 0.0),
    }
    run.write_summary(summary)
    return summary
