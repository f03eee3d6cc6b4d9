"""What an environment and its tools are, as a multi-turn rollout sees them: the model's `Turn` (its text and the tool
calls read from it), the environment's answer (`StepResult`), the `Environment` a user writes, a `Tool` it offers the
model, and the `Latency` of each, which a run on this machine waits out to reproduce real sandboxes' and APIs'."""

import json
import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dovetail.graph.node import sample_key

MAX_WAIT_S = 3600.0
"""The longest wait a latency gives: a lognormal's tail is cut there, so one draw cannot stall a run for a day."""


class Latency(BaseModel):
    """How long a tool call or an environment's step takes, as the trajectory waiting on it sees it: `constant`
    (`seconds` each time) or `lognormal` (`median_s`, and `sigma` the spread of log(wait): most waits short, a few
    long, as sandboxes and APIs are). Each wait is drawn by `draw` from a generator keyed by who waits, never by a
    process's RNG, so a run waits the same every time it runs, in whatever process. It is a config section:
    ``{kind: constant, seconds: 0.2}`` or ``{kind: lognormal, median_s: 0.5, sigma: 0.8}``."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    kind: Literal["constant", "lognormal"] = "constant"
    seconds: float = Field(0.0, ge=0, le=MAX_WAIT_S, description="constant: every wait, in seconds")
    median_s: float | None = Field(None, gt=0, le=MAX_WAIT_S, description="lognormal: the median wait, in seconds")
    sigma: float | None = Field(
        None, ge=0, le=4, description="lognormal: the standard deviation of log(wait); beyond 4 the tail is all"
    )

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> "Latency":
        if self.kind == "constant" and (self.median_s is not None or self.sigma is not None):
            raise ValueError("median_s and sigma are a lognormal latency's: set kind: lognormal, or give seconds alone")
        if self.kind == "lognormal" and (self.median_s is None or self.sigma is None or self.seconds):
            raise ValueError(
                "a lognormal latency takes median_s and sigma, not seconds: e.g. {kind: lognormal, median_s: 0.5, "
                "sigma: 0.8}"
            )
        return self

    def draw(self, *identity: int | str) -> float:
        """Seconds of one wait: the same for the same `identity` (the run's seed, the trajectory's SampleId, the
        turn, what waits), whatever process draws it. The runtime decides how to wait them; nothing here sleeps."""
        if self.kind == "constant":
            return self.seconds
        assert self.median_s is not None and self.sigma is not None  # the validator holds them for a lognormal
        normal = random.Random(sample_key("latency", *identity)).gauss(0.0, 1.0)
        return min(self.median_s * math.exp(self.sigma * normal), MAX_WAIT_S)


NO_LATENCY = Latency()


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, object]


@dataclass(frozen=True)
class MalformedCall:
    """A call the model began but that cannot be read (not JSON, no name...): `text` is what it wrote, `error` why
    it cannot be read. The environment answers it with the error, as a tool would answer a bad argument: the model
    learns to write calls from such answers, and the run never stops on one."""

    text: str
    error: str


@dataclass(frozen=True)
class Turn:
    """One turn of the model: its `text`, the tool calls read from it in order (`parsers.parse_turn`), the tool-call
    convention they were read with (`parser`, which also writes their results: `tools.call_tools`) and its number in
    the episode (`index`, from 0)."""

    text: str
    tool_calls: tuple[ToolCall | MalformedCall, ...] = ()
    parser: str = "hermes"
    index: int = 0


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to a turn: the `observation` the model sees next (None: nothing to add), a `reward`
    for the turn (None: none now; a trajectory's reward is the sum of those given, 0 where none is) and whether the
    episode is `done`."""

    observation: str | None = None
    reward: float | None = None
    done: bool = False


class Tool(ABC):
    """A function the model may call by name with one string argument (`argument`). `run` answers with the text the
    model sees, always: a bad input, an error or a limit reached is said in that text, never raised into the run.
    `schema` is the tool as chat templates take it (transformers' `apply_chat_template(tools=...)`)."""

    name: str
    latency: Latency
    description: str
    argument: str
    argument_description: str

    @abstractmethod
    def run(self, argument: str) -> str:
        """The answer to one call."""

    def __call__(self, call: ToolCall) -> str:
        """The answer to a call by name: `run` on its one argument, or what is wrong with the call."""
        value = call.arguments.get(self.argument)
        if set(call.arguments) != {self.argument} or not isinstance(value, str):
            given = json.dumps(call.arguments)[:200]
            return f"error: {self.name} takes one argument, {self.argument!r} (a string); got {given}"
        return self.run(value)

    def schema(self) -> dict:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {self.argument: {"type": "string", "description": self.argument_description}},
                    "required": [self.argument],
                },
            },
        }


class Environment(ABC):
    """What a multi-turn rollout talks to. Write a subclass in your own module and name it in the run config as
    "package.module:Class" (`env.name`), as a reward is named; `env.options` are its constructor's keyword
    arguments. A run makes one instance per trajectory, so an episode's state lives in its attributes; calls
    `reset` with the trajectory's dataset row, then `step` on each model turn until a result is `done`.

    `tools` are what the model may call: the prompt offers them (through the model's chat template, or described by
    you for a plain parser) and `toolcalls.call_tools` answers a turn's calls of them. Each tool has its latency; a
    step's own is the run's (`env.latency`)."""

    tools: tuple[Tool, ...] = ()

    @abstractmethod
    def reset(self, row: dict) -> str:
        """Start an episode from its dataset row; return the first observation (the text the model's first turn
        answers: the row's question, with what the environment adds)."""

    @abstractmethod
    def step(self, turn: Turn) -> StepResult:
        """Answer one model turn."""
