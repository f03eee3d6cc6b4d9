"""Synthetic text tasks whose answers a rule can verify: what GRPO trains the tiny language model on.

Every completion has one shape: an optional scratchpad, the answer marker ">", the final answer, the end marker
".". Problem sizes are drawn uniformly, so ideal completions range from a few tokens to seventy and more: the
rollouts of one batch have the long tail that the scheduler must hide.

A prompt names its task by its first word, so a reward recognises the task from the prompt alone, and the answer
is always derived from the prompt, never stored. Problems are split into train and eval by a hash of the prompt
text, so the two splits never share a problem whichever seed or index drew it.
"""

import ast
import hashlib
import math
import random
import re
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import lru_cache
from typing import ClassVar, NamedTuple

ANSWER_MARKER = ">"
END_MARKER = "."
SPLITS = ("train", "eval")
EVAL_ONE_IN = 10  # one problem in ten is held out for evaluation
LENGTH_MARGIN = 8  # tokens allowed past the longest ideal completion, so a slightly long answer is still scored


def split_of(prompt: str) -> str:
    """The split a problem belongs to, from a hash of its text (stable across Python processes, unlike hash())."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % EVAL_ONE_IN == 0 else "train"


def final_answer(completion: str) -> str | None:
    """The text between the last answer marker and the first end marker; None if either is missing."""
    body, end, _ = completion.partition(END_MARKER)
    if not end or ANSWER_MARKER not in body:
        return None
    return body.rpartition(ANSWER_MARKER)[2]


class Task(ABC):
    """A family of problems: draws prompts, writes their ideal completions, and checks final answers."""

    name: str
    prefix: ClassVar[str]  # every prompt starts with it
    pretrain_steps: ClassVar[int] = 200  # `dovetail pretrain TASK`'s default: the shipped base model's steps
    completion_pattern: ClassVar[re.Pattern]  # what a well-formed completion looks like, scratchpad included
    environment: ClassVar[str | None] = None
    """The built-in environment whose episodes an agentic task's problems are (`dovetail.envs`; a run of the task
    names it in its `env:` section); None: a problem is one completion, scored by the task's reward."""
    observation_pattern: ClassVar[re.Pattern | None] = None
    """What in an agentic task's completion its environment writes (a tool's result), not the model: pretraining
    keeps it out of the loss, as RL does."""
    alphabet: ClassVar[str | None] = None
    """The characters the task's model reads and writes; None: the tokenizer's default alphabet."""

    @property
    def reward_names(self) -> dict[str, float]:
        """The rewards (and weights) a GRPO run on this task uses unless told otherwise."""
        return {"exact_answer": 1.0}

    @property
    @abstractmethod
    def max_new_tokens(self) -> int:
        """The longest ideal completion in tokens, its end of sequence and LENGTH_MARGIN."""

    @abstractmethod
    def draw(self, rng: random.Random) -> str:
        """A prompt drawn from the whole problem space, either split."""

    @abstractmethod
    def solution(self, prompt: str) -> str:
        """The ideal completion of the prompt: scratchpad, answer marker, answer, end marker."""

    @abstractmethod
    def is_correct(self, prompt: str, answer: str) -> bool:
        """Whether answer (the text after the answer marker) solves the prompt's problem."""

    def for_pretraining(self, progress: float) -> "Task":
        """The task whose problems and completions pretraining trains on at `progress` (0 to 1) through its steps:
        this one, unless RL's problem mix would leave the base model unable to reach part of it (`Copy`) or its
        completions are best learned in stages (`Calc`)."""
        return self

    def prompt(self, split: str, seed: int, index: int) -> str:
        """The index-th prompt of split under seed: the same arguments give the same prompt in any process."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        attempt = 0
        while True:
            prompt = self.draw(random.Random(f"{self.name}/{split}/{seed}/{index}/{attempt}"))
            if split_of(prompt) == split:
                return prompt
            attempt += 1

    def episode_row(self, prompt: str) -> dict[str, str]:
        """The problem as an environment's dataset row (an env run of the task resets its episodes from it): the
        prompt as its `question` and the final answer of its ideal completion as its `answer`, the columns the
        built-in `arithmetic` environment reads."""
        answer = final_answer(self.solution(prompt))
        assert answer is not None, f"{self.name}'s solution of {prompt!r} has no final answer"
        return {"question": prompt, "answer": answer}

    def prompts(self, split: str, seed: int, step: int, count: int) -> list[str]:
        """The count prompts of an RL step: consecutive indices, so steps of one run never repeat a draw."""
        return [self.prompt(split, seed, step * count + i) for i in range(count)]

    def is_well_formed(self, completion: str) -> bool:
        return self.completion_pattern.fullmatch(completion) is not None

    def _match(self, pattern: re.Pattern, prompt: str) -> re.Match:
        match = pattern.fullmatch(prompt)
        if match is None:
            raise ValueError(f"prompt {prompt!r} is not a {self.name} prompt (expected {pattern.pattern!r})")
        return match


@dataclass(frozen=True)
class Addition(Task):
    """Add two numbers of 1..max_digits digits column by column, right to left, carries written out.

    ``add 57+968:`` -> ``7+8+0=15,5+6+1=12,0+9+1=10>1025.``: one column per digit of the longer operand, so the
    length of the scratchpad follows the operands.
    """

    name: str = "arithmetic"
    max_digits: int = 7
    prefix: ClassVar[str] = "add "
    prompt_pattern: ClassVar[re.Pattern] = re.compile(r"add (\d+)\+(\d+):")
    completion_pattern: ClassVar[re.Pattern] = re.compile(r"\d\+\d\+[01]=\d{1,2}(,\d\+\d\+[01]=\d{1,2})*>\d+\.")

    @property
    def max_new_tokens(self) -> int:
        longest = "9" * self.max_digits
        return len(self.solution(f"add {longest}+{longest}:")) + 1 + LENGTH_MARGIN

    def draw(self, rng: random.Random) -> str:
        a, b = (self._number(rng.randint(1, self.max_digits), rng) for _ in range(2))
        return f"add {a}+{b}:"

    @staticmethod
    def _number(digits: int, rng: random.Random) -> int:
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    def solution(self, prompt: str) -> str:
        a, b = self._match(self.prompt_pattern, prompt).groups()
        width = max(len(a), len(b))
        columns, carry = [], 0
        for da, db in zip(reversed(a.zfill(width)), reversed(b.zfill(width))):
            total = int(da) + int(db) + carry
            columns.append(f"{da}+{db}+{carry}={total}")
            carry = total // 10
        return ",".join(columns) + f"{ANSWER_MARKER}{int(a) + int(b)}{END_MARKER}"

    def is_correct(self, prompt: str, answer: str) -> bool:
        a, b = self._match(self.prompt_pattern, prompt).groups()
        return answer == str(int(a) + int(b))


@dataclass(frozen=True)
class Sort(Task):
    """Sort 1..max_items distinct letters alphabetically: ``sort qdax:`` -> ``>adqx.``.

    Letters, one token each, and distinct, so the next letter is always the smallest one in the prompt above the
    last written: a content lookup that a tiny model learns within minutes. Numbers of several characters need
    it to compare spans first, which it does not learn in a CPU-minutes budget.
    """

    name: str = "sort"
    max_items: int = 20
    prefix: ClassVar[str] = "sort "
    prompt_pattern: ClassVar[re.Pattern] = re.compile(r"sort ([a-z]+):")
    completion_pattern: ClassVar[re.Pattern] = re.compile(r">[a-z]+\.")

    @property
    def max_new_tokens(self) -> int:
        return len(self.solution(f"sort {string.ascii_lowercase[: self.max_items]}:")) + 1 + LENGTH_MARGIN

    def draw(self, rng: random.Random) -> str:
        return f"sort {''.join(rng.sample(string.ascii_lowercase, rng.randint(1, self.max_items)))}:"

    def _sorted(self, prompt: str) -> str:
        return "".join(sorted(self._match(self.prompt_pattern, prompt).group(1)))

    def solution(self, prompt: str) -> str:
        return f"{ANSWER_MARKER}{self._sorted(prompt)}{END_MARKER}"

    def is_correct(self, prompt: str, answer: str) -> bool:
        return answer == self._sorted(prompt)


@dataclass(frozen=True)
class Copy(Task):
    """Copy a string of letters: ``copy qdqax:`` -> ``>qdqax.``, its length drawn from a lognormal (median
    `median_letters`, log-spread `sigma`), so that most responses are a few tokens and a few are ten times longer:
    the heavy tail of published RL response lengths (p99 / p50 of about 10 here, tests/test_lm_tasks.py), which keeps
    a synchronous step waiting on its longest responses and leaves a multiplexing policy time to fill. Copying is an
    induction head's job: a tiny model learns it within minutes, and slips on the long ones at temperature 1."""

    name: str = "copy"
    median_letters: float = 2.0
    sigma: float = 1.35
    max_letters: int = 52
    uniform: bool = False
    """Lengths uniform in 1..max_letters instead: what pretraining draws, so that the base model can copy a string of
    any length (rarely right whole at temperature 1), and RL's tail is reachable."""
    prefix: ClassVar[str] = "copy "
    pretrain_steps: ClassVar[int] = 300  # held-out success ~0.2 sampled at temperature 1, ~0.65 greedy

    @property
    def reward_names(self) -> dict[str, float]:
        return {"copied": 1.0}

    prompt_pattern: ClassVar[re.Pattern] = re.compile(r"copy ([a-z]+):")
    completion_pattern: ClassVar[re.Pattern] = re.compile(r">[a-z]+\.")

    @property
    def max_new_tokens(self) -> int:
        return len(self.solution(f"copy {'a' * self.max_letters}:")) + 1 + LENGTH_MARGIN

    def for_pretraining(self, progress: float) -> "Task":
        return replace(self, uniform=True)

    def draw(self, rng: random.Random) -> str:
        if self.uniform:
            letters = rng.randint(1, self.max_letters)
        else:
            letters = min(
                self.max_letters, max(1, round(rng.lognormvariate(math.log(self.median_letters), self.sigma)))
            )
        return f"copy {''.join(rng.choices(string.ascii_lowercase, k=letters))}:"

    def _text(self, prompt: str) -> str:
        return self._match(self.prompt_pattern, prompt).group(1)

    def solution(self, prompt: str) -> str:
        return f"{ANSWER_MARKER}{self._text(prompt)}{END_MARKER}"

    def is_correct(self, prompt: str, answer: str) -> bool:
        return answer == self._text(prompt)


