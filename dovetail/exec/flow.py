"""Flow pipelines (FlowGRPO / DanceGRPO) on the Ray runtime: the driver's adapter and the worker's engines.

`FlowAdapter` turns a node of `graph.flow` into typed work for the devices the policy chose (generate, score,
old log-probs, train) and books what comes back; `FlowEngines` does that work on one device with a rollout copy of
the policy, the trainer (weights + optimizer) and the reward engine. The math is the reference loop's
(`models.flow_rl`, `recipe`): every random draw is keyed by the sample, so any split gives the same numbers.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from dovetail.config.flow import FlowTrainConfig
from dovetail.cost.calibration import DEFAULT
from dovetail.cost.catalog import diffusion_model
from dovetail.cost.model import CostModel
from dovetail.exec.interference import Span, time_work
from dovetail.exec.messages import (
    FlowLogProbs,
    FlowTrain,
    Generate,
    LogProbs,
    Score,
    Scores,
    Trained,
    Trajectories,
    Work,
)
from dovetail.exec.pipeline import PROFILE_ROUNDS, Part, PipelineAdapter, PipelineEngines, RunContext
from dovetail.exec.plan import rollout_wake_s
from dovetail.graph.node import Kind, Node, SampleId
from dovetail.models import sampling
from dovetail.models.diffusers_flow import (
    check_prompt_table,
    export,
    load_decoder,
    load_diffusers_checkpoint,
    load_flow_model,
)
from dovetail.models.flow_rl import accumulate_policy_gradient, generate, recompute_log_probs, step_prompts
from dovetail.models.training import commit, load_weights, synchronize, weights_of
from dovetail.prompts import prompt_split, train_prompts
from dovetail.recipe import advantages_of, make_optimizer, policy_gradient, sample_timesteps, sde_settings, sde_steps
from dovetail.rewards import load_rewards, score
from dovetail.run_dir import load_checkpoint
from dovetail.scenario import Scenario

STAT_MEANS = ("clip_frac", "approx_kl", "ratio_mean", "loss", "kl_ref")
"""Loss statistics the train parts sum over their (sample, timestep) pairs, reported as means."""


def pack(trajectories: sampling.Trajectories, ids: list[SampleId], version: int) -> Trajectories:
    return Trajectories(
        samples=list(ids),
        version=version,
        prompts=trajectories.prompts,
        prompt_ids=trajectories.prompt_ids.cpu().numpy(),
        latents=trajectories.latents.cpu().numpy(),
        log_probs=trajectories.log_probs.cpu().numpy(),
    )


def unpack(parts: list[Trajectories], sigmas: torch.Tensor) -> tuple[sampling.Trajectories, list[SampleId]]:
    """Packed parts joined into one batch, on the device of `sigmas`."""

    def tensor(array):
        return torch.tensor(array, device=sigmas.device)

    joined = sampling.Trajectories.concat(
        [
            sampling.Trajectories(p.prompts, tensor(p.prompt_ids), tensor(p.latents), tensor(p.log_probs), sigmas)
            for p in parts
        ]
    )
    return joined, [SampleId(*s) for p in parts for s in p.samples]


class FlowEngines(PipelineEngines):
    """A flow pipeline's engines on one device: trainer (weights + optimizer), a rollout copy at some published
    version, the frozen reference (KL) and the reward judge. A device of the reward pool holds the judge alone."""

    def __init__(self, config: FlowTrainConfig, device: torch.device, holds_policy: bool, trainer_state: dict):
        super().__init__(config, device)
        self.sde = sde_settings(config, device)
        self.decode = load_decoder(config, device)
        load_rewards(config.reward)
        if not holds_policy:
            return
        self.trainer = load_flow_model(config).to(device)
        self.optimizer = make_optimizer(self.trainer, config)
        self.load_trainer_state(trainer_state)
        if config.algo.beta > 0:
            self.reference = load_flow_model(config).to(device).requires_grad_(False)
        self.rollout = copy.deepcopy(self.trainer).requires_grad_(False)

    def load_rollout(self, weights: dict) -> None:
        load_weights(self.rollout, weights)

    def run(self, work: Work):
        config = self.config
        if isinstance(work, Generate):
            self.load_rollout_weights(work.version, work.weights)
            trajectories = generate(
                self.rollout,
                work.prompts,
                work.samples,
                self.sde,
                seed=config.seed,
                shared_group_noise=config.shared_group_noise,
                sde_steps=sde_steps(config, work.samples),
            )
            return pack(trajectories, work.samples, work.version)
        if isinstance(work, Score):
            trajectories, ids = unpack(self.fetch(work.rollouts), self.sde.sigmas)
            images = self.decode(trajectories.images)
            return Scores(ids, score(images, trajectories.prompts, config.reward, config.reward_timeout_s))
        if isinstance(work, FlowLogProbs):
            trajectories, ids = unpack(self.fetch(work.trajectories), self.sde.sigmas)
            timesteps = self._timesteps(ids, work.units)
            log_probs = recompute_log_probs(self.trainer, trajectories, timesteps, self.sde).cpu().numpy()
            return LogProbs(ids, list(log_probs))
        if isinstance(work, FlowTrain):
            return self._train(work)
        raise TypeError(f"flow engines cannot do {type(work).__name__}")

    def _train(self, work: FlowTrain) -> Trained:
        trajectories, ids = unpack(self.fetch(work.trajectories), self.sde.sigmas)
        position = {sample: row for row, sample in enumerate(ids)}
        rows = [position[SampleId(*sample)] for sample in work.samples]
        rewards = np.zeros(len(ids))
        for part in self.fetch(work.scores):
            rewards[[position[SampleId(*s)] for s in part.samples]] = part.scores["total"]
        for part in self.fetch(work.old_log_probs):
            for sample, log_probs in zip(part.samples, part.log_probs):
                trajectories.log_probs[position[SampleId(*sample)]] = torch.from_numpy(log_probs).to(self.device)
        advantages = advantages_of(self.config, rewards, [sample.prompt for sample in ids], trajectories.prompts)
        sums = policy_gradient(
            self.trainer,
            trajectories.select(rows),
            advantages[rows],
            self._timesteps([ids[r] for r in rows], work.units),
            self.sde,
            self.config,
            total_pairs=work.total_pairs,
            reference_model=self.reference,
            stale=work.stale,
        )
        return Trained([ids[r] for r in rows], work.units, sums)

    def _timesteps(self, samples: list[SampleId], units: list[int]) -> list[list[int]]:
        """Each sample's trained timesteps at positions `units` of its own list (`sample_timesteps`)."""
        return [[sample_timesteps(self.config, sample)[u] for u in units] for sample in samples]

    def profile(self, samples: int, carry: Callable[[dict], dict]) -> dict[str, float]:
        return profile_work(self.trainer, self.decode, self.config, self.sde, samples, carry)

    def time_kind(self, kind: str, samples: int, repeats: int, carry: Callable[[dict], dict]) -> list[Span]:
        works = profile_works(self.trainer, self.decode, self.config, self.sde, samples, carry)
        return time_work(works, kind, repeats, self.device)


