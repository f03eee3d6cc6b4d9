"""One trajectory's episode: its environment (one instance per trajectory), its turns read with the run's tool-call
parser, each environment answer checked, and the wait each step costs drawn from the trajectory's identity. What a
multi-turn rollout does between two model turns, in this process (`host.py` runs episodes in another)."""

import math
import numbers
from dataclasses import dataclass

from dovetail.envs.contract import Environment, Latency, StepResult, ToolCall, Turn
from dovetail.envs.toolcalls import convention, parse_turn
from dovetail.graph.node import SampleId
from dovetail.rewards import RewardError
from dovetail.rewards.process import describe


class EnvironmentFailed(RewardError):
    """An environment raised, returned what is not an answer, overran its time or ended its process; the message
    names it, the trajectory and the turn, in one line. The environment gives an env run's reward, so a run stops on
    it as on a failed reward: its last step saved, to resume from once the environment is fixed."""


@dataclass(frozen=True)
class Stepped:
    """A step's outcome: the model's turn as read, the environment's answer, and the seconds the step waits (the
    environment's latency and that of each tool the turn called: `Episode.wait_s`)."""

    turn: Turn
    result: StepResult
    wait_s: float


class Episode:
    """Environment `name`'s episode for trajectory `sample` of a run seeded `seed`: `reset` with its dataset row,
    then `step` on each model turn's text until the answer is done. `parser` reads the turns' tool calls; each step
    waits `latency` (the run's `env.latency`) besides its tools' own."""

    def __init__(self, environment: Environment, name: str, parser: str, latency: Latency, seed: int, sample: SampleId):
        convention(parser)  # an unknown parser is refused before the first turn
        self.environment = environment
        self.latency = latency
        self.name = name
        self.parser = parser
        self.seed = seed
        self.sample = SampleId(*sample)
        self.turns = 0
        self.done = False

    def where(self, doing: str) -> str:
        return f"environment {self.name!r} {doing} (trajectory {tuple(self.sample)}, turn {self.turns})"

    def reset(self, row: dict) -> str:
        try:
            observation = self.environment.reset(dict(row))
        except Exception as error:
            raise EnvironmentFailed(f"{self.where('raised in reset')}: {describe(error)}") from None
        if not isinstance(observation, str):
            raise EnvironmentFailed(
                f"{self.where('reset')} returned a {type(observation).__name__}; return the first observation, a str"
            )
        return observation

    def step(self, text: str) -> Stepped:
        if self.done:
            raise EnvironmentFailed(self.where("was stepped after its episode was done"))
        turn = parse_turn(text, self.environment.tools, self.parser, self.turns)
        try:
            result = self.environment.step(turn)
        except Exception as error:
            raise EnvironmentFailed(f"{self.where('raised in step')}: {describe(error)}") from None
        checked = self._checked(result)
        stepped = Stepped(turn, checked, self.wait_s(turn))
        self.turns += 1
        self.done = checked.done
        return stepped

    def wait_s(self, turn: Turn) -> float:
        """The seconds turn `turn` waits: the environment's latency, and that of each tool its well-formed calls
        name, each drawn from this trajectory's identity, the turn and the call (`Latency.draw`)."""
        identity = (self.seed, *self.sample, turn.index)
        tools = {tool.name: tool for tool in self.environment.tools}
        wait = self.latency.draw(*identity, "environment")
        for i, call in enumerate(turn.tool_calls):
            if isinstance(call, ToolCall) and call.name in tools:
                wait += tools[call.name].latency.draw(*identity, i, call.name)
        return wait

    def _checked(self, result: object) -> StepResult:
        """The answer as the rollout reads it (a reward a float), or an EnvironmentFailed saying what to return."""
        if not isinstance(result, StepResult):
            raise EnvironmentFailed(
                f"{self.where('step')} returned a {type(result).__name__}; return a StepResult(observation, reward, "
                "done)"
            )
        if result.observation is not None and not isinstance(result.observation, str):
            raise EnvironmentFailed(f"{self.where('step')} gave an observation that is no str or None")
        reward = result.reward
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)):
            raise EnvironmentFailed(f"{self.where('step')} gave a reward that is no number or None: {reward!r}")
        if reward is not None and not math.isfinite(float(reward)):
            raise EnvironmentFailed(f"{self.where('step')} gave the reward {reward}")
        if not isinstance(result.done, bool):
            raise EnvironmentFailed(f"{self.where('step')} gave done={result.done!r}; give True or False")
        return StepResult(result.observation, None if reward is None else float(reward), result.done)
