"""The prompts of a language-model run, and what its rewards read of them: a built-in task's problems, or the rows of
a user's dataset (`prompts.path`: a prompt and the columns every reward receives by name).

The prompt of RL step s at position p is a pure function of (seed, s, p) — a task's `prompt("train", seed, s·B + p)`,
or the dataset's row at place s·B + p of a stream that visits the train split in a fresh seeded order every epoch —
so the reference loop, every device worker and a resumed run find the same prompt from a sample's id alone, and a
score node looks up the rows its samples came from without the driver sending them. Every train row is seen once
before any is seen twice (TRL and verl iterate epochs over a shuffled dataset too).

The dataset's file is read and split by `dovetail.prompts` (`split_rows`), the one reader of every kind; what is a
language model's own is here: a prompt may be chat messages, and every row keeps its columns for the rewards.
"""

from __future__ import annotations

import random
from functools import lru_cache

from dovetail.pipelines.lm.config import LMTrainConfig
from dovetail.prompts import Row, Rows, split_rows
from dovetail.rewards.text import TextContext
from dovetail.tasks import task


class RunPrompts:
    """A run's train prompts by (step, position), its eval prompts, and the reward context of a batch of them."""

    def __init__(self, config: LMTrainConfig):
        self.config = config
        self.dataset = None if config.prompts is None else dataset_of(config)

    def train(self, step: int, position: int) -> Row:
        """The prompt at `position` of RL step `step` (B = algo.prompts_per_step a step; step -1: the start-up
        profile's, never trained). With `algo.dynamic_sampling` a step owns the places of its D =
        dynamic_sampling_max_draws draws, positions 0 to D x B - 1, whether it draws them all or not: every step's
        prompts stay a function of (seed, step, position), no step repeats another's, and a dataset's rows at the
        places of draws a step did not need are skipped in that epoch."""
        algo = self.config.algo
        per_step = algo.prompts_per_step * (algo.dynamic_sampling_max_draws if algo.dynamic_sampling else 1)
        place = step * per_step + position
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

    def episode_row(self, row: Row) -> dict:
        """A row as an env run's environment resets from it: its columns, and its prompt under the dataset's prompt
        field; a task's problem, its prompt under "prompt" and the task's row of it (`Task.episode_row`: its
        question and answer)."""
        if self.config.prompts is None:
            return {"prompt": row.prompt, **task(self.config.task).episode_row(str(row.prompt))}
        return {**row.columns, self.config.prompts.prompt_field: row.prompt}

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


def dataset_of(config: LMTrainConfig) -> Rows:
    """The run's dataset split into train and eval rows (`dovetail.prompts.split_rows`; a prompt may be chat
    messages); a file that cannot give them is a ValueError, one line naming it and the fix."""
    section = config.prompts
    assert section is not None
    return split_rows(
        section.path,
        section.prompt_field,
        section.eval_fraction,
        section.eval_path,
        "prompts.prompt_field",
        chat=True,
        splits=(section.split, section.eval_split),
    )