def profile_works(
    model, decode, config: FlowTrainConfig, sde, n: int, carry: Callable[[dict], dict]
) -> dict[str, Callable[[dict], object]]:
    """The start-up profile's work of each kind, in the order it runs, each taking the earlier ones' results by kind,
    on throw-away copies of `model` (trainer, optimizer, rollout copy) and `n` samples of RL step -1: generation,
    score, log-probs, a train and an optimizer step, and a publication from the trainer to the loaded rollout copy
    (`carry` moves the weights between them: the object store, or pickle in a dry run)."""
    trainer = copy.deepcopy(model)
    rollout = copy.deepcopy(model).requires_grad_(False)
    optimizer = make_optimizer(trainer, config)
    train = train_prompts(config)
    prompts = [train[p % len(train)] for p in range(n)]
    ids = [SampleId(-1, p, 0) for p in range(n)]

    def logprob(done: dict) -> torch.Tensor:
        with torch.no_grad():
            return trainer(done["generate"].latents[:, 0], sde.sigmas[:1].expand(n), done["generate"].prompt_ids)

    def train(done: dict) -> dict[str, float]:
        return accumulate_policy_gradient(
            trainer,
            done["generate"],
            torch.ones(n, device=trainer.device),
            [0],
            sde,
            chunk_size=n,
            total_pairs=n,
            clip_range=config.algo.clip_range,
        )

    return {
        "generate": lambda done: generate(trainer, prompts, ids, sde, seed=config.seed, shared_group_noise=False),
        "score": lambda done: score(decode(done["generate"].images), prompts, config.reward, config.reward_timeout_s),
        "logprob": logprob,
        "train": train,
        "optimizer": lambda done: commit(trainer, optimizer, config.train.max_grad_norm),
        "publish": lambda done: load_weights(rollout, carry(weights_of(trainer))),
    }


