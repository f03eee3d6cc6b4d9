"""Multi-turn rollouts of an env run (docs/environments.md), in the reference loop: each trajectory alternates model
turns and the environment's observations until its episode is done, and trains as one response whose observation
tokens are masked out (`Trajectory.generated`, `models.lm_rl.policy_gradient`).

A turn is decoded by the run's rollout engine from where the trajectory stands (`engine.Request.turn_start`) to the
end of sequence, a stop string, the text that closes a tool call (`stop_strings`) or the turn's budget
(`env.max_turn_tokens`); the episode steps on its text in the environment's process (`envs.host`); the observation is
tokenized (`Conversation`) and appended, and the next turn decodes after it. `sampling.max_new_tokens` is the whole
trajectory's budget, turns and observations together. Every token's draw is keyed by the trajectory's identity and
its index in the trajectory, so a trajectory is the same whatever else decodes beside it and whenever.

Turns decode in rounds (`run_episodes`): each round decodes, as one batch, every trajectory not waiting on its
environment, each to the end of its turn, then steps their episodes. A step's wait (`Episode.wait_s`, drawn from the
trajectory's identity) keeps that trajectory out of the rounds until it has passed; the others go on decoding
meanwhile, and the loop sleeps only while every unfinished trajectory waits, until the first wait ends. No turn
waits for another trajectory's turn order; a trajectory whose wait ends during a round joins the next one.

With free waits (`env.free_waits`, the Ray runtime's) the rounds are the graph's nodes instead: a turn node decodes
one turn of a shard's trajectories still going (`decode_turn`, on a device), an env node steps their episodes and
waits out their latency off the devices (`Episodes`, in the pipeline's `runtime.worker.EnvironmentWorker`), and the
trajectories travel between them as `Responses`; both shapes take the environment's answer from `_stepped`, so they
roll out the same trajectories.
"""

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from dovetail.envs.episode import Stepped
from dovetail.envs.host import EnvironmentHost
from dovetail.envs.toolcalls import convention, render_prompt
from dovetail.graph.node import SampleId
from dovetail.models.causal_lm import HFTokenizer
from dovetail.models.engine import Engine, Request
from dovetail.models.lm_rl import by_group
from dovetail.models.tokenizer import CharTokenizer
from dovetail.pipelines.lm.config import LMTrainConfig
from dovetail.pipelines.lm.messages import EpisodeFigures, ResetEpisodes, Responses, StepEpisodes, request_key
from dovetail.pipelines.lm.model import fitted_prompt, load_run_tokenizer, model_context
from dovetail.pipelines.lm.prompts import RunPrompts

TURN_MARK = "\u2063turn\u2063"
"""A model turn's stand-in content where a chat template is asked what it writes after a turn (`Conversation`)."""


@dataclass(frozen=True)
class Segment:
    """A stretch of a trajectory after its prompt: a model turn (its tokens as sampled, and their log-probs) or an
    observation (the environment's text as tokenized: `log_probs` None)."""

    tokens: tuple[int, ...]
    log_probs: tuple[float, ...] | None = None

    @property
    def sampled(self) -> bool:
        return self.log_probs is not None


@dataclass(frozen=True)
class Trajectory:
    """One multi-turn rollout: the prompt (the environment's first observation as the model reads it), then model
    turns and observations in turn (`segments`, a model turn first and last), the environment's reward (the sum of
    those it gave, 0 where none), the episode's figures, and whether the environment ended it (`done`; else it was
    cut by env.max_turns or the token budget)."""

    sample: SampleId
    prompt: tuple[int, ...]
    segments: tuple[Segment, ...]
    reward: float
    turns: int
    tool_calls: int
    tool_errors: int
    """Tool results in its observations that say "error: ..." (a malformed call, an unknown tool, a bad argument)."""
    done: bool

    @property
    def tokens(self) -> list[int]:
        """Everything after the prompt, turns and observations, as the trainer passes it."""
        return [token for segment in self.segments for token in segment.tokens]

    @property
    def generated(self) -> list[bool]:
        """Per token of `tokens`: whether the model sampled it (only those train)."""
        return [segment.sampled for segment in self.segments for _ in segment.tokens]

    @property
    def log_probs(self) -> list[float]:
        """Per token of `tokens`: the engine's log-prob of a sampled one, 0 for an observation's (never read)."""
        return [
            log_prob
            for segment in self.segments
            for log_prob in (segment.log_probs if segment.log_probs is not None else [0.0] * len(segment.tokens))
        ]


