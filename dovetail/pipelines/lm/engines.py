"""A language-model pipeline's (GRPO) engines on one device of the Ray runtime: the policy as trainer, its rollout
engine (`sampling.engine`: our `TorchEngine`, transformers' own forward, or vLLM), the frozen base model
for a KL term and the rewards (`pipelines.lm.prompts` finds each sample's prompt row), doing the typed work the driver
sends (prefill, decode, score, log-probs, train), and the profile of that work the cost model is fitted to.

Each train part sums its loss (`lm_grpo_loss(loss_scale=1)`) and says how much it adds to the step's normaliser
(tokens, sequences, or sequences x max_new_tokens); the commit divides the all-reduced sum by the step's total
(`pipelines.lm.adapter.commit_scale`), so any split into micro-batches and devices, in any finishing order, trains what
one batch would.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import torch

from dovetail.envs.host import EnvironmentHost
from dovetail.graph.node import Role, SampleId
from dovetail.models.causal_lm import CausalLM, rollout_engine, rollout_state
from dovetail.models.critic import value_model_of
from dovetail.models.engine import Engine, Request
from dovetail.models.lm_rl import (
    accumulate_group_gradients,
    group_log_probs,
    policy_gradient,
    step_values,
    value_gradient,
)
from dovetail.models.memory import memory_by_kind
from dovetail.models.training import (
    commit,
    load_trainer_state,
    load_weights,
    make_optimizer,
    optimizer_steps,
    set_summed_gradient,
    synchronize,
    tensors_of,
    trainable_parameters,
    trainer_state_of,
    weights_of,
)
from dovetail.pipelines.lm.config import ROLLOUT_PASS, STEP_PASS, LMTrainConfig
from dovetail.pipelines.lm.messages import (
    CRITIC_UNIT,
    CriticTrained,
    Decode,
    DecodeTurn,
    EpisodeFigures,
    LMCriticTrain,
    LMLogProbs,
    LMTrain,
    LMValues,
    Prefill,
    Responses,
    Values,
    request_key,
)
from dovetail.pipelines.lm.model import (
    encode_prompts,
    engine_length,
    load_policy,
    load_reference,
    load_run_tokenizer,
    model_context,
    sampling_params,
    stop_strings,
)
from dovetail.pipelines.lm.multiturn import (
    Conversation,
    decode_turn,
    episode_figures,
    run_episodes,
    trajectory_responses,
    with_episode_rewards,
)
from dovetail.pipelines.lm.prompts import RunPrompts
from dovetail.rewards import load_rewards
from dovetail.rewards.text import score_text
from dovetail.runtime.interference import Span, time_work
from dovetail.runtime.messages import DeviceMemory, LogProbs, Score, Scores, Trained, TrainerWork, Work
from dovetail.runtime.pipeline import PROFILE_ROUNDS, PipelineEngines, shard_in_place, unsharded_works

STAT_MEANS = ("clip_frac", "approx_kl", "ratio_mean", "kl_ref", "entropy", "logprob_gap")
"""Per-token means each train part reports (`logprob_gap` where the old log-probs were recomputed); the step's are
weighted by the parts' tokens."""


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
        SampleId(*sample): Request(request_key(sample), prompt, list(tokens), list(log_probs), done)
        for part in parts
        for sample, prompt, tokens, log_probs, done in zip(
            part.samples, part.prompts, part.tokens, part.log_probs, part.finished
        )
    }


CRITIC_MEANS = ("vf_loss", "vf_clipfrac", "vpred_mean")
"""Per-token means each critic train part reports (`algo.clipped_value_loss`), weighted by tokens over the step."""


def merged_critic_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """The critic's statistics of several groups or parts as one: per-token means weighted by tokens, the token and
    loss sums."""
    parts = [p for p in parts if p["tokens"] > 0]
    tokens = sum(p["tokens"] for p in parts)
    if not parts:
        return dict.fromkeys([*CRITIC_MEANS, "tokens", "loss"], 0.0)
    means = {name: sum(p[name] * p["tokens"] for p in parts) / tokens for name in CRITIC_MEANS}
    return means | {"tokens": tokens, "loss": sum(p["loss"] for p in parts)}


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


