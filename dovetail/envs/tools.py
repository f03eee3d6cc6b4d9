"""The built-in tools, none of which needs a network: `Calculator` (exact arithmetic on integers of any length),
`PythonExecutor` (a model's code in the sandbox of `envs.sandbox`) and `Lookup` (an entry of a local JSON or JSONL
file by its key). Each answers every call with text (an error too: "error: ...") within bounded time and memory, and
has its own `latency` (`contract.Latency`), the wait a run reproduces."""

import ast
import difflib
import json
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dovetail.envs.contract import NO_LATENCY, Latency, Tool
from dovetail.envs.sandbox import run_python
from dovetail.files import read_text

MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_DIGITS = 1000
"""The calculator's bounds: its input, and every integer it computes (10^1000; a power is refused before it is
computed where its result would be larger), so that no call takes more than microseconds or kilobytes."""
MAX_RESULT_BITS = math.ceil(MAX_RESULT_DIGITS * math.log2(10))

OPERATORS: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
SIGNS: dict[type, Callable] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """An expression the calculator does not compute; the message says why."""


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression as Python computes it: integer and decimal literals, + - * / // % **,
    signs and parentheses, walked on its syntax tree (never eval). Integers are exact whatever their length up to
    MAX_RESULT_DIGITS; anything else is a CalculatorError naming what is wrong."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression has {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"{expression.strip()!r} is not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in SIGNS:
        return SIGNS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0:
            if abs(left) > 1 and right * (abs(left).bit_length() - 1) > MAX_RESULT_BITS:
                raise CalculatorError(f"{ast.unparse(node)} has more than {MAX_RESULT_DIGITS} digits")
        try:
            value = OPERATORS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError(f"{ast.unparse(node)} divides by zero") from None
        except OverflowError:
            raise CalculatorError(f"{ast.unparse(node)} is too large for a decimal number") from None
        if isinstance(value, complex):
            raise CalculatorError(f"{ast.unparse(node)} has no real value")
        if isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS:
            raise CalculatorError(f"{ast.unparse(node)} has more than {MAX_RESULT_DIGITS} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError(f"{ast.unparse(node)} is too large for a decimal number")
        return value
    raise CalculatorError(f"{ast.unparse(node)!r} is not allowed: numbers, + - * / // % ** and parentheses only")


@dataclass(frozen=True)
class Calculator(Tool):
    """`calculate` as a tool: a model's long multiplication done exactly."""

    name: str = "calc"
    latency: Latency = NO_LATENCY

    description = "Compute an arithmetic expression exactly: integers of any length, + - * / // % ** and parentheses."
    argument = "expression"
    argument_description = "the expression, e.g. 123456789 * 987654321"

    def run(self, argument: str) -> str:
        try:
            return str(calculate(argument))
        except CalculatorError as error:
            return f"error: {error}"


@dataclass(frozen=True)
class PythonExecutor(Tool):
    """A model's Python code run in the sandbox (`envs.sandbox`): what it prints, or what stopped it. Each call is a
    fresh interpreter in a fresh scratch directory: nothing carries over from one call to the next."""

    name: str = "python"
    latency: Latency = NO_LATENCY
    cpu_s: float = 2.0
    wall_s: float = 5.0
    memory_mb: int = 256
    output_bytes: int = 4096
    file_bytes: int = 2**20

    description = (
        "Run Python code (the standard library only; no network, no files outside its working directory) and "
        "return what it prints, and the value of its last line."
    )
    argument = "code"
    argument_description = "the program"

    def run(self, argument: str) -> str:
        return run_python(
            argument,
            cpu_s=self.cpu_s,
            wall_s=self.wall_s,
            memory_mb=self.memory_mb,
            output_bytes=self.output_bytes,
            file_bytes=self.file_bytes,
        )


@dataclass(frozen=True)
class Lookup(Tool):
    """An entry of a local file by its key: a JSON object (key -> entry) or JSON lines, each row an object whose
    `key_field` keys it (its entry: the row's `value_field`, or the whole row as JSON where that is None). Read once,
    when the tool is made; a file that cannot serve is a ValueError naming it and the line. Or, instead of a file,
    `table`: entries already in memory (the built-in `lookup` environment's, made from a seed), shared, not copied,
    by the tools made with it. An entry is cut at `max_chars`; a key not found is answered with the closest keys."""

    path: Path | None = None
    name: str = "lookup"
    latency: Latency = NO_LATENCY
    key_field: str = "key"
    value_field: str | None = None
    max_chars: int = 2000
    table: Mapping[str, str] | None = field(default=None, repr=False, compare=False)
    entries: Mapping[str, str] = field(init=False, repr=False, compare=False)

    description = "Look up an entry by its key."
    argument = "key"
    argument_description = "the entry's key"

    def __post_init__(self) -> None:
        if self.table is not None and self.path is None:
            object.__setattr__(self, "entries", self.table)
        elif self.path is not None and self.table is None:
            object.__setattr__(self, "entries", self._read(self.path))
        else:
            raise ValueError("a lookup reads its entries from a file (path) or is given them (table): give one")

    def run(self, argument: str) -> str:
        key = argument.strip()
        if key in self.entries:
            entry = self.entries[key]
            return entry if len(entry) <= self.max_chars else entry[: self.max_chars] + " [cut]"
        close = difflib.get_close_matches(key, self.entries, n=3)
        return f"error: no entry {key!r}" + (f"; close keys: {', '.join(map(repr, close))}" if close else "")

    def _read(self, path: Path) -> dict[str, str]:
        text = read_text(Path(path), "a JSON or JSONL file")
        if Path(path).suffix == ".jsonl":
            return self._rows(text)
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON ({error.msg}, line {error.lineno}); give an object") from None
        if not isinstance(mapping, dict):
            raise ValueError(f"{path}: a JSON lookup file is an object of key -> entry; use .jsonl for rows")
        return {str(key): _entry_text(value) for key, value in mapping.items()}

    def _rows(self, text: str) -> dict[str, str]:
        entries: dict[str, str] = {}
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{self.path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not JSON ({error.msg})") from None
            if not isinstance(row, dict) or self.key_field not in row:
                raise ValueError(f"{where}: each row is an object with a {self.key_field!r} field (key_field)")
            if self.value_field is not None and self.value_field not in row:
                raise ValueError(f"{where}: the row has no {self.value_field!r} field (value_field)")
            key = str(row[self.key_field]).strip()
            if key in entries:
                raise ValueError(f"{where}: key {key!r} again; each key keys one row")
            entries[key] = _entry_text(row if self.value_field is None else row[self.value_field])
        return entries


def _entry_text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
