"""The built-in `arithmetic` environment: a product of two numbers too long for a small model to multiply in its
head, and the calculator to do it with. The base of a shipped agentic task: the reward needs the tool."""

import random

from dovetail.envs.contract import NO_LATENCY, Environment, Latency, StepResult, Turn
from dovetail.envs.toolcalls import tools_then_answer
from dovetail.envs.tools import Calculator
from dovetail.graph.node import sample_key


class Arithmetic(Environment):
    """Each episode asks its row's `question` and checks the final answer against its `answer` column. A turn that
    calls the calculator is answered with its results; the first turn without a call is the final answer: reward 1
    where its answer (its last number, or a \\boxed{} or <answer> one) is the row's, else 0, and done. An episode
    still calling tools at turn `max_turns` ends with reward 0.

    Options (`env.options`): `max_turns`, and `tool_latency`, the calculator's (a `Latency` section)."""

    def __init__(self, max_turns: int = 4, tool_latency: Latency | dict | None = None):
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r}: give a whole number of turns, at least 1")
        self.max_turns = max_turns
        calculator_latency = NO_LATENCY if tool_latency is None else Latency.model_validate(tool_latency)
        self.tools = (Calculator(latency=calculator_latency),)
        self.answer = ""

    def reset(self, row: dict) -> str:
        missing = [column for column in ("question", "answer") if column not in row]
        if missing:
            raise ValueError(f"an arithmetic row has a question and an answer column; this one has no {missing[0]}")
        self.answer = str(row["answer"])
        return str(row["question"])

    def step(self, turn: Turn) -> StepResult:
        return tools_then_answer(turn, self.tools, self.max_turns, self.answer)


def arithmetic_rows(count: int, digits: int, seed: int) -> list[dict[str, str]]:
    """`count` rows of products of two `digits`-digit numbers, row i drawn from (seed, i) alone: the dataset of an
    arithmetic run."""
    rows = []
    for i in range(count):
        draw = random.Random(sample_key(seed, "arithmetic", i))
        a, b = (draw.randrange(10 ** (digits - 1), 10**digits) for _ in range(2))
        rows.append({"question": f"What is {a} * {b}?", "answer": str(a * b)})
    return rows