class LMEngines(PipelineEngines[Engine]):
    """A language-model pipeline's engines on one device."""

    def __init__(self, config: LMTrainConfig, device: torch.device, holds_policy: bool, trainer_state: dict | None):
        super().__init__(config, device)
        self.reward_sources = config.reward_sources(str(device))
        load_rewards(config.rewards, self.reward_sources)
        self.tokenizer = load_run_tokenizer(config)
        self.prompts = RunPrompts(config)
        self.environments: EnvironmentHost | None = None
        """An env run's episodes, in a process of their own (`envs.host`)."""
        self.tools: tuple[dict, ...] = ()
        """The schemas of the tools the environment offers (an env run's): its prompts offer them, its turns end at
        their calls."""
        self.conversation: Conversation | None = None
        """How the tokenizer writes an env run's episodes."""
        self.critic: torch.nn.Module | None = None
        """PPO's value model (`algo.advantage: gae`), trained beside the policy on every trainer device; a sharded
        run's is sharded over the policy's FSDP group with it (`shard_trainer`)."""
        self.critic_optimizer: torch.optim.Optimizer | None = None
        self.pending_critic_optimizer: dict | None = None
        """A sharded run's critic's AdamW state given at configure, loaded into its shards (`pending_optimizer`'s)."""
        self._gradient: torch.Tensor | None = None
        self._critic_gradient: torch.Tensor | None = None
        self._first_log_probs: dict[SampleId, np.ndarray] = {}
        """With algo.num_iterations > 1: each response trained here, its log-probs under the weights of its step's
        first update, which the later updates take as the old ones (`train_again`)."""
        if not holds_policy:
            return
        env = config.env
        if env is not None:
            self.environments = EnvironmentHost(
                env.name, env.options, env.parser, env.latency, config.seed, env.timeout_s
            )
            self.tools = self.environments.tools()
            self.conversation = Conversation(config, self.tokenizer, self.tools, model_context(config))
        model, _ = load_policy(config)
        self.trainer = model.to(device)
        self.optimizer = make_optimizer(self.trainer, config.train)
        if config.critic is not None:  # from the policy's checkpoint, before a run's state replaces its weights
            lora = None if config.critic.lora is None else config.critic.lora.model_dump()
            self.critic = value_model_of(self.trainer, config.seed, lora)
            self.critic_optimizer = make_optimizer(self.critic, config.critic_train)
        if trainer_state is not None:
            self.load_trainer_state(trainer_state)
        if config.algo.beta > 0:
            self.reference = load_reference(config).to(device).requires_grad_(False)
        context = model_context(config)
        self.rollout = rollout_engine(
            copy.deepcopy(self.trainer) if config.train.sharding == "fsdp" else self.trainer,
            sampling_params(config, self.tokenizer.stop_ids),
            max_len=engine_length(config, self.tokenizer, self.prompts, context),
            device=device,
            stop=stop_strings(config, self.tokenizer, self.tools),
            engine=config.rollout_engine,
        )

    def state_module(self) -> torch.nn.Module:
        trainer, _ = self.held_trainer()
        return trainer.model if isinstance(trainer, CausalLM) else trainer

    def shard_trainer(self, group: tuple[int, ...], mesh) -> None:
        """The policy sharded over `mesh`, and a PPO run's critic over the same group with it, as verl's critic
        worker shards it: its blocks FSDP units in the run's precision, its AdamW moments its own shards, its
        optimizer stepped at its own lr (`critic_train`)."""
        super().shard_trainer(group, mesh)
        if self.critic is None or self.critic_optimizer is None:
            return
        pending, self.pending_critic_optimizer = self.pending_critic_optimizer, None
        config = self.config
        self.critic_optimizer = shard_in_place(
            self.critic, self.critic, self.critic_optimizer, mesh, config.train, config.critic_train, pending
        )

    def trained_modules(self) -> list[torch.nn.Module]:
        return super().trained_modules() + ([] if self.critic is None else [self.critic])

    def hold(self, role: str) -> None:
        """While the device trains, the rollout engine sleeps (vLLM's sleep mode hands its weights and KV cache's
        memory to the trainer); it wakes for any other role."""
        if self.rollout is None:
            return
        if role == Role.TRAINER:
            self.rollout.sleep()
        else:
            self.rollout.wake()

    def load_rollout(self, weights: dict) -> None:
        self.held_rollout().load_weights(rollout_state(self.trainer, tensors_of(weights)))

    def rollout_bytes(self) -> int:
        return self.held_rollout().held_bytes()

    def run(self, work: Work):
        if isinstance(work, Prefill) and self.environments is not None:
            return self._handed_on(work)
        if isinstance(work, DecodeTurn):
            (state,) = self.fetch(work.rollouts)
            if not all(state.finished):
                self.load_rollout_weights(state.version, work.weights)
            return decode_turn(self.held_rollout(), state)
        if isinstance(work, Decode) and self.environments is not None:
            return self._episodes(work)
        if isinstance(work, Prefill) and not work.samples:  # a draw its step did not need (dynamic sampling)
            return responses_of([], work.version)
        if isinstance(work, Decode) and not any(part.samples for part in self.fetch(work.rollouts)):
            return responses_of([], self.fetch(work.rollouts)[0].version)
        if isinstance(work, Prefill):
            self.load_rollout_weights(work.version, work.weights)
            requests = [Request(request_key(s), list(p)) for s, p in zip(work.samples, work.prompts)]
            return responses_of(self.held_rollout().generate(requests, until=1), work.version)
        if isinstance(work, Decode):
            parts = self.fetch(work.rollouts)
            self.load_rollout_weights(parts[0].version, work.weights)
            requests = [r for r in requests_of(parts).values() if not (work.running_only and r.finished)]
            return responses_of(self.held_rollout().generate(requests, until=work.until), parts[0].version)
        if (
            isinstance(work, (Score, LMLogProbs, LMTrain, LMValues, LMCriticTrain))
            and work.samples == []
            and not _in_lockstep(work)
        ):
            return self._nothing(work)
        if isinstance(work, Score):
            chosen = self._select(work.rollouts, work.samples)
            rows = [self.prompts.train(sample.step, sample.prompt) for sample in chosen]
            completions = [self.tokenizer.decode(r.tokens) for r in chosen.values()]
            context = self.prompts.context(rows, [list(r.tokens) for r in chosen.values()])
            scores = score_text(
                completions,
                [row.prompt for row in rows],
                self.config.rewards,
                self.config.reward_timeout_s,
                context,
                self.reward_sources,
            )
            lengths = np.array([len(r.tokens) for r in chosen.values()])
            if self.config.env is None:
                return Scores(list(chosen), scores, lengths)
            episodes = self._episodes_of(work.rollouts, list(chosen))
            scores = with_episode_rewards(scores, [e.reward for e in episodes])
            return Scores(list(chosen), scores, lengths, episode_figures(episodes))
        if isinstance(work, LMLogProbs):
            chosen = self._select(work.rollouts, work.samples)
            model = self.reference if work.reference else self.trainer
            log_probs = group_log_probs(model, chosen, self.config.sampling.temperature, _lockstep_passes(work))
            return LogProbs(list(chosen), [log_probs[s].cpu().numpy() for s in chosen])
        if isinstance(work, LMValues):
            assert self.critic is not None, "a run with a critic sends its value work"
            chosen = self._select(work.rollouts, work.samples)
            values = step_values(self.critic, chosen, _lockstep_passes(work))
            return Values(list(chosen), [values[s].cpu().numpy() for s in chosen])
        if isinstance(work, LMTrain):
            return self._train(work)
        if isinstance(work, LMCriticTrain):
            return self._train_critic(work)
        raise TypeError(f"language-model engines cannot do {type(work).__name__}")

    def _handed_on(self, work: Prefill) -> Responses:
        """An env run's prefill: its prompts are its episodes' first observations, written on the device as each
        episode resets (`_episodes`), so the samples are handed on with nothing decoded. With free waits the episodes
        were reset off the devices (`multiturn.Episodes`): their trajectories before the first turn are handed on."""
        if work.episodes is not None:
            (reset,) = self.fetch([work.episodes])
            return reset
        empty: list[list] = [[] for _ in work.samples]
        return Responses(work.version, list(work.samples), empty, empty, empty, [False] * len(work.samples))

    def _episodes(self, work: Decode) -> Responses:
        """An env run's decode: every trajectory of the samples handed on rolled out whole, reset to its end
        (`multiturn.run_episodes`), in one band: a trajectory is decoded turn by turn between its environment's
        steps, so it is never paused at a length nor moved to another engine midway (`graph.lm` gives an env run's
        shards one band and no migration). Each token's draw is keyed by its trajectory and place in it, so the same
        samples roll out the same on any device, whatever else it decodes: a decode run again after a lost device
        gives the trajectories the lost one would have."""
        assert self.environments is not None and self.conversation is not None, "an env run's engines hold both"
        parts = self.fetch(work.rollouts)
        version = parts[0].version
        self.load_rollout_weights(version, work.weights)
        samples = [SampleId(*s) for part in parts for s in part.samples]
        rows = [self.prompts.episode_row(self.prompts.train(s.step, s.prompt)) for s in samples]
        trajectories, waited = run_episodes(self.held_rollout(), self.environments, self.conversation, samples, rows)
        return trajectory_responses(trajectories, version, waited)

    def _episodes_of(self, rollouts: list, samples: list[SampleId]) -> list[EpisodeFigures]:
        """The episodes of `samples` among `rollouts`' trajectories, in the order of `samples`."""
        episodes = {SampleId(*s): e for part in self.fetch(rollouts) for s, e in zip(part.samples, part.episodes)}
        return [episodes[sample] for sample in samples]

    def _nothing(self, work: Work):
        """The answer of a streamed micro-batch left empty (its groups all finished later): no reward, no gradient."""
        if isinstance(work, Score):
            env = self.config.env is not None
            names = [*(["env"] if env else []), *self.config.rewards, "total"]
            figures = episode_figures([]) if env else {}
            return Scores([], {name: np.zeros(0) for name in names}, np.zeros(0, dtype=int), figures)
        if isinstance(work, LMLogProbs):
            return LogProbs([], [])
        if isinstance(work, LMValues):
            return Values([], [])
        if isinstance(work, LMCriticTrain):
            return CriticTrained([], [CRITIC_UNIT], merged_critic_stats([]), 0.0)
        self._gradient, _ = accumulate_group_gradients(self.trainer, [], lambda group: None)
        return Trained([], [0], merged_stats([]), 0.0)

    def _select(self, rollouts: list, samples: list | None) -> dict[SampleId, Request]:
        requests = requests_of(self.fetch(rollouts))
        return requests if samples is None else {SampleId(*s): requests[SampleId(*s)] for s in samples}

    def train_again(self, work: Work) -> Trained:
        """A step's train part again, for an update after the commit's first: the actor's with the first update's
        log-probs as the old ones, the critic's on its weights now against the same returns and old values (verl's
        critic ppo_epochs: GAE is computed once, before the updates)."""
        if isinstance(work, LMCriticTrain):
            return self._train_critic(work)
        assert isinstance(work, LMTrain), "a commit runs the step's train parts again"
        return self._train(work, again=True)

    def _train(self, work: LMTrain, again: bool = False) -> Trained:
        """The part's groups trained one at a time (`models.lm_rl.policy_gradient`); `part_gradient` hands the fp64
        sum to the commit (a sharded trainer's stays in its shards). With algo.num_iterations > 1 the first update
        keeps each response's log-probs, and a later one (`again`) takes them as the old ones; a step's first update
        follows the commits of the steps before it, so their responses' are dropped then."""
        scores = self.fetch(work.scores)
        rewards = {SampleId(*s): r for part in scores for s, r in zip(part.samples, part.scores["total"])}
        samples = [SampleId(*s) for s in work.samples]
        first_update, keep = None, None
        if again:
            first_update = {s: self._first_log_probs[s] for s in samples}
        elif self.config.algo.num_iterations > 1 and samples:
            step = samples[0].step
            self._first_log_probs = {s: v for s, v in self._first_log_probs.items() if s.step >= step}
            keep = self._first_log_probs

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
            passes=_lockstep_passes(work),
            generated=self._generated(work.rollouts),
            scored_requests=self._select(work.rollouts, None),
            values=self._values(work.values) if work.values else None,
            first_update=first_update,
            keep_log_probs=keep,
        )
        return Trained(samples, [0], merged_stats(group_stats), normaliser)

    def _generated(self, rollouts: list) -> dict[SampleId, Sequence[bool]]:
        """Multi-turn trajectories' masks of the tokens the model sampled (none for single-turn responses)."""
        return {SampleId(*s): g for part in self.fetch(rollouts) for s, g in zip(part.samples, part.generated)}

    def _values(self, parts: list) -> dict[SampleId, object]:
        return {SampleId(*s): v for part in self.fetch(parts) for s, v in zip(part.samples, part.values)}

    def _train_critic(self, work: LMCriticTrain) -> CriticTrained:
        """The part's groups' critic gradient (`models.lm_rl.value_gradient`), which `part_gradient` hands on."""
        assert self.critic is not None and self.config.critic is not None, "a run with a critic sends critic work"
        scores = self.fetch(work.scores)
        rewards = {SampleId(*s): r for part in scores for s, r in zip(part.samples, part.scores["total"])}
        samples = [SampleId(*s) for s in work.samples]

        def given(parts: list) -> dict:
            return {SampleId(*s): v for part in self.fetch(parts) for s, v in zip(part.samples, part.log_probs)}

        self._critic_gradient, group_stats = value_gradient(
            self.critic,
            self._select(work.rollouts, samples),
            rewards,
            self._values(work.values),
            given(work.old_log_probs),
            given(work.ref_log_probs),
            algo=self.config.algo,
            cliprange_value=self.config.critic.cliprange_value,
            max_new_tokens=self.config.max_new_tokens,
            scored_requests=self._select(work.rollouts, None),
            generated=self._generated(work.rollouts),
            passes=_lockstep_passes(work),
        )
        return CriticTrained(samples, [CRITIC_UNIT], merged_critic_stats(group_stats), 0.0)

    def part_gradient(self) -> torch.Tensor:
        """The part's flat fp64 gradient; with a critic, the policy's and the critic's end to end (the one a part did
        not train: zeros), so that the commit adds every part alike and steps both (`set_step_gradient`)."""
        actor, critic = self._gradient, self._critic_gradient
        self._gradient = self._critic_gradient = None
        if self.critic is None:
            assert actor is not None, "a train part leaves its gradient"
            return actor
        sizes = self._gradient_sizes()
        zeros = [torch.zeros(size, dtype=torch.float64, device=self.device) for size in sizes]
        return torch.cat([actor if actor is not None else zeros[0], critic if critic is not None else zeros[1]])

    def _gradient_sizes(self) -> tuple[int, int]:
        trainer, _ = self.held_trainer()
        critic = 0 if self.critic is None else sum(p.numel() for p in trainable_parameters(self.critic))
        return sum(p.numel() for p in trainable_parameters(trainer)), critic

    def gradient_size(self) -> int:
        return sum(self._gradient_sizes())

    def set_step_gradient(self, parts: list[torch.Tensor], scale: float) -> None:
        """The step's summed gradient, scaled, into the policy's parameters and the critic's (`part_gradient`'s
        layout)."""
        if self.critic is None:
            super().set_step_gradient(parts, scale)
            return
        trainer, _ = self.held_trainer()
        actor_size, _ = self._gradient_sizes()
        set_summed_gradient(trainer, [part[:actor_size] for part in parts], scale)
        set_summed_gradient(self.critic, [part[actor_size:] for part in parts], scale)

    def step_optimizers(self, updates_per_step: int = 1) -> float:
        """The policy's optimizer step, and the critic's at its own lr (`critic_train`; the RL step's, as the
        policy's, over `updates_per_step` updates), each clipped on its own (verl's actor and critic each clip their
        gradient); returns the policy's pre-clip gradient norm. During `critic.steps_before_actor` (verl's
        `critic_warmup`) the critic steps alone: the policy keeps its weights and its optimizer its state and
        schedule, and the norm returned is 0.0."""
        critic, optimizer = self.critic, self.critic_optimizer
        if critic is None or optimizer is None:
            return super().step_optimizers(updates_per_step)
        assert self.config.critic is not None, "a run with a critic has its section"
        actor_waits = optimizer_steps(optimizer) // updates_per_step < self.config.critic.steps_before_actor
        if actor_waits:  # verl's critic_warmup: the step's actor gradient is dropped, its optimizer not stepped
            trainer, _ = self.held_trainer()
            trainer.zero_grad(set_to_none=True)
            grad_norm = 0.0
        else:
            grad_norm = super().step_optimizers(updates_per_step)
        commit(critic, optimizer, self.config.critic_train, updates_per_step)
        return grad_norm

    def memory(self, gradient_parts: Iterable[torch.Tensor] = ()) -> DeviceMemory:
        """The device's bytes by kind (`PipelineEngines.memory`), a PPO run's critic's parameters, gradients and
        AdamW moments with the trainer's."""
        held = super().memory(gradient_parts)
        if self.critic is None:
            return held
        critic = memory_by_kind(self.critic, self.critic_optimizer)
        return replace(
            held,
            parameters=held.parameters + critic["parameters"],
            gradients=held.gradients + critic["gradients"],
            optimizer=held.optimizer + critic["optimizer"],
        )

    def trainer_state(self) -> dict:
        """The policy's state, and the critic's under "critic" where the run trains one (a sharded member's: its own
        shards of both, which `models.sharding.merged_state` joins)."""
        state = super().trainer_state()
        critic, optimizer = self.critic, self.critic_optimizer
        if critic is None or optimizer is None:
            return state
        if self.sharded_group is None:
            state["critic"] = trainer_state_of(critic, optimizer)
        else:
            from dovetail.models.sharding import local_state  # a sharded run's (`shard_trainer` says why here)

            state["critic"] = local_state(critic, optimizer)
        return state

    def load_trainer_state(self, state: dict) -> None:
        """As the policy's (`PipelineEngines.load_trainer_state`): a sharded run's replica takes the critic's weights
        and keeps its AdamW state for its shards."""
        super().load_trainer_state(state)
        if self.shards and self.critic is not None and "critic" in state:
            load_weights(self.critic, state["critic"]["weights"])
            self.pending_critic_optimizer = state["critic"]["optimizer"]
            return
        self.load_critic_state(state)

    def load_critic_state(self, state: dict) -> None:
        """The critic's part of a trainer state (`trainer_state`), where the run trains one and the state has it."""
        if self.critic is not None and self.critic_optimizer is not None and "critic" in state:
            load_trainer_state(self.critic, self.critic_optimizer, state["critic"])
            self.critic_optimizer.zero_grad(set_to_none=True)

    def profile(self, samples: int, carry: Callable[[dict], dict]) -> dict[str, float]:
        return profile_work(self, samples, carry)

    def time_kind(self, kind: str, samples: int, repeats: int, carry: Callable[[dict], dict]) -> list[Span]:
        with trainer_kept(self):
            return time_work(profile_works(self, samples, carry), kind, repeats, self.device)


