"""A run's prompts: a flow run's built-in "digit N" ones, or the user's from a file or dataset, split train / eval;
the one reader of such a file for every kind (`read_rows`: each record's prompt and its other fields, which a
language-model run's rewards read, `pipelines.lm.prompts`).

A step's prompts are drawn from the train split by (seed, step) alone (`models.flow_rl.step_prompts`), so a resumed
run draws what the uninterrupted one would have, given the same file. The split is by a hash of each prompt's text,
like the LM tasks' (`tasks.split_of`): the same prompt is always on the same side, whatever the file's order, and
a prompt repeated in the file never leaks into both.
"""

import hashlib
import json
import logging
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TypeGuard

DIGIT_PROMPTS = tuple(f"digit {d}" for d in range(10))
"""The built-in model's prompts: they train, and each is evaluated `eval.per_prompt` times."""

TABLE_FORMATS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
"""File suffix -> the `datasets` builder that reads it."""

SAVED_TO_DISK = ("dataset_dict.json", "state.json")
"""What marks a directory `datasets`' `save_to_disk` wrote (a DatasetDict's, a Dataset's)."""

CHAT = "text or a list of chat messages with role and content"
"""What a prompt may be where chat messages are prompts too (`read_rows`' `chat`: a language model's)."""


@dataclass(frozen=True)
class Row:
    """One prompt as its file holds it (text; where `chat`, also a list of chat messages) and its record's other
    fields (the columns a language-model run's rewards receive by name)."""

    prompt: str | list
    columns: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Rows:
    """A prompts file's rows split into train and eval."""

    train: tuple[Row, ...]
    eval: tuple[Row, ...]


@dataclass(frozen=True)
class PromptSplit:
    train: tuple[str, ...]
    eval: tuple[str, ...]


def prompt_split(config) -> PromptSplit:
    """A flow run's train and eval prompts (a prompt repeated in the eval split evaluated once); a file that cannot
    give them is a ValueError, one line naming it."""
    section = config.prompts
    if section is None:
        return PromptSplit(DIGIT_PROMPTS, DIGIT_PROMPTS)
    rows = split_rows(
        section.path,
        section.field,
        section.eval_fraction,
        section.eval_path,
        "prompts.field",
        splits=(section.split, section.eval_split),
    )
    return PromptSplit(
        tuple(prompt_text(row.prompt) for row in rows.train),
        tuple(dict.fromkeys(prompt_text(row.prompt) for row in rows.eval)),
    )


def train_prompts(config) -> tuple[str, ...]:
    return prompt_split(config).train


def eval_prompts(config) -> list[str]:
    """The prompts of an evaluation, each `eval.per_prompt` times: every digit, or the first prompts.eval_prompts of
    the eval split."""
    split = prompt_split(config)
    chosen = split.eval if config.prompts is None else split.eval[: config.prompts.eval_prompts]
    return [p for p in chosen for _ in range(config.eval.per_prompt)]


def split_rows(
    path: Path,
    field: str,
    eval_fraction: float | None,
    eval_path: Path | None,
    setting: str,
    chat: bool = False,
    splits: tuple[str | None, str | None] = (None, None),
) -> Rows:
    """The rows of `path` (`read_rows`) split into train and eval: by a hash of each prompt (`eval_fraction` of them
    held out), or every row trains and the eval rows are `eval_path`'s. Read once while the files stay as they are.
    `setting` names the prompt's field in the config, for the line a file without it gets; `splits` are the
    dataset splits of `path` and `eval_path` (`prompts.split`, `prompts.eval_split`: None, a dataset's only one)."""
    stamps = tuple(_stamp(p) for p in (path, eval_path))
    return _split(path, field, eval_fraction, eval_path, setting, chat, splits, stamps)


def _stamp(path: Path | None) -> tuple[int, int] | None:
    """What tells a file's (or a dataset directory's) versions apart for the cache: its size and modification time."""
    if path is None or not path.exists():
        return None
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@lru_cache(maxsize=16)
def _split(
    path: Path,
    field: str,
    eval_fraction: float | None,
    eval_path: Path | None,
    setting: str,
    chat: bool,
    splits: tuple[str | None, str | None],
    stamps: tuple,
) -> Rows:
    """The split of the files as they are (`stamps`: their sizes and times, so that an edited file is read again)."""
    rows = read_rows(path, field, setting, chat, splits[0])
    if eval_path is not None:
        return Rows(tuple(rows), tuple(read_rows(eval_path, field, setting, chat, splits[1])))
    assert eval_fraction is not None  # the prompts sections set it (0.1) where eval_path is not given
    held_out = [hash_share(prompt_text(row.prompt)) < eval_fraction for row in rows]
    train = tuple(row for row, held in zip(rows, held_out) if not held)
    evaluated = tuple(row for row, held in zip(rows, held_out) if held)
    if not train or not evaluated:
        side = "train" if not train else "eval"
        raise ValueError(
            f"prompts.path {path}: its {len(rows)} prompts split by eval_fraction={eval_fraction} leave no "
            f"{side} prompt; change prompts.eval_fraction or give prompts.eval_path"
        )
    return Rows(train, evaluated)