CALCULATOR_CALL = "<calc>{}</calc>"
CALCULATOR_RESULT = "<result>{}</result>"
"""A call of the `arithmetic` environment's calculator and its answer, as the `plain` tool-call parser reads and
writes them (`dovetail.envs.toolcalls`; tests/test_lm_tasks.py holds the two alike)."""


class ToolTask(Task):
    """A task whose base model learns, from pretraining alone, to call its environment's tool sometimes: `tool_share`
    of its ideal completions call the tool (chosen by a hash of the prompt, so any one prompt's is fixed), the others
    answer at once, which the model learns to write but rarely gets right, so GRPO has calls to reinforce. Copying a
    string into the call and the result into the answer is what the tiny model learns slowest, and the direct answers,
    characters it cannot predict, drown it: so pretraining goes in two stages (`for_pretraining`), its first
    `tool_only` share of the steps every completion calling the tool, then the mix."""

    tool_share: float
    tool_only: float

    def for_pretraining(self, progress: float) -> "Task":
        return replace(self, tool_share=1.0) if progress < self.tool_only else self  # type: ignore[type-var]

    def calls_tool(self, prompt: str) -> bool:
        """Whether the prompt's ideal completion calls the tool: a share `tool_share` of the problems."""
        digest = hashlib.sha256(f"{self.name}/tool/{prompt}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.tool_share


@dataclass(frozen=True)
class Calc(ToolTask):
    """Multiply two numbers of min_digits..max_digits digits, with a calculator: ``calc 4821*937:`` ->
    ``<calc>4821*937</calc><result>4517277</result>>4517277.``, or at once, ``>4517277.``.

    An agentic task: its problems are episodes of the built-in `arithmetic` environment with the `plain` parser
    (configs/calc.yaml). The model's turn stops where its call closes, the environment answers with the calculator's
    result, and the next turn copies it out; the first turn without a call is the answer. Products this long are
    beyond what the 1 M-parameter model computes in its head, so the answer needs the tool.

    Its base model learns the format from a mix: `tool_share` of the ideal completions call the calculator (chosen
    by a hash of the prompt, so any one prompt's is fixed), the others answer at once, which the model learns to
    write but rarely gets right. It calls the tool sometimes, so GRPO has calls to reinforce. Copying digit strings
    (the expression into the call, the result into the answer) is what the 1 M-parameter model learns slowest, and
    the mix's direct answers, digits it cannot predict, drown it: pretrained on the mix alone for 2000 steps it
    still copies no call right. So pretraining goes in two stages (`for_pretraining`): its first `tool_only` share
    of the steps every completion calls the tool, then the mix. Its alphabet is every printable ASCII character:
    the calculator's error messages (a quoted expression, say) are spelled in it, so whatever the model writes in a
    call, it can read the answer.
    """

    name: str = "calc"
    min_digits: int = 3
    max_digits: int = 6
    tool_share: float = 0.5
    tool_only: float = 0.5
    prefix: ClassVar[str] = "calc "
    pretrain_steps: ClassVar[int] = 1000
    environment: ClassVar[str | None] = "arithmetic"
    observation_pattern: ClassVar[re.Pattern | None] = re.compile(r"<result>.*?</result>")
    alphabet: ClassVar[str | None] = "".join(map(chr, range(32, 127)))  # printable ASCII
    prompt_pattern: ClassVar[re.Pattern] = re.compile(r"calc (\d+)\*(\d+):")
    completion_pattern: ClassVar[re.Pattern] = re.compile(r"(<calc>\d+\*\d+</calc><result>\d+</result>)?>\d+\.")

    @property
    def max_new_tokens(self) -> int:
        longest = "9" * self.max_digits
        return len(self._with_tool(f"{longest}*{longest}", int(longest) ** 2)) + 1 + LENGTH_MARGIN

    def draw(self, rng: random.Random) -> str:
        a, b = (Addition._number(rng.randint(self.min_digits, self.max_digits), rng) for _ in range(2))
        return f"calc {a}*{b}:"

    def _product(self, prompt: str) -> tuple[str, int]:
        a, b = self._match(self.prompt_pattern, prompt).groups()
        return f"{a}*{b}", int(a) * int(b)

    @staticmethod
    def _with_tool(expression: str, product: int) -> str:
        call, result = CALCULATOR_CALL.format(expression), CALCULATOR_RESULT.format(product)
        return f"{call}{result}{ANSWER_MARKER}{product}{END_MARKER}"

    def solution(self, prompt: str) -> str:
        expression, product = self._product(prompt)
        if self.calls_tool(prompt):
            return self._with_tool(expression, product)
        return f"{ANSWER_MARKER}{product}{END_MARKER}"

    def is_correct(self, prompt: str, answer: str) -> bool:
        return answer == str(self._product(prompt)[1])


LOOKUP_CALL = "<lookup>{}</lookup>"
"""A call of the `lookup` environment's table, as the `plain` parser reads it; its answer is a CALCULATOR_RESULT."""
KEY_LETTERS = 3
"""The built-in lookup table's keys: every string of this many lowercase letters (17,576)."""


def lookup_value(key: str, table_seed: int = 0) -> str:
    """The built-in lookup table's entry of `key`: six digits from a hash of (table_seed, key), which no model can
    compute from the key: a `lookup` problem's answer is only in its environment's table (`envs.lookup`)."""
    digest = hashlib.sha256(f"lookup/{table_seed}/{key}".encode()).digest()
    return str(100_000 + int.from_bytes(digest[:8], "big") % 900_000)


@dataclass(frozen=True)
class LookupTask(ToolTask):
    """Say the value of a key: ``lookup qxv:`` -> ``<lookup>qxv</lookup><result>583920</result>>583920.``, or a guess
    at once, ``>583920.``.

    An agentic task whose answer is only in the environment: its problems are episodes of the built-in `lookup`
    environment (`envs.lookup.KeyLookup`, the `plain` parser; configs/lookup.yaml), whose table keys every
    `KEY_LETTERS`-letter string to a value hashed from it (`lookup_value`), which no model computes and, with the
    eval keys held out, none has seen. The row an episode resets from holds the key, not the value
    (`episode_row`): the environment checks the answer against its own table. Pretrained as `Calc` is (`ToolTask`).
    """

    name: str = "lookup"
    tool_share: float = 0.5
    tool_only: float = 0.5
    prefix: ClassVar[str] = "lookup "
    pretrain_steps: ClassVar[int] = 600
    environment: ClassVar[str | None] = "lookup"
    observation_pattern: ClassVar[re.Pattern | None] = re.compile(r"<result>.*?</result>")
    alphabet: ClassVar[str | None] = "".join(map(chr, range(32, 127)))  # printable ASCII: the tool's errors too
    prompt_pattern: ClassVar[re.Pattern] = re.compile(rf"lookup ([a-z]{{{KEY_LETTERS}}}):")
    completion_pattern: ClassVar[re.Pattern] = re.compile(r"(<lookup>[a-z]+</lookup><result>\d+</result>)?>\d+\.")

    @property
    def max_new_tokens(self) -> int:
        return len(self._with_tool("a" * KEY_LETTERS, "9" * 6)) + 1 + LENGTH_MARGIN

    def draw(self, rng: random.Random) -> str:
        return f"lookup {''.join(rng.choices(string.ascii_lowercase, k=KEY_LETTERS))}:"

    def key(self, prompt: str) -> str:
        return self._match(self.prompt_pattern, prompt).group(1)

    def episode_row(self, prompt: str) -> dict[str, str]:
        """The question and its key, no answer: the environment's table has it."""
        return {"question": prompt, "key": self.key(prompt)}

    @staticmethod
    def _with_tool(key: str, value: str) -> str:
        return f"{LOOKUP_CALL.format(key)}{CALCULATOR_RESULT.format(value)}{ANSWER_MARKER}{value}{END_MARKER}"

    def solution(self, prompt: str) -> str:
        key = self.key(prompt)
        if self.calls_tool(prompt):
            return self._with_tool(key, lookup_value(key))
        return f"{ANSWER_MARKER}{lookup_value(key)}{END_MARKER}"

    def is_correct(self, prompt: str, answer: str) -> bool:
        return answer == lookup_value(self.key(prompt))


class ExpressionError(ValueError):
    """An expression uses something other than +, -, *, / on small integer literals, or is too big."""


class Evaluated(NamedTuple):
    value: Fraction
    literals: tuple[int, ...]  # in the order written


MAX_EXPRESSION_CHARS = 200  # checked before parsing: ast.parse of a huge text is itself costly
MAX_EXPRESSION_NODES = 64
MAX_LITERAL = 10_000
MAX_MAGNITUDE = 10**12  # bound on every intermediate numerator and denominator
_OPERATIONS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__}


