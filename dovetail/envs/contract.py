"""What an environment and its tools are, as a multi-turn rollout sees them: the model's `Turn` (its text and the tool
calls read from it), the environment's answer (`StepResult`), the `Environment` a user writes, a `Tool` it offers the
model, and the `Latency` of each (`graph.latency`), which a run on this machine waits out to reproduce real sandboxes'
and APIs'."""

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass

from dovetail.graph.latency import NO_LATENCY as NO_LATENCY  # the shape the planner prices too: graph.latency
from dovetail.graph.latency import Latency as Latency


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
