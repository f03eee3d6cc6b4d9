"""The built-in `lookup` environment: a question about a key whose answer is only in the environment's table, and the
`Lookup` tool to read it with. Over local data (a JSON or JSONL file), or over the built-in table of the `lookup`
task (every three-letter key to six digits hashed from it: `tasks.lookup_value`), which no model can compute: the
reward needs the tool."""

import itertools
import random
import string
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from dovetail.envs.contract import NO_LATENCY, Environment, Latency, StepResult, Turn
from dovetail.envs.toolcalls import tools_then_answer
from dovetail.envs.tools import Lookup
from dovetail.graph.node import sample_key
from dovetail.tasks import KEY_LETTERS, lookup_value


class KeyLookup(Environment):
    """Each episode asks its row's `question` about its row's `key`; the answer is the table's entry of that key,
    which the row does not hold (an `answer` column is not read). A turn that calls the lookup is answered with the
    entries it asked for (a key not in the table with the closest ones); the first turn without a call is the final
    answer: reward 1 where its answer (a \\boxed{} or <answer> one, or for a numeric entry its last number) is the
    key's entry, else 0, and done. An episode still calling at turn `max_turns` ends with reward 0.

    Options (`env.options`): `table`, a JSON or JSONL file (read as the `Lookup` tool reads it: `key_field`,
    `value_field`; a relative path from the run's working directory), or none for the built-in table of
    `table_seed`; `max_turns`; `tool_latency`, the lookup's (a `Latency` section)."""

    def __init__(
        self,
        table: str | None = None,
        key_field: str = "key",
        value_field: str | None = None,
        table_seed: int = 0,
        max_turns: int = 4,
        tool_latency: Latency | dict | None = None,
    ):
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r}: give a whole number of turns, at least 1")
        self.max_turns = max_turns
        latency = NO_LATENCY if tool_latency is None else Latency.model_validate(tool_latency)
        if table is None:
            lookup = Lookup(table=builtin_table(table_seed), latency=latency)
        else:
            lookup = Lookup(Path(table), latency=latency, key_field=key_field, value_field=value_field)
        self.tools = (lookup,)
        self.entries = lookup.entries
        self.answer = ""

    def reset(self, row: dict) -> str:
        missing = [column for column in ("question", "key") if column not in row]
        if missing:
            raise ValueError(f"a lookup row has a question and a key column; this one has no {missing[0]}")
        key = str(row["key"]).strip()
        if key not in self.entries:
            raise ValueError(f"the row's key {key!r} is not in the lookup table: its answer would be unknown")
        self.answer = self.entries[key]
        return str(row["question"])

    def step(self, turn: Turn) -> StepResult:
        return tools_then_answer(turn, self.tools, self.max_turns, self.answer)


@cache
def builtin_table(table_seed: int) -> Mapping[str, str]:
    """The built-in table of `table_seed`: every `KEY_LETTERS`-letter key to its `lookup_value`. Made once per process
    and shared by its episodes (a run makes an environment per trajectory)."""
    keys = ("".join(letters) for letters in itertools.product(string.ascii_lowercase, repeat=KEY_LETTERS))
    return {key: lookup_value(key, table_seed) for key in keys}


def lookup_rows(count: int, seed: int) -> list[dict[str, str]]:
    """`count` rows of questions about the built-in table's keys, row i's key drawn from (seed, i) alone: the dataset
    of a lookup run. A row names its key and holds no answer: that stays in the environment's table."""
    rows = []
    for i in range(count):
        draw = random.Random(sample_key(seed, "lookup", i))
        key = "".join(draw.choices(string.ascii_lowercase, k=KEY_LETTERS))
        rows.append({"question": f"What is the value of key {key}?", "key": key})
    return rows
