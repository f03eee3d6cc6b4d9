"""A flow run's model in this process (`FlowLocal`: the pipeline kind's `local`): the reference loop trains it through
`rl_step`, and under a Ray policy the driver's evaluations and checkpoints read it. Loaded by the kind's registry, so a
language-model run never imports the flow stack.

prompts -> G samples per prompt (SDE) -> rewards -> advantages -> train the selected timesteps (batched) -> one
optimizer step. Every other policy must reproduce these parameters.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dovetail.algo import WeightEMA
from dovetail.models.diffusers_flow import checkpoint_io, load_decoder, load_flow_model
from dovetail.models.flow_rl import generate, group_sample_ids, step_prompts
from dovetail.models.memory import memory_by_kind, peak_bytes
from dovetail.models.t2i import latents_to_images
from dovetail.models.training import commit, load_trainer_state, make_optimizer, stepped_lr, trainer_state_of
from dovetail.pipelines.flow.config import FlowTrainConfig, flow_rules
from dovetail.pipelines.flow.recipe import (
    advantages_of,
    evaluate,
    policy_gradient,
    sample_timesteps,
    sde_settings,
    sde_steps,
)
from dovetail.prompts import train_prompts
from dovetail.rewards import score
from dovetail.run_dir import (
    RunDir,
)
from dovetail.runtime.messages import DeviceMemory
from dovetail.runtime.pipeline import memory_figures
from dovetail.trackers import Evaluation


def rl_step(
    model, optimizer, config: FlowTrainConfig, step: int, reference_model=None, decode=latents_to_images
) -> dict:
    """One on-policy step of the reference path; returns its metrics. `decode` turns latents into the images the
    rewards score."""
    sde, rules = sde_settings(config), flow_rules(config)
    algo = config.algo
    timings = {}

    start = time.perf_counter()
    prompts = step_prompts(config.seed, step, algo.prompts_per_step, train_prompts(config))
    ids = group_sample_ids(step, list(range(algo.prompts_per_step)), algo.group_size)
    sample_prompts = [prompts[s.prompt] for s in ids]
    trajectories = generate(
        model,
        sample_prompts,
        ids,
        sde,
        seed=config.seed,
        shared_group_noise=rules.shared_group_noise,
        sde_steps=sde_steps(config, ids),
    )
    timings["generate_s"] = time.perf_counter() - start

    start = time.perf_counter()
    sources = config.reward_sources(str(model.device))
    rewards = score(decode(trajectories.images), sample_prompts, config.reward, config.reward_timeout_s, sources)
    advantages = advantages_of(config, rewards["total"], [s.prompt for s in ids], sample_prompts)
    timings["score_s"] = time.perf_counter() - start

    start = time.perf_counter()
    timesteps = [sample_timesteps(config, s) for s in ids]
    total_pairs = rules.pairs_per_step
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

    gradients = memory_by_kind(model)["gradients"]
    start = time.perf_counter()
    grad_norm = commit(model, optimizer, config.train)
    timings["commit_s"] = time.perf_counter() - start
    held = memory_by_kind(model, optimizer)  # after the step: AdamW makes its moments at its first
    device = next(model.parameters()).device
    memory = DeviceMemory(held["parameters"], gradients, held["optimizer"], 0, peak_bytes(device))

    step_seconds = sum(timings.values())
    metrics: dict[str, float | list[int]] = {f"reward/{name}": float(values.mean()) for name, values in rewards.items()}
    metrics |= {
        name: value if name in ("ratio_min", "ratio_max") else value / total_pairs for name, value in sums.items()
    }
    metrics |= timings | {"grad_norm": grad_norm, "learning_rate": stepped_lr(optimizer)}
    if not algo.per_sample_timesteps:
        metrics["timesteps"] = timesteps[0]
    return metrics | {"samples_per_s": len(ids) / step_seconds, "step_s": step_seconds} | memory_figures([memory])


EMA_FILE = "ema.safetensors"
"""A checkpoint's EMA of the trained weights (eval.ema), beside its weights: the trainable parameters by name."""


def trained_parameters(model) -> dict[str, torch.Tensor]:
    """The parameters that train (a LoRA run's adapter alone), by name: what eval.ema averages."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


class FlowLocal:
    """A flow run's model in this process: the reference loop trains it; evaluations and checkpoints read it.
    With eval.ema it keeps the EMA of the trained weights (`algo.WeightEMA`), updated after each optimizer step,
    evaluated in their place, and checkpointed (EMA_FILE) so that a resumed run averages on as the uninterrupted
    one; only the reference loop steps the weights here (the config refuses eval.ema under a Ray policy)."""

    def __init__(self, config: FlowTrainConfig) -> None:
        self.config = config
        self.model = load_flow_model(config)
        self.decode = load_decoder(config)
        self.optimizer = make_optimizer(self.model, config.train)
        save_weights, load_weights = checkpoint_io(config, self.model)
        ema = config.eval.ema
        self.ema = None if ema is None else WeightEMA(trained_parameters(self.model), ema.decay, ema.every)
        self._save, self._load = save_weights, load_weights
        self._reference_model = None

    def trainer_state(self) -> dict:
        """The weights and optimizer state the Ray trainers start from (`models.training.trainer_state_of`)."""
        return trainer_state_of(self.model, self.optimizer)

    def load_trainer_state(self, state: dict) -> None:
        load_trainer_state(self.model, self.optimizer, state)

    def save_weights(self, directory: Path) -> None:
        self._save(directory)
        if self.ema is not None:
            save_file(
                {name: t.detach().cpu().contiguous() for name, t in self.ema.shadow.items()}, str(directory / EMA_FILE)
            )

    def load_weights(self, directory: Path):
        """The checkpoint's model (`checkpoint_io`'s loader); its EMA too where eval.ema keeps one, or, from a
        checkpoint of a run without one, an EMA that starts at its weights."""
        loaded = self._load(directory)
        if self.ema is not None:
            saved = load_file(directory / EMA_FILE) if (directory / EMA_FILE).is_file() else trained_parameters(loaded)
            self.ema.shadow = {
                name: saved[name].detach().to(t.device, copy=True) for name, t in self.ema.shadow.items()
            }
        return loaded

    @contextmanager
    def _evaluated_weights(self) -> Iterator[None]:
        """The EMA in place of the trained weights while evaluating (Flow-GRPO's copy_ema_to / copy_temp_to)."""
        if self.ema is None:
            yield
            return
        parameters = trained_parameters(self.model)
        kept = {name: p.detach().clone() for name, p in parameters.items()}
        with torch.no_grad():
            for name, p in parameters.items():
                p.copy_(self.ema.shadow[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in parameters.items():
                    p.copy_(kept[name])

    def evaluate(self, run: RunDir, grid: str, step: int) -> Evaluation:
        """ODE samples on the held-out seeds (of the EMA's weights with eval.ema), drawn as one grid image."""
        with self._evaluated_weights():
            scores, images, prompts = evaluate(self.model, self.config, self.decode)
        evaluation = Evaluation(step, scores, image=run.path / grid)
        run.save_eval_grid(images, prompts, grid, evaluation.caption)
        return evaluation

    def rl_step(self, step: int) -> dict:
        if self.config.algo.beta > 0 and self._reference_model is None:
            self._reference_model = load_flow_model(self.config).requires_grad_(False)
        metrics = rl_step(self.model, self.optimizer, self.config, step, self._reference_model, self.decode)
        if self.ema is not None:
            self.ema.update(trained_parameters(self.model), step + 1)
        return metrics