def evaluate_expression(text: str) -> Evaluated:
    """Exact value of an arithmetic expression, walking its syntax tree: never eval.

    Only binary +, -, *, / on non-negative integer literals up to MAX_LITERAL are allowed; division is exact
    (fractions). Raises ExpressionError for anything else and ZeroDivisionError for a division by zero.
    """
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression of {len(text)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as error:
        raise ExpressionError(f"{text!r} does not parse: {error.msg}") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > MAX_EXPRESSION_NODES:
        raise ExpressionError(f"{text!r} has {nodes} syntax nodes; at most {MAX_EXPRESSION_NODES}")
    literals: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            if node.value > MAX_LITERAL:
                raise ExpressionError(f"literal {node.value} is above {MAX_LITERAL}")
            literals.append(node.value)
            return Fraction(node.value)
        if not isinstance(node, ast.BinOp) or type(node.op) not in (*_OPERATIONS, ast.Div):
            raise ExpressionError(f"{ast.unparse(node)!r} is not allowed: only + - * / on integer literals")
        left, right = walk(node.left), walk(node.right)
        value = left / right if isinstance(node.op, ast.Div) else _OPERATIONS[type(node.op)](left, right)
        if max(abs(value.numerator), value.denominator) > MAX_MAGNITUDE:
            raise ExpressionError(f"{ast.unparse(node)!r} exceeds {MAX_MAGNITUDE} in magnitude")
        return value

    return Evaluated(walk(tree.body), tuple(literals))


@dataclass(frozen=True)
class Countdown(Task):
    """Reach a target with +, -, *, / using each of 2..max_numbers given numbers exactly once.

    ``make 22 from 3,5,7:`` -> ``3*5=15,15+7=22>(3*5)+7.``: the steps, then one expression that the reward
    evaluates. Intermediate results stay positive integers up to MAX_INTERMEDIATE, in the drawn problems and in
    the solutions alike, so every drawn problem has a solution of that kind.
    """

    name: str = "countdown"
    max_numbers: int = 4
    max_number: int = 20
    prefix: ClassVar[str] = "make "
    prompt_pattern: ClassVar[re.Pattern] = re.compile(r"make (\d+) from (\d+(?:,\d+)*):")
    completion_pattern: ClassVar[re.Pattern] = re.compile(r"(\d+[-+*/]\d+=\d+(,\d+[-+*/]\d+=\d+)*)?>[-+*/()\d]+\.")
    MAX_INTERMEDIATE: ClassVar[int] = 999

    @property
    def reward_names(self) -> dict[str, float]:
        return {"countdown": 1.0}

    @property
    def max_new_tokens(self) -> int:
        """max_numbers - 1 steps of at most "999*999=999," and one expression of max_numbers literals."""
        steps = (self.max_numbers - 1) * len(
            f"{self.MAX_INTERMEDIATE}*{self.MAX_INTERMEDIATE}={self.MAX_INTERMEDIATE},"
        )
        parenthesised = self.max_numbers * len(str(self.max_number)) + (self.max_numbers - 1) * 3
        return steps + len(ANSWER_MARKER) + parenthesised + len(END_MARKER) + 1 + LENGTH_MARGIN

    def draw(self, rng: random.Random) -> str:
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(rng.randint(2, self.max_numbers))]
            target = _random_combination(numbers, rng)
            if target is not None:
                return f"make {target} from {','.join(map(str, numbers))}:"

    def _problem(self, prompt: str) -> tuple[int, tuple[int, ...]]:
        target, numbers = self._match(self.prompt_pattern, prompt).groups()
        return int(target), tuple(int(n) for n in numbers.split(","))

    def solution(self, prompt: str) -> str:
        target, numbers = self._problem(prompt)
        found = _search(target, tuple((n, str(n)) for n in numbers))
        if found is None:
            raise ValueError(f"prompt {prompt!r} has no solution with positive integer steps")
        steps, expression = found
        return ",".join(steps) + f"{ANSWER_MARKER}{expression}{END_MARKER}"

    def is_correct(self, prompt: str, answer: str) -> bool:
        target, numbers = self._problem(prompt)
        try:
            evaluated = evaluate_expression(answer)
        except (ExpressionError, ZeroDivisionError):
            return False
        return evaluated.value == target and sorted(evaluated.literals) == sorted(numbers)


