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

from dovetail.models.diffusers_flow import checkpoint_io, load_decoder, load_flow_model
from dovetail.models.flow_rl import generate, group_sample_ids, step_prompts
from dovetail.models.memory import memory_by_kind, peak_bytes
from dovetail.models.t2i import latents_to_images
from dovetail.models.training import (
    commit,
    load_trainer_state,
    make_optimizer,
    stepped_lr,
    tensors_of,
    trainer_state_of,
    weights_of,
)
from dovetail.pipelines.flow.adapter import further_update_metrics
from dovetail.pipelines.flow.config import FlowTrainConfig, flow_rules
from dovetail.pipelines.flow.ema import EMA_KEY, load_ema, trained_parameters, update_ema, weight_ema, with_ema
from dovetail.pipelines.flow.old_policy import load_old_policy, old_policy, update_old_policy, with_old_policy
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
from dovetail.runtime.messages import DeviceMemory, FurtherUpdate, Trained
from dovetail.runtime.pipeline import SAMPLING_WEIGHTS_KEY, memory_figures
from dovetail.trackers import Evaluation


def rl_step(
    model,
    optimizer,
    config: FlowTrainConfig,
    step: int,
    reference_model=None,
    decode=latents_to_images,
    after_commit=lambda: None,
    old_model=None,
) -> dict:
    """One on-policy step of the reference path; returns its metrics. `decode` turns latents into the images the
    rewards score; `after_commit()` runs after each optimizer step (eval.ema's update, DiffusionNFT's old policy).
    With algo.num_iterations the batch's gradient is computed again after each update, on the weights it left, the
    old log-probs still the rollout's, as a Ray trainer's commit does (`runtime.worker`). `old_model`: DiffusionNFT's
    old policy, which samples the rollouts and gives the loss its v_old (`pipelines.flow.old_policy`)."""
    sde, rules = sde_settings(config), flow_rules(config)
    algo = config.algo
    timings = {}

    start = time.perf_counter()
    prompts = step_prompts(config.seed, step, algo.prompts_per_step, train_prompts(config))
    ids = group_sample_ids(step, list(range(algo.prompts_per_step)), algo.group_size)
    sample_prompts = [prompts[s.prompt] for s in ids]
    trajectories = generate(
        model if old_model is None else old_model,
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

    def train() -> dict[str, float]:
        return policy_gradient(
            model,
            trajectories,
            advantages,
            timesteps,
            sde,
            config,
            total_pairs=total_pairs,
            reference_model=reference_model,
            samples=ids,
            old_model=old_model,
        )

    sums = train()
    timings["train_s"] = time.perf_counter() - start

    gradients = memory_by_kind(model)["gradients"]
    start = time.perf_counter()
    grad_norm = commit(model, optimizer, config.train, algo.num_iterations)
    after_commit()
    further = []
    for _ in range(algo.num_iterations - 1):
        again = Trained(ids, list(range(len(timesteps[0]))), train())
        further.append(FurtherUpdate(commit(model, optimizer, config.train, algo.num_iterations), [again]))
        after_commit()
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
    metrics |= further_update_metrics([further])
    if not algo.per_sample_timesteps and config.algorithm != "diffusion_nft":
        metrics["timesteps"] = timesteps[0]
    return metrics | {"samples_per_s": len(ids) / step_seconds, "step_s": step_seconds} | memory_figures([memory])


OLD_POLICY_FILE = "old_policy.safetensors"
"""A DiffusionNFT checkpoint's old policy (`pipelines.flow.old_policy`), beside its weights, so that a resumed run
samples with it."""

EMA_FILE = "ema.safetensors"
"""A checkpoint's EMA of the trained weights (eval.ema), beside its weights: the trainable parameters by name."""


class FlowLocal:
    """A flow run's model in this process: the reference loop trains it; evaluations and checkpoints read it.
    With eval.ema it holds the EMA of the trained weights (`pipelines.flow.ema`), evaluated in their place and
    checkpointed (EMA_FILE) so that a resumed run averages on as the uninterrupted one. The reference loop updates it
    after each optimizer step here; under a Ray policy the trainers keep it beside their weights, and it comes with
    their committed state (`load_trainer_state`)."""

    def __init__(self, config: FlowTrainConfig) -> None:
        self.config = config
        self.model = load_flow_model(config)
        self.decode = load_decoder(config)
        self.optimizer = make_optimizer(self.model, config.train)
        save_weights, load_weights = checkpoint_io(config, self.model)
        self.ema = weight_ema(config, self.model)
        self.old_policy = old_policy(config, self.model)
        self._save, self._load = save_weights, load_weights
        self._reference_model = None

    def save_weights(self, directory: Path) -> None:
        self._save(directory)
        if self.ema is not None:
            save_file(
                {name: t.detach().cpu().contiguous() for name, t in self.ema.shadow.items()}, str(directory / EMA_FILE)
            )
        if self.old_policy is not None:
            save_file(tensors_of(weights_of(self.old_policy)), str(directory / OLD_POLICY_FILE))

    def load_weights(self, directory: Path):
        """The checkpoint's model (`checkpoint_io`'s loader); its EMA too where eval.ema keeps one, or, from a
        checkpoint of a run without one, an EMA that starts at its weights."""
        loaded = self._load(directory)
        saved = load_file(directory / EMA_FILE) if (directory / EMA_FILE).is_file() else None
        load_ema(self.ema, saved, loaded)
        old = directory / OLD_POLICY_FILE
        load_old_policy(self.old_policy, load_file(old) if old.is_file() else None, loaded)
        return loaded

    def trainer_state(self) -> dict:
        """The weights, optimizer state, EMA and old policy as numpy: what the Ray trainers start from."""
        return with_old_policy(with_ema(trainer_state_of(self.model, self.optimizer), self.ema), self.old_policy)

    def load_trainer_state(self, state: dict) -> None:
        """A trainer's committed state (weights, optimizer, and its EMA) into this process's model."""
        load_trainer_state(self.model, self.optimizer, state)
        load_ema(self.ema, state.get(EMA_KEY), self.model)
        load_old_policy(self.old_policy, state.get(SAMPLING_WEIGHTS_KEY), self.model)

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
        return rl_step(
            self.model,
            self.optimizer,
            self.config,
            step,
            self._reference_model,
            self.decode,
            self._after_commit,
            self.old_policy,
        )

    def _after_commit(self) -> None:
        update_ema(self.ema, self.model, self.optimizer)
        update_old_policy(self.config, self.old_policy, self.model, self.optimizer)