def profile_work(
    model, decode, config: FlowTrainConfig, sde, samples: int, carry: Callable[[dict], dict]
) -> dict[str, float]:
    """Measured seconds of each kind of work on `model`'s device (`profile_works`): what the cost model is fitted
    to before planning. A small untimed round first takes the one-off costs (the judge is fitted on first use,
    first-call allocations); generation is then timed at two batch sizes, which pins down the fixed cost of a small
    pass (from the fastest rounds: interference only adds time); every other time is the median of PROFILE_ROUNDS."""

    def one_of_each(n: int) -> dict[str, float]:
        seconds, done = {}, {}
        for name, work in profile_works(model, decode, config, sde, n, carry).items():
            synchronize(model.device)
            start = time.perf_counter()
            done[name] = work(done)
            synchronize(model.device)
            seconds[name] = time.perf_counter() - start
        return seconds

    small = max(1, samples // 4)
    one_of_each(small)
    rounds = [(one_of_each(samples), one_of_each(small)) for _ in range(PROFILE_ROUNDS)]
    seconds = {name: statistics.median(full[name] for full, _ in rounds) for name in rounds[0][0]}
    return seconds | {
        "generate_fastest": min(full["generate"] for full, _ in rounds),
        "generate_small_fastest": min(part["generate"] for _, part in rounds),
    }


class FlowAdapter(PipelineAdapter):
    """The driver side of a flow pipeline: node -> typed work per device, results -> the sample ledger."""

    def __init__(self, config: FlowTrainConfig, first_step: int) -> None:
        super().__init__(config, first_step)
        self._prompts: dict[int, list[str]] = {}

    def units_of(self, sample: SampleId) -> list[int]:
        """Positions in the sample's trained timesteps (`sample_timesteps`): the engines look the timesteps up
        from the sample's identity, so samples that train different timesteps share one train node's chunk."""
        return list(range(self.config.trained_timesteps))

    def parts(self, node: Node, devices: tuple[int, ...], run: RunContext) -> list[Part]:
        step = self.rl_step(node)
        pipeline = node.pipeline
        if node.kind == Kind.GENERATE:
            prompts = self._prompts.setdefault(
                step,
                step_prompts(self.config.seed, step, self.config.algo.prompts_per_step, train_prompts(self.config)),
            )
            samples = [SampleId(step, p, i) for (_, p, i) in node.samples]
            version = run.rollout_version(pipeline, node.step)
            weights = run.weights(pipeline, version)
            return [
                Part(
                    node.id,
                    device,
                    Generate(pipeline, ids, [prompts[s.prompt] for s in ids], self.first_step + version, weights),
                )
                for device, ids in self.spread(samples, devices)
            ]
        sources = run.sources(node, (Kind.GENERATE, Kind.SCORE, Kind.LOGPROB))
        trajectories = sources[Kind.GENERATE]
        if node.kind == Kind.SCORE:
            return [Part(node.id, d, Score(pipeline, refs)) for d, refs in self.spread(trajectories, devices)]
        units = list(range(self.config.trained_timesteps))
        if node.kind == Kind.LOGPROB:
            return [
                Part(node.id, d, FlowLogProbs(pipeline, units, refs)) for d, refs in self.spread(trajectories, devices)
            ]
        if node.kind == Kind.TRAIN:
            chunk = units[node.chunk[0] : node.chunk[1]]
            samples = [SampleId(step, p, i) for (_, p, i) in node.samples]
            stale = run.rollout_version(pipeline, node.step) < node.version
            return [
                Part(
                    node.id,
                    device,
                    FlowTrain(
                        pipeline,
                        ids,
                        chunk,
                        self.config.pairs_per_step,
                        stale,
                        trajectories,
                        sources[Kind.SCORE],
                        sources[Kind.LOGPROB],
                    ),
                )
                for device, ids in self.spread(samples, devices)
            ]
        raise ValueError(f"node {node.id}: a flow pipeline does not run {node.kind} nodes")

    def step_metrics(self, scores: list[Scores], trained: list[Trained]) -> dict:
        pairs = sum(len(t.samples) * len(t.units) for t in trained)
        metrics = {"reward/total": float(np.concatenate([s.scores["total"] for s in scores]).mean())}
        metrics |= {
            name: sum(t.stats[name] for t in trained) / pairs for name in STAT_MEANS if name in trained[0].stats
        }
        metrics["ratio_min"] = min(t.stats["ratio_min"] for t in trained)
        metrics["ratio_max"] = max(t.stats["ratio_max"] for t in trained)
        metrics["timesteps"] = sorted({unit for t in trained for unit in t.units})
        return metrics

    def book(self, node: Node, part: Part, result, ledger) -> None:
        if isinstance(result, Trajectories):
            for sample in result.samples:
                ledger.generated.setdefault(SampleId(*sample), []).append((part.device, result.version))
        elif isinstance(result, Scores):
            for sample in result.samples:
                ledger.scored[SampleId(*sample)] = ledger.scored.get(SampleId(*sample), 0) + 1


def fitted_cost(config: FlowTrainConfig, scenario: Scenario, measured: dict[str, float]) -> CostModel:
    """The analytic cost model fitted to a device's measured seconds: the small-pass half point from the fastest
    generation at two batch sizes, then one correction per kind of work (`CostModel.from_measurements`)."""
    samples = config.runtime.profile_samples
    spec = scenario.pipelines[0]
    model = diffusion_model(spec.model)
    tokens = model.latent_tokens(spec.height, spec.width)
    small = max(1, samples // 4)
    ratio = measured["generate_fastest"] / measured["generate_small_fastest"]
    half = tokens * (samples - ratio * small) / (ratio - 1) if ratio > 1 else DEFAULT.dit_half_mfu_tokens
    calibration = replace(DEFAULT, dit_half_mfu_tokens=max(half, 0.0))

    analytic = CostModel(config.cluster.device, calibration)
    predicted = {
        "generate": analytic.generate(model, samples, spec.height, spec.width, spec.denoising_steps),
        "score": analytic.rule_score(samples),
        "logprob": analytic.dit_logprob(model, samples, 1, tokens),
        "train": analytic.dit_train(model, samples, 1, tokens),
        "optimizer": analytic.optimizer_step(model.params),
        "publish": analytic.publish(model.params),
        "switch": rollout_wake_s(scenario, analytic),
    }
    records = [(kind, predicted[kind], max(measured[kind], 1e-9)) for kind in predicted]
    return CostModel.from_measurements(config.cluster.device, records, calibration)


def check_checkpoint(config: FlowTrainConfig) -> None:
    """What every run meets as it starts, whatever its policy (the dry run's check): the built-in model loads, as
    the run loads it (a truncated or foreign file fails here), and the prompts split. A diffusers directory's layout
    the config has checked, and its prompt table is checked here; its model is not loaded (a dry run plans a GPU
    cluster from a laptop)."""
    if config.model.path is None:
        load_flow_model(config)
    prompt_split(config)
    if config.model.path is not None:
        check_prompt_table(config)


def profile_here(config: FlowTrainConfig, carry: Callable[[dict], dict]) -> dict[str, float]:
    """The start-up profile in this process (the dry run's), on the checkpoint's model."""
    model = load_flow_model(config)
    samples = config.runtime.profile_samples
    return profile_work(model, load_decoder(config), config, sde_settings(config), samples, carry)


def exporter(config: FlowTrainConfig) -> Callable[[Path, Path], None]:
    """`dovetail export` of a flow run: a user's diffusers model (`models.diffusers_flow.export`) with a
    checkpoint's weights; the built-in model's checkpoints are its own format already."""
    if config.model.path is None:
        raise ValueError(
            "it trained no model.path: export writes the diffusers directory of a run of a diffusers model "
            "(a built-in model's checkpoints/step_N is its own format)"
        )

    def write(checkpoint: Path, out: Path) -> None:
        model = load_flow_model(config)
        load_checkpoint(checkpoint, model, make_optimizer(model, config), load_diffusers_checkpoint)
        export(model, out)

    return write


Adapter, Engines = FlowAdapter, FlowEngines