def hash_share(prompt: str) -> float:
    """A prompt's place in [0, 1), from a hash of its text (stable across processes, unlike hash())."""
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") / 2**64


def prompt_text(prompt: str | list) -> str:
    """The text a prompt's side of the split hashes: itself, or its chat messages as canonical JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def read_rows(
    path: Path, field: str, setting: str = "prompts.field", chat: bool = False, split: str | None = None
) -> list[Row]:
    """A prompts file's rows, in its order (`read_records`): `field` the prompt, the record's other fields its
    columns. A prompt is non-empty text (a blank one is skipped, as a blank line is) or, where `chat`, a list of
    {"role", "content"} messages; a record without one is one line naming the file, the record and `setting`."""
    rows = []
    for n, record in enumerate(read_records(path, field, setting, split), 1):
        if isinstance(record, str):
            record = {field: record}
        prompt = record.get(field) if isinstance(record, dict) else None
        if isinstance(prompt, str) and not prompt.strip():
            continue
        if not (isinstance(prompt, str) or (chat and _messages(prompt))):
            raise ValueError(
                f"{path} record {n} has no {CHAT if chat else 'text'} in {field!r}; set {setting} to the prompt's field"
            )
        rows.append(Row(prompt, {k: v for k, v in record.items() if k != field}))
    if not rows:
        raise ValueError(f"prompts file {path} holds no prompt")
    return rows


def _messages(value: object) -> TypeGuard[list]:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    )


def read_records(path: Path, field: str, setting: str = "prompts.field", split: str | None = None) -> list:
    """The records of a prompts file, in its order, every field kept: strings (a .txt's lines, a JSON list's
    strings) or mappings (JSON lines, a JSON list's objects, a table's rows: .parquet, .csv, .arrow, or a directory:
    `datasets` `save_to_disk`'s, or data files named by split as a hub dataset's snapshot holds them). `field` is
    the prompt's, which a table must have as a column (else one line naming the config's `setting`); `split` picks
    one of a directory's splits (None: its only one)."""
    suffix = path.suffix.lower()
    if split is not None and not path.is_dir():
        raise ValueError(f"{path} is one table, not a dataset of splits: leave its split ({split!r}) unset")
    try:
        if path.is_dir():
            return _table(path, field, setting, split)
        if suffix == ".txt":  # a line's ends are the file's layout, invisible in it, not the prompt's
            return [line.strip() for line in path.read_text().splitlines()]
        if suffix == ".jsonl":
            return [_json(line, path, n) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
        if suffix == ".json":
            records = _json(path.read_text(), path, None)
            if not isinstance(records, list):
                raise ValueError(f"{path}: a JSON prompts file is a list (of strings, or of records with {field!r})")
            return records
        if suffix in TABLE_FORMATS:
            return _table(path, field, setting)
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"unreadable prompts file {path}: {' '.join(str(error).split())}") from None
    raise ValueError(
        f"prompts file {path}: unknown format {suffix or '(no suffix)'}; use .txt, .jsonl, .json, "
        f"{', '.join(TABLE_FORMATS)}"
    )


def _json(text: str, path: Path, line: int | None):
    try:
        return json.loads(text)
    except ValueError as error:
        where = f"{path} line {line}" if line is not None else str(path)
        raise ValueError(f"{where} is not JSON: {error}") from None


def _table(path: Path, field: str, setting: str, split: str | None = None) -> list:
    """The rows of a table file, or of a dataset directory (`save_to_disk`'s, or data files `load_dataset` names
    splits after: train-*.parquet, data/test.jsonl...), as mappings of every column; `split` one of the directory's."""
    import datasets

    datasets.disable_progress_bars()
    # A damaged file's reader logs its error (pyarrow's, through datasets' logger) before raising it: the error
    # reaches the user once, in our one line, so the logger is silenced for the read.
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        if path.is_dir() and any((path / name).is_file() for name in SAVED_TO_DISK):
            table = datasets.load_from_disk(str(path))
        elif path.is_dir():
            table = datasets.load_dataset(str(path))
        else:
            table = datasets.load_dataset(TABLE_FORMATS[path.suffix.lower()], data_files=str(path), split="train")
    except Exception as error:  # a damaged file raises whatever its reader does
        raise ValueError(f"unreadable prompts file {path}: {' '.join(str(error).split())[:300]}") from None
    finally:
        logger.setLevel(level)
    if isinstance(table, datasets.DatasetDict):
        if split is None and len(table) != 1:
            raise ValueError(f"{path} holds the splits {list(table)}: set prompts.split (prompts.eval_split) to one")
        if split is not None and split not in table:
            raise ValueError(f"{path} has no split {split!r} (its splits: {list(table)}): set prompts.split to one")
        table = table[split or next(iter(table))]
    elif split is not None:
        raise ValueError(f"{path} is one table, not a dataset of splits: leave its split ({split!r}) unset")
    if field not in table.column_names:
        raise ValueError(f"{path} has no column {field!r} (columns: {table.column_names}); set {setting}")
    return table.to_list()
