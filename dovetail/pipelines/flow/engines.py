"""A flow pipeline's (FlowGRPO / DanceGRPO / DiffusionNFT) engines on one device of the Ray runtime: a rollout copy of
the policy, the trainer (weights + optimizer), the reference and the reward engine, doing the typed work the driver
sends (generate, score, old log-probs, train), and the profile of that work the cost model is fitted to. The math is the
reference loop's (`models.flow_rl`, `recipe`): every random draw is keyed by the sample, so any split gives the same
numbers.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from dovetail.algo import WeightEMA
from dovetail.graph.node import SampleId
from dovetail.models import sampling
from dovetail.models.diffusers_flow import DiffusersFlow, load_decoder, load_flow_model
from dovetail.models.flow_rl import (
    accumulate_policy_gradient,
    generate,
    padding_pass,
    recompute_log_probs,
    recompute_passes,
    training_passes,
)
from dovetail.models.memory import module_bytes
from dovetail.models.training import commit, load_weights, make_optimizer, synchronize, weights_of
from dovetail.pipelines.flow.config import FlowTrainConfig, flow_rules
from dovetail.pipelines.flow.ema import EMA_KEY, load_ema, trained_parameters, update_ema, weight_ema, with_ema
from dovetail.pipelines.flow.messages import FlowLogProbs, FlowTrain, Generate, Trajectories
from dovetail.pipelines.flow.old_policy import load_old_policy, old_policy, update_old_policy, with_old_policy
from dovetail.pipelines.flow.recipe import advantages_of, policy_gradient, sample_timesteps, sde_settings, sde_steps
from dovetail.prompts import train_prompts
from dovetail.rewards import load_rewards, score
from dovetail.runtime.interference import Span, time_work
from dovetail.runtime.messages import LogProbs, Score, Scores, Trained, Work
from dovetail.runtime.pipeline import PROFILE_ROUNDS, SAMPLING_WEIGHTS_KEY, PipelineEngines, unsharded_works


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


class FlowEngines(PipelineEngines[torch.nn.Module]):
    """A flow pipeline's engines on one device: trainer (weights + optimizer), a rollout copy at some published
    version, the frozen reference (KL) and the reward judge. A device of the reward pool holds the judge alone."""

    def __init__(self, config: FlowTrainConfig, device: torch.device, holds_policy: bool, trainer_state: dict):
        super().__init__(config, device)
        self.ema: WeightEMA | None = None
        """eval.ema's average of the trainer's weights, on a device that holds a trainer (`pipelines.flow.ema`)."""
        self.old_policy: torch.nn.Module | None = None
        """DiffusionNFT's old policy beside the trainer (`pipelines.flow.old_policy`): what this device publishes."""
        self.sde, self.rules = sde_settings(config, device), flow_rules(config)
        self.decode = load_decoder(config, device)
        self.reward_sources = config.reward_sources(str(device))
        load_rewards(config.reward, self.reward_sources)
        if not holds_policy:
            return
        self.trainer = load_flow_model(config).to(device)
        self.optimizer = make_optimizer(self.trainer, config.train)
        self.ema = weight_ema(config, self.trainer)
        self.old_policy = old_policy(config, self.trainer)
        self.load_trainer_state(trainer_state)
        if config.algo.beta > 0:
            self.reference = load_flow_model(config).to(device).requires_grad_(False)
        self.rollout = copy.deepcopy(self.trainer).requires_grad_(False)

    def trainer_state(self) -> dict:
        """The trainer's state with eval.ema's average of its weights and DiffusionNFT's old policy beside them
        (`pipelines.flow.ema`, `pipelines.flow.old_policy`); a sharded member's, its shards of the weights and the
        average (`models.sharding.merged_state` joins them; DiffusionNFT refuses a sharded trainer)."""
        if self.sharded_group is None or self.ema is None:  # DiffusionNFT's old policy is a replica's alone
            return with_old_policy(with_ema(super().trainer_state(), self.ema), self.old_policy)
        from dovetail.models.sharding import local_tensors  # a sharded run's (`shard_trainer` says why here)

        return super().trainer_state() | {EMA_KEY: local_tensors(self.ema.shadow)}

    def shard_trainer(self, group: tuple[int, ...], mesh) -> None:
        """The trainer sharded over `mesh`, and eval.ema's average with it: the average is elementwise, so a shard's
        average is the average's shard, and each member keeps the part of the average its weights' shards cover
        (`models.sharding.local_of_whole`), updated after each commit as a replica's is (`update_ema`)."""
        super().shard_trainer(group, mesh)
        if self.ema is None:
            return
        from dovetail.models.sharding import local_of_whole  # a sharded run's (`shard_trainer` says why here)

        trainer, _ = self.held_trainer()
        shards = trained_parameters(trainer)
        self.ema.shadow = {name: local_of_whole(shards[name], average) for name, average in self.ema.shadow.items()}

    def load_trainer_state(self, state: dict) -> None:
        """Another replica's, the driver's or a checkpoint's committed state, its EMA included: a replica that
        takes it over averages on as the one that held it."""
        super().load_trainer_state(state)
        load_ema(self.ema, state.get(EMA_KEY), self.held_trainer()[0])
        load_old_policy(self.old_policy, state.get(SAMPLING_WEIGHTS_KEY), self.held_trainer()[0])

    def export_weights(self, keep: bool = True) -> dict:
        """The weights the rollouts sample with: DiffusionNFT's old policy where the run keeps one, else the
        trained weights."""
        if self.old_policy is not None:
            return weights_of(self.old_policy)
        return super().export_weights(keep)

    def train_again(self, work: Work) -> Trained:
        """The part again on the weights now: its old log-probs are the rollout's (or the recomputed ones the part
        reads), which no update changes."""
        assert isinstance(work, FlowTrain), "a commit runs the step's train parts again"
        return self._train(work)

    def after_commit(self) -> None:
        trainer, optimizer = self.held_trainer()
        update_ema(self.ema, trainer, optimizer)
        update_old_policy(self.config, self.old_policy, trainer, optimizer)

    def state_module(self) -> torch.nn.Module:
        trainer, _ = self.held_trainer()
        return trainer.transformer if isinstance(trainer, DiffusersFlow) else trainer

    def load_rollout(self, weights: dict) -> None:
        load_weights(self.rollout, weights)

    def rollout_bytes(self) -> int:
        return module_bytes(self.held_rollout())

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
                shared_group_noise=self.rules.shared_group_noise,
                sde_steps=sde_steps(config, work.samples),
            )
            return pack(trajectories, work.samples, work.version)
        if isinstance(work, Score):
            trajectories, ids = unpack(self.fetch(work.rollouts), self.sde.sigmas)
            images = self.decode(trajectories.images)
            return Scores(
                ids, score(images, trajectories.prompts, config.reward, config.reward_timeout_s, self.reward_sources)
            )
        if isinstance(work, FlowLogProbs):
            every, ids = unpack(self.fetch(work.trajectories), self.sde.sigmas)
            trajectories = every
            if work.samples is not None:
                position = {sample: row for row, sample in enumerate(ids)}
                rows = [position[SampleId(*sample)] for sample in work.samples]
                trajectories, ids = every.select(rows), [ids[r] for r in rows]
            timesteps = self._timesteps(ids, work.units)
            log_probs = recompute_log_probs(self.trainer, trajectories, timesteps, self.sde).cpu().numpy()
            if work.group:
                with torch.no_grad():
                    for _ in range(work.passes - recompute_passes(timesteps)):
                        padding_pass(self.trainer, every, self.sde)
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
            samples=[ids[r] for r in rows],
            old_model=self.old_policy,
        )
        if work.group:  # a member of a sharded group makes as many passes as the others
            made = training_passes(len(rows) * len(work.units), self.config.train.chunk_size)
            for _ in range(work.passes - made):
                padding_pass(self.trainer, trajectories, self.sde).backward()
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
    (`carry` moves the weights between them: the object store, or pickle in a dry run). A sharded run's profile
    makes no copies and leaves out the train and the optimizer step (`unsharded_works`): `model` generates, scores
    its log-probs and takes its own weights back."""
    if config.train.sharding == "fsdp":
        trainer = rollout = model
    else:
        trainer, rollout = copy.deepcopy(model), copy.deepcopy(model).requires_grad_(False)
    optimizer = make_optimizer(trainer, config.train)
    pool = train_prompts(config)
    prompts = [pool[p % len(pool)] for p in range(n)]
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

    sources = config.reward_sources(str(trainer.device))

    works = {
        "generate": lambda done: generate(trainer, prompts, ids, sde, seed=config.seed, shared_group_noise=False),
        "score": lambda done: score(
            decode(done["generate"].images), prompts, config.reward, config.reward_timeout_s, sources
        ),
        "logprob": logprob,
        "train": train,
        "optimizer": lambda done: commit(trainer, optimizer, config.train),
        "publish": lambda done: load_weights(rollout, carry(weights_of(trainer))),
    }
    return unsharded_works(works) if config.train.sharding == "fsdp" else works


def profile_work(
    model, decode, config: FlowTrainConfig, sde, samples: int, carry: Callable[[dict], dict]
) -> dict[str, float]:
    """Measured seconds of each kind of work on `model`'s device (`profile_works`): what the cost model is fitted
    to before planning. A small untimed round first takes the one-off costs (the judge is fitted on first use,
    first-call allocations); generation is then timed at two batch sizes, which pins down the fixed cost of a small
    pass (from the fastest rounds: interference only adds time); every other time is the median of PROFILE_ROUNDS."""

    def one_of_each(n: int) -> dict[str, float]:
        seconds: dict[str, float] = {}
        done: dict[str, object] = {}
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