class Conversation:
    """How an env run's tokenizer writes its episodes: the first observation as the model's prompt (fitted to the
    run's context as any prompt is), each later one as the tokens that follow a model turn. `tools`: the schemas the
    environment offers.

    The built-in models' tokenizer and one without a chat template read the observations as plain text (the built-in
    models spell only their alphabet: a character outside it is one line naming the environment). With a chat
    template, the first observation is the user's message (with the tools offered by the template where the parser
    is hermes: `toolcalls.render_prompt`), and each later one is what the template writes after the model's turn: the
    turn's end, a user message holding the observation, the next turn's start. A user's message rather than a tool's:
    an observation is the environment's whole answer, its tool results already written in the parser's convention
    (hermes: each in <tool_response>, which is how Qwen's and Hermes' templates write a tool's message, so the tokens
    are the template's own). A template that rewrites earlier turns (so that a conversation does not extend the one
    before it) has its observations read as plain text."""

    def __init__(
        self, config: LMTrainConfig, tokenizer: HFTokenizer | CharTokenizer, tools: Sequence[dict], context: int
    ):
        assert config.env is not None, "a conversation is an env run's"
        self.config, self.env, self.tokenizer, self.tools, self.context = config, config.env, tokenizer, tools, context
        self.template = (
            tokenizer.tokenizer if isinstance(tokenizer, HFTokenizer) and tokenizer.tokenizer.chat_template else None
        )

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def prompt(self, observation: str) -> list[int]:
        if self.template is None:
            ids = self._spelled(observation, self.tokenizer.prompt_ids)
        else:
            messages = [{"role": "user", "content": observation}]
            if self.env.parser == "hermes":
                text = render_prompt(self.template, messages, self.tools)
            else:
                text = self.template.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = self._encode(text)
        return fitted_prompt(self.config, ids, observation, self.context)

    def observation(self, text: str, last: int) -> list[int]:
        """The tokens of observation `text` after a model turn whose last token is `last`."""
        return self._encode(self.observation_text(text, last))

    def observation_text(self, text: str, last: int) -> str:
        if self.template is None:
            return text
        turn = [{"role": "user", "content": "?"}, {"role": "assistant", "content": TURN_MARK}]
        before = self.template.apply_chat_template(turn, tokenize=False)
        after = self.template.apply_chat_template(
            [*turn, {"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        if TURN_MARK not in before or not after.startswith(before):
            return text
        closing = before.split(TURN_MARK, 1)[1]
        if last in self.tokenizer.stop_ids:  # the turn ended with the template's own end of turn
            closing = closing.removeprefix(self.template.decode([last]))
        return closing + after[len(before) :]

    def _encode(self, text: str) -> list[int]:
        if isinstance(self.tokenizer, CharTokenizer):
            return self._spelled(text, self.tokenizer.encode)
        return self.tokenizer.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _spelled(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        try:
            return encode(text)
        except ValueError as error:  # a built-in model's alphabet
            raise ValueError(f"environment {self.env.name!r} wrote what the model cannot read: {error}") from None


@dataclass
class _Running:
    """A trajectory being rolled out: its request (the turn to decode next), what it holds so far, when its
    environment's wait ends."""

    sample: SampleId
    request: Request
    segments: list[Segment] = field(default_factory=list)
    ready_at: float = 0.0
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0

    def trajectory(self, done: bool) -> Trajectory:
        return Trajectory(
            self.sample,
            tuple(self.request.prompt),
            tuple(self.segments),
            self.reward,
            self.turns,
            self.tool_calls,
            self.tool_errors,
            done,
        )


def run_episodes(
    engine: Engine,
    host: EnvironmentHost,
    conversation: Conversation,
    samples: Sequence[SampleId],
    rows: Sequence[dict],
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[list[Trajectory], float]:
    """The trajectories of `samples` (in their order), each an episode of `host`'s environment reset from its row,
    decoded in rounds (the module's docstring), and the seconds the loop slept with every unfinished trajectory
    waiting on its environment. `clock` and `sleep` are the wall clock's, or a test's. On any failure the episodes'
    process is stopped (what it held goes with it) and the failure raised."""
    budget = engine.params.max_new_tokens
    try:
        running = {}
        for sample, row in zip(samples, rows):
            prompt = conversation.prompt(host.reset(sample, row))
            running[sample] = _Running(sample, Request(request_key(sample), prompt))
        _check_groups(host.name, {sample: state.request.prompt for sample, state in running.items()})
        finished: dict[SampleId, Trajectory] = {}
        slept = 0.0
        while running:
            now = clock()
            ready = [state for state in running.values() if state.ready_at <= now]
            if not ready:
                wait = min(state.ready_at for state in running.values()) - now
                sleep(wait)
                slept += wait
                continue
            for state, decoded in zip(ready, engine.generate([state.request for state in ready])):
                done = _answer(state, decoded, host, conversation, budget, clock)
                if done is not None:
                    finished[state.sample] = state.trajectory(done)
                    del running[state.sample]
                    host.close(state.sample)
                    engine.release(state.request.key)
    except BaseException:
        host.stop()
        raise
    return [finished[sample] for sample in samples], slept


def _answer(
    state: _Running, decoded: Request, host: EnvironmentHost, conversation: Conversation, budget: int, clock
) -> bool | None:
    """The environment's answer to the turn just decoded, taken into the trajectory: None while it goes on (its next
    turn's request ready after the step's wait), else whether the environment ended it."""
    start = state.request.turn_start
    turn = decoded.tokens[start:]
    state.segments.append(Segment(tuple(turn), tuple(decoded.log_probs[start:])))
    state.turns += 1
    stepped, observation, done = _stepped(host, conversation, budget, state.sample, turn, state.turns, decoded)
    state.tool_calls += len(stepped.turn.tool_calls)
    state.tool_errors += convention(host.parser).error_results(stepped.result.observation or "")
    state.reward += stepped.result.reward or 0.0
    if observation is None:
        return done
    if observation:
        state.segments.append(Segment(tuple(observation)))
    tokens = decoded.tokens + observation
    state.request = Request(
        decoded.key, decoded.prompt, tokens, decoded.log_probs + [0.0] * len(observation), turn_start=len(tokens)
    )
    state.ready_at = clock() + stepped.wait_s
    return None


def _stepped(
    host: EnvironmentHost,
    conversation: Conversation,
    budget: int,
    sample: SampleId,
    turn: Sequence[int],
    turns: int,
    decoded: Request,
) -> tuple[Stepped, list[int] | None, bool]:
    """The episode stepped on its trajectory's `turns`-th model turn `turn` (the trajectory `decoded` after it):
    the step, the observation's tokens the next turn follows (None where the trajectory ends here: its environment
    ended it, env.max_turns cut it, or no model token would fit after the observation) and whether the environment
    ended it. The rollout of either shape takes its answer from here."""
    stepped = host.step(sample, conversation.decode(turn))
    result = stepped.result
    if result.done:
        return stepped, None, True
    if turns >= conversation.env.max_turns:
        return stepped, None, False
    observation = [] if result.observation is None else conversation.observation(result.observation, turn[-1])
    if len(observation) >= budget - len(decoded.tokens):  # no model token could follow it
        return stepped, None, False
    return stepped, observation, False


def decode_turn(engine: Engine, state: Responses) -> Responses:
    """An env run with free waits (`env.free_waits`): one model turn of each trajectory of a shard still going,
    decoded as one batch from its `turn_starts` (the engine continues a trajectory whose cache it kept since its
    last turn, else re-prefills it: the same tokens, each draw keyed by the trajectory and the token's index). The
    ended ones pass through unchanged, their kept caches let go."""
    going = [i for i, ended in enumerate(state.finished) if not ended]
    for sample, ended in zip(state.samples, state.finished):
        if ended:
            engine.release(request_key(sample))
    if not going:
        return state
    requests = [
        Request(
            request_key(state.samples[i]),
            list(state.prompts[i]),
            list(state.tokens[i]),
            list(state.log_probs[i]),
            turn_start=state.turn_starts[i][-1],
        )
        for i in going
    ]
    tokens, log_probs, generated = list(state.tokens), list(state.log_probs), list(state.generated)
    for i, decoded in zip(going, engine.generate(requests)):
        tokens[i], log_probs[i] = decoded.tokens, decoded.log_probs
        generated[i] = generated[i] + [True] * (len(decoded.tokens) - len(state.tokens[i]))
    return replace(state, tokens=tokens, log_probs=log_probs, generated=generated)


class Episodes:
    """An env run's episodes off the devices, where its waits free them (`env.free_waits`): one per pipeline, in an
    actor of no device (`runtime.worker.EnvironmentWorker`), holding its environment's process (`EnvironmentHost`,
    each call within env.timeout_s). `ResetEpisodes` starts a shard's episodes; `StepEpisodes` steps those that
    just decoded a turn on it, appends their observations and answers once the longest of their waits has passed
    (the graph's env node: its shard's next turn follows it), sleeping here, on no device, while the policy fills
    the device. Shards' calls come concurrently (the actor's threads); the environment's process takes one at a
    time, the waits overlap.

    A worker that dies is restarted by Ray, which sends the calls it had in flight again to the new incarnation
    (`runtime.worker.EnvironmentWorker`); that one holds no episode, so a call that steps a trajectory whose episode
    is not open here opens it again first (`_reopen`): reset from its row and stepped on each of its earlier model
    turns, which its `Responses` hold (`turn_starts`). An environment answers alike given its row and the turns
    (its waits are drawn from the trajectory and the turn), so the episode stands where it stood: no turn is lost or
    taken twice."""

    def __init__(self, config: LMTrainConfig, *, sleep: Callable[[float], None] = time.sleep) -> None:
        env = config.env
        assert env is not None, "an env run's episodes"
        self.host = EnvironmentHost(env.name, env.options, env.parser, env.latency, config.seed, env.timeout_s)
        self.conversation = Conversation(config, load_run_tokenizer(config), self.host.tools(), model_context(config))
        self.prompts = RunPrompts(config)
        self.budget = config.max_new_tokens
        self.sleep = sleep
        self.lock = threading.Lock()
        self.open: set[SampleId] = set()
        """The trajectories whose episode this process holds (reset here, or opened again by `_reopen`)."""

    def run(self, work: ResetEpisodes | StepEpisodes) -> Responses:
        if isinstance(work, ResetEpisodes):
            return self.reset(work.samples, work.version)
        from dovetail.runtime.pipeline import PipelineEngines  # the runtime's, which the reference loop never loads

        (state,) = PipelineEngines.fetch(work.rollouts)
        stepped, wait = self.step(state)
        self.sleep(wait)
        return stepped

    def reset(self, samples: Sequence[SampleId], version: int) -> Responses:
        samples = [SampleId(*sample) for sample in samples]
        rows = [self.prompts.episode_row(self.prompts.train(s.step, s.prompt)) for s in samples]
        with self.lock:
            prompts = [self.conversation.prompt(self.host.reset(s, row)) for s, row in zip(samples, rows)]
            self.open.update(samples)
        _check_groups(self.host.name, dict(zip(samples, prompts)))
        empty: list[list] = [[] for _ in samples]
        return Responses(
            version,
            samples,
            prompts,
            empty,
            [[] for _ in samples],
            [False] * len(samples),
            [[] for _ in samples],
            [EpisodeFigures(0.0, 0, 0, 0, False, 0.0) for _ in samples],
            [[0] for _ in samples],
        )

    def _reopen(self, state: Responses, i: int) -> None:
        """Trajectory `i` of `state`'s episode opened again in this process (a restarted worker's: the class's
        docstring): reset from its row, its first observation checked against the trajectory's prompt, then stepped
        on each model turn before its latest (each runs from where it starts to its first observation token, or to
        the next turn's start where the environment answered nothing)."""
        sample = SampleId(*state.samples[i])
        row = self.prompts.episode_row(self.prompts.train(sample.step, sample.prompt))
        if self.conversation.prompt(self.host.reset(sample, row)) != list(state.prompts[i]):
            raise ValueError(
                f"environment {self.host.name!r} began trajectory {tuple(sample)} differently when its worker "
                "restarted and replayed it: reset(row) must answer a row alike each time (draw what varies from the "
                "seed and the turn)"
            )
        tokens, generated, starts = state.tokens[i], state.generated[i], state.turn_starts[i]
        for start, following in zip(starts, starts[1:]):
            end = start
            while end < following and generated[end]:
                end += 1
            self.host.step(sample, self.conversation.decode(tokens[start:end]))
        self.open.add(sample)

    def step(self, state: Responses) -> tuple[Responses, float]:
        """The trajectories of `state` that just decoded a turn stepped (`_stepped`, as the held rollout steps
        them), and the seconds the longest wait of those that go on takes; that wait is shared out evenly among
        the shard's trajectories' `waited_s`, as the held rollout shares what its engine slept."""
        tokens, log_probs, generated = list(state.tokens), list(state.log_probs), list(state.generated)
        finished, episodes, starts = list(state.finished), list(state.episodes), list(state.turn_starts)
        wait = 0.0
        with self.lock:
            for i, sample in enumerate(state.samples):
                if finished[i]:
                    continue
                sample = SampleId(*sample)
                if sample not in self.open:
                    self._reopen(state, i)
                turn = tokens[i][starts[i][-1] :]
                decoded = Request(request_key(sample), state.prompts[i], tokens[i], log_probs[i])
                figures = episodes[i]
                stepped, observation, done = _stepped(
                    self.host, self.conversation, self.budget, sample, turn, figures.turns + 1, decoded
                )
                figures = replace(
                    figures,
                    reward=figures.reward + (stepped.result.reward or 0.0),
                    turns=figures.turns + 1,
                    tool_calls=figures.tool_calls + len(stepped.turn.tool_calls),
                    tool_errors=figures.tool_errors
                    + convention(self.host.parser).error_results(stepped.result.observation or ""),
                )
                if observation is None:
                    finished[i], episodes[i] = True, replace(figures, done=done)
                    self.host.close(sample)
                    self.open.discard(sample)
                    continue
                episodes[i] = figures
                tokens[i] = tokens[i] + observation
                log_probs[i] = log_probs[i] + [0.0] * len(observation)
                generated[i] = generated[i] + [False] * len(observation)
                starts[i] = [*starts[i], len(tokens[i])]
                wait = max(wait, stepped.wait_s)
        share = wait / len(state.samples)
        episodes = [replace(e, waited_s=e.waited_s + share) for e in episodes]
        return (
            replace(
                state,
                tokens=tokens,
                log_probs=log_probs,
                generated=generated,
                finished=finished,
                episodes=episodes,
                turn_starts=starts,
            ),
            wait,
        )

    def stop(self) -> None:
        self.host.stop()


def _check_groups(environment: str, prompts: dict[SampleId, list[int]]) -> None:
    """A GRPO group answers one prompt: every member's first observation must be the same."""
    for group in by_group(prompts):
        different = [sample for sample in group if prompts[sample] != prompts[group[0]]]
        if different:
            raise ValueError(
                f"environment {environment!r} began trajectories {tuple(group[0])} and {tuple(different[0])} of one "
                "group with different observations: a GRPO group answers one prompt, so reset(row) must answer a row "
                "alike each time (draw what varies in step)"
            )


def trajectory_responses(trajectories: Sequence[Trajectory], version: int, waited_s: float) -> Responses:
    """Trajectories as the trainer takes responses: the whole of each, with the mask of what the model sampled, and
    their episodes (`waited_s`: the seconds their rollout slept with every trajectory waiting, shared out evenly)."""
    share = waited_s / len(trajectories) if trajectories else 0.0
    return Responses(
        version=version,
        samples=[t.sample for t in trajectories],
        prompts=[list(t.prompt) for t in trajectories],
        tokens=[t.tokens for t in trajectories],
        log_probs=[t.log_probs for t in trajectories],
        finished=[True] * len(trajectories),
        generated=[t.generated for t in trajectories],
        episodes=[EpisodeFigures(t.reward, t.turns, t.tool_calls, t.tool_errors, t.done, share) for t in trajectories],
    )


def with_episode_rewards(scores: dict[str, np.ndarray], rewards: Sequence[float]) -> dict[str, np.ndarray]:
    """The environment's rewards (`env`) added to the text rewards `scores` holds of the same trajectories (the
    config's, none unless named): an env run's scores, and their total."""
    env = np.array(rewards, dtype=np.float64)
    named = {name: values for name, values in scores.items() if name != "total"}
    return {"env": env, **named, "total": env + scores["total"]}


def episode_figures(episodes: Sequence[EpisodeFigures]) -> dict[str, np.ndarray]:
    """Per trajectory, what a step's metrics report of its episode (`episode_metrics` reads them)."""
    return {
        "env/turns": np.array([e.turns for e in episodes], dtype=np.float64),
        "env/tool_calls": np.array([e.tool_calls for e in episodes], dtype=np.float64),
        "env/tool_errors": np.array([e.tool_errors for e in episodes], dtype=np.float64),
        "env/unfinished": np.array([not e.done for e in episodes], dtype=np.float64),
        "env/wait_s": np.array([e.waited_s for e in episodes], dtype=np.float64),
    }


def episode_metrics(figures: dict[str, np.ndarray]) -> dict[str, float]:
    """Per step, from its trajectories' `episode_figures`: the episodes' mean turns, tool calls and erroneous tool
    results, the share cut before their environment ended them, and the seconds the rollout waited on environments
    with nothing to decode (its engines' waits, summed)."""
    return {name: float(values.sum() if name == "env/wait_s" else values.mean()) for name, values in figures.items()}
