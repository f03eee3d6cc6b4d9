"""The prompts of a language-model run, and what its rewards read of them: a built-in task's problems, or the rows of
a user's dataset (`prompts.path`: a prompt and the columns every reward receives by name).

The prompt of RL step s at position p is a pure function of (seed, s, p) — a task's `prompt("train", seed, s·B + p)`,
or the dataset's row at place s·B + p of a stream that visits the train split in a fresh seeded order every epoch —
so the reference loop, every device worker and a resumed run find the same prompt from a sample's id alone, and a
score node looks up the rows its samples came from without the driver sending them. Every train row is seen once
before any is seen twice (TRL and verl iterate epochs over a shuffled dataset too).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from dovetail.pipelines.lm.config import LMTrainConfig
from dovetail.prompts import hash_share, read_records
from dovetail.rewards.text import TextContext
from dovetail.tasks import task


@dataclass(frozen=True)
class Row:
    """One prompt as the dataset holds it (text, or chat messages) and its row's other columns."""

    prompt: str | list
    columns: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Dataset:
    train: tuple[Row, ...]
    eval: tuple[Row, ...]


class RunPrompts:
    """A run's train prompts by (step, position), its eval prompts, and the reward context of a batch of them."""

    def __init__(self, config: LMTrainConfig):
        self.config = config
        self.dataset = None if config.prompts is None else dataset_of(config)

    def train(self, step: int, position: int) -> Row:
        """The prompt at `position` of RL step `step` (B = algo.prompts_per_step a step; step -1: the start-up
        profile's, never trained)."""
        place = step * self.config.algo.prompts_per_step + position
        if self.dataset is None:
            return Row(task(self.config.task).prompt("train", self.config.seed, place))
        rows = self.dataset.train
        epoch, index = divmod(place, len(rows))
        return rows[epoch_order(self.config.seed, epoch, len(rows))[index]]

    def step(self, step: int) -> list[Row]:
        return [self.train(step, p) for p in range(self.config.algo.prompts_per_step)]

    def eval(self) -> list[Row]:
        """The held-out prompts an evaluation answers, one response each: the task's eval split, or the first
        eval.prompts rows of the dataset's."""
        if self.dataset is None:
            return [
                Row(p)
                for p in task(self.config.task).prompts("eval", self.config.eval.seed, 0, self.config.eval.prompts)
            ]
        return list(self.dataset.eval[: self.config.eval.prompts])

    def all(self) -> list[Row]:
        """Every distinct prompt the run can meet: a dataset's rows (None for a task's endless problems)."""
        return [] if self.dataset is None else [*self.dataset.train, *self.dataset.eval]

    def context(self, rows: list[Row], completion_ids: list[list[int]]) -> TextContext:
        """What the rewards of responses to `rows` (`completion_ids` their tokens) see besides completions and
        prompts."""
        if self.dataset is None:
            return TextContext(completion_ids=completion_ids, max_new_tokens=self.config.max_new_tokens)
        names = list(dict.fromkeys(name for row in rows for name in row.columns))
        return TextContext(
            dataset=True,
            columns={name: [row.columns.get(name) for row in rows] for name in names},
            completion_ids=completion_ids,
            max_new_tokens=self.config.max_new_tokens,
            format_pattern=self.config.format_pattern,
        )


@lru_cache(maxsize=8)
def epoch_order(seed: int, epoch: int, size: int) -> list[int]:
    """The dataset's train rows in epoch `epoch`'s order: a permutation seeded by (seed, epoch) alone."""
    order = list(range(size))
    random.Random(f"dovetail/prompts/{seed}/{epoch}").shuffle(order)  # a str seed: the same in every process
    return order


def dataset_of(config: LMTrainConfig) -> Dataset:
    """The run's dataset split into train and eval rows; a file that cannot give them is a ValueError, one line
    naming it and the fix."""
    section = config.prompts
    assert section is not None
    stamps = tuple(_stamp(p) for p in (section.path, section.eval_path))
    return _dataset(section.path, section.prompt_field, section.eval_fraction, section.eval_path, stamps)


def _stamp(path: Path | None) -> tuple[int, int] | None:
    """What tells a file's versions apart for the cache: its size and modification time."""
    if path is None or not path.exists():
        return None
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@lru_cache(maxsize=4)
def _dataset(path: Path, field: str, eval_fraction: float | None, eval_path: Path | None, stamps: tuple) -> Dataset:
    rows = read_rows(path, field)
    if eval_path is not None:
        return Dataset(tuple(rows), tuple(read_rows(eval_path, field)))
    held_out = [hash_share(prompt_text(row.prompt)) < eval_fraction for row in rows]
    train = tuple(row for row, held in zip(rows, held_out) if not held)
    evaluated = tuple(row for row, held in zip(rows, held_out) if held)
    if not train or not evaluated:
        side = "train" if not train else "eval"
        raise ValueError(
            f"prompts.path {path}: its {len(rows)} rows split by eval_fraction={eval_fraction} leave no {side} row; "
            "change prompts.eval_fraction or give prompts.eval_path"
        )
    return Dataset(train, evaluated)


def prompt_text(prompt: str | list) -> str:
    """The text a prompt's side of the split hashes: itself, or its messages as canonical JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def read_rows(path: Path, field: str) -> list[Row]:
    """A dataset file's rows: `field` the prompt (non-empty text, or a list of {"role", "content"} messages), the
    other fields its columns; a row without a prompt is one line naming the file, the row and the setting."""
    rows = []
    for n, record in enumerate(read_records(path, field, "prompts.prompt_field"), 1):
        if isinstance(record, str):
            record = {field: record}
        prompt = record.get(field) if isinstance(record, dict) else None
        if isinstance(prompt, str) and not prompt.strip():  # skipped, as a blank line is
            continue
        if not (isinstance(prompt, str) or _messages(prompt)):
            raise ValueError(
                f"{path} row {n} has no prompt in {field!r} (text, or a list of chat messages with role and content); "
                "set prompts.prompt_field to the prompt's column"
            )
        rows.append(Row(prompt, {k: v for k, v in record.items() if k != field}))
    if not rows:
        raise ValueError(f"prompts.path {path} holds no prompt")
    return rows


def _messages(value) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    )