def _steps(a: int, b: int) -> list[tuple[str, int]]:
    """The operations on a and b (in that order) whose result is a positive integer up to MAX_INTERMEDIATE."""
    candidates = [("+", a + b), ("-", a - b), ("*", a * b), ("/", a // b if a % b == 0 else 0)]
    return [(op, result) for op, result in candidates if 0 < result <= Countdown.MAX_INTERMEDIATE]


def _random_combination(numbers: list[int], rng: random.Random) -> int | None:
    """Combine random pairs of numbers by random allowed operations down to one value; None if stuck."""
    values = list(numbers)
    while len(values) > 1:
        a, b = values.pop(rng.randrange(len(values))), values.pop(rng.randrange(len(values)))
        results = [result for _, result in _steps(a, b)]
        if not results:
            return None
        values.append(rng.choice(results))
    return values[0]


@lru_cache(maxsize=65536)
def _search(target: int, items: tuple[tuple[int, str], ...]) -> tuple[tuple[str, ...], str] | None:
    """Depth-first search for steps combining all (value, expression) items into target, in a fixed order."""
    if len(items) == 1:
        return ((), items[0][1]) if items[0][0] == target else None
    for i, (a, a_text) in enumerate(items):
        for j, (b, b_text) in enumerate(items):
            if i == j:
                continue
            rest = tuple(item for k, item in enumerate(items) if k not in (i, j))
            for op, result in _steps(a, b):
                expression = f"{_operand(a_text)}{op}{_operand(b_text)}"
                found = _search(target, (*rest, (result, expression)))
                if found is not None:
                    return (f"{a}{op}{b}={result}", *found[0]), found[1]
    return None


def _operand(expression: str) -> str:
    """An expression as an operand: bracketed unless it is a single number."""
    return expression if expression.isdigit() else f"({expression})"


TASKS: dict[str, Task] = {task.name: task for task in (Addition(), Sort(), Countdown(), Copy(), Calc(), LookupTask())}


def task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    return TASKS[name]


def task_of_prompt(prompt: str) -> Task:
    """The task a prompt belongs to, from its first word."""
    for candidate in TASKS.values():
        if prompt.startswith(candidate.prefix):
            return candidate
    raise ValueError(f"prompt {prompt!r} starts with no task's prefix {[t.prefix for t in TASKS.values()]}")