def _in_lockstep(work: Work) -> bool:
    """Whether a member of a sharded trainer's group does `work` with the others (even with no samples of its own)."""
    return isinstance(work, TrainerWork) and bool(work.group)


def _lockstep_passes(work: TrainerWork) -> int | None:
    """The passes a member of a sharded trainer's group makes for `work`; None on a replica."""
    return work.passes if _in_lockstep(work) else None


@contextmanager
def trainer_kept(engines: LMEngines):
    """The profile's work trains and steps the engines' own trainer and loads its weights into the rollout engine:
    afterwards the trainer's weights and optimizer are put back and the next work reloads the rollout's. A sharded
    run's profile neither trains nor steps it (`profile_works`): nothing to put back. A PPO run's critic is put back
    with the policy (`LMEngines.trainer_state`)."""
    saved = None if engines.shards else engines.trainer_state()
    try:
        yield
    finally:
        if saved is not None:
            engines.load_trainer_state(saved)
        engines.rollout_version = None


def profile_works(
    engines: LMEngines, samples: int, carry: Callable[[dict], dict], weights: dict | None = None
) -> dict[str, Callable[[dict], object]]:
    """The start-up profile's work of each kind, in the order it runs, each taking the earlier ones' results by
    kind: `samples` responses of RL step -1 (never trained) prefilled (`weights`, default the trainer's now, loaded
    into the rollout engine first), decoded, scored, their log-probs, a train and an optimizer step of the engines'
    own trainer (run them `trainer_kept`), a publication to the rollout engine. The responses come in groups of the
    run's group size, as the run's do: the trainer passes over one group at a time, so a profile of lone responses
    would time a pass per response (three times the per-response cost of the run's groups of 8 on the copy task
    here)."""
    config, name = engines.config, engines.config.pipeline_name
    group = min(config.algo.group_size, samples)
    ids = [SampleId(-1, p // group, p % group) for p in range(samples)]
    rows = [engines.prompts.train(-1, p // group) for p in range(samples)]
    encoded = encode_prompts(config, engines.tokenizer, rows, model_context(config))
    engines.rollout_version = None
    weights = carry(weights_of(engines.trainer)) if weights is None else weights

    def train(done: dict) -> Trained:
        values = [engines.run(LMValues(name, ids, [done["decode"]]))] if engines.critic is not None else []
        trained = engines.run(LMTrain(name, ids, False, [done["decode"]], [done["score"]], values=values))
        engines.set_step_gradient([engines.part_gradient()], 1.0)
        return trained

    works = {
        "prefill": lambda done: engines.run(Prefill(name, ids, encoded, -1, weights)),
        "decode": lambda done: engines.run(Decode(name, [done["prefill"]], config.max_new_tokens, weights)),
        "score": lambda done: engines.run(Score(name, [done["decode"]], None)),
        "logprob": lambda done: engines.run(LMLogProbs(name, ids, [done["decode"]], False)),
        "train": train,
        "optimizer": lambda done: engines.step_optimizers(),
        "publish": lambda done: engines.load_rollout(carry(weights_of(engines.trainer))),
    }
    return unsharded_works(works) if engines.shards else works


SIZED_KINDS = ("prefill", "decode", "score", "logprob", "train")
"""The kinds of LM work whose passes grow with the responses in them: profiled at two sizes."""
STEP_PASS_LIMIT = 8
"""The profile's train pass is at most this many times `runtime.profile_samples`: a large run's micro-batch of
thousands of responses would make its profile longer than its first steps."""
ROLLOUT_PASS_LIMIT = 16
"""The profile's rollout pass is at most this many times `runtime.profile_samples` (a decode is a small share of a
step's time, so it may go further than the train pass)."""
ROLLOUT_KINDS = ("prefill", "decode", "score")
"""The kinds a rollout call runs: timed again at the rollout pass (`rollout_pass_size`)."""


def step_pass_size(config: LMTrainConfig, samples: int) -> int:
    """The profile's larger size: the responses a device trains in one pass of a step (`train_pass_responses`), at
    least twice `samples` (a line needs two sizes) and at most STEP_PASS_LIMIT times it."""
    return max(2 * samples, min(config.train_pass_responses, STEP_PASS_LIMIT * samples))


def rollout_pass_size(config: LMTrainConfig, samples: int) -> int | None:
    """The profile's third size, for the rollout's kinds: the responses a device decodes in one call of a step
    (`rollout_pass_responses`, at most ROLLOUT_PASS_LIMIT times `samples`); None where that is no more than the
    train pass, which then covers it."""
    size = min(config.rollout_pass_responses, ROLLOUT_PASS_LIMIT * samples)
    return size if size > step_pass_size(config, samples) else None


def profile_work(engines: LMEngines, samples: int, carry: Callable[[dict], dict]) -> dict[str, float]:
    """Measured seconds of each kind of LM work here (`profile_works`): medians of PROFILE_ROUNDS after a warm-up,
    at `samples` responses and again at the step's train pass (`step_pass_size`; the `_step_pass` figures): a kind's
    two sizes give its fixed cost per pass (`lm_startup.fitted_cost`), which on a CPU core makes a step's passes of
    32 or 128 responses cheaper per response than the profile's 16. The larger size is the step's own, so a step's
    passes are priced between the two sizes measured, not by a line drawn on past them (a profile of 16 and 32
    predicted a user's model's step a quarter short), and its responses (the larger size's, more prompts' worth) are
    the lengths the scenario prices (`LMTrainConfig.profiled`). Where a device decodes more in one call than it
    trains in one pass, the rollout's kinds are timed a third time at that size (`rollout_pass_size`; the
    `_rollout_pass` figures), so a step's decode is priced at a size measured too."""

    def one_round(size: int) -> tuple[dict[str, float], dict[str, object]]:
        seconds: dict[str, float] = {}
        done: dict[str, object] = {}
        for name, work in profile_works(engines, size, carry, weights).items():
            synchronize(engines.device)
            start = time.perf_counter()
            done[name] = work(done)
            synchronize(engines.device)
            seconds[name] = time.perf_counter() - start
        decoded = done["decode"]
        assert isinstance(decoded, Responses)  # what Decode returns
        # an env run's decode slept while every trajectory waited on its environment: the planner prices those waits
        # from env.latency (`LMTrainConfig.scenario`), the decode from the compute alone
        seconds["decode"] -= sum(episode.waited_s for episode in decoded.episodes)
        return seconds, done

    def at(size: int) -> dict:
        rounds = [one_round(size) for _ in range(PROFILE_ROUNDS)]
        measured: dict[str, float | list[int]] = {
            name: statistics.median(seconds[name] for seconds, _ in rounds) for name in rounds[0][0]
        }
        _, done = rounds[0]
        decoded = done["decode"]
        assert isinstance(decoded, Responses)  # what Decode returns
        measured |= {
            "lengths": [len(t) for t in decoded.tokens],
            # the decode's: an env run's prompts are its episodes' first observations, unknown at its prefill
            "prompt_tokens": [len(p) for p in decoded.prompts],
        }
        if decoded.episodes:  # an env run's: what its episodes took, which its scenario prices (`profiled`)
            measured |= {
                "turns": [episode.turns for episode in decoded.episodes],
                "observation_tokens": [mask.count(False) for mask in decoded.generated],
            }
        return measured

    with trainer_kept(engines):
        weights = carry(weights_of(engines.trainer))  # every round and size decodes from these: the same responses
        one_round(samples)
        single, step_pass = at(samples), at(step_pass_size(engines.config, samples))
        rollout_size = rollout_pass_size(engines.config, samples)
        rollout_pass = at(rollout_size) if rollout_size is not None else {}
    sized = [name for name in (*SIZED_KINDS, "lengths", "prompt_tokens") if name in step_pass]
    rollout_sized = [name for name in (*ROLLOUT_KINDS, "lengths", "prompt_tokens") if name in rollout_pass]
    return (
        single
        | {f"{name}{STEP_PASS}": step_pass[name] for name in sized}
        | {f"{name}{ROLLOUT_PASS}": rollout_pass[name] for name in rollout_sized}
    )
