"""A run's prompts: a flow run's built-in "digit N" ones, or the user's from a file or dataset, split train / eval;
and the records of such a file with all their fields (a language-model run's dataset: `pipelines.lm.prompts`).

A step's prompts are drawn from the train split by (seed, step) alone (`models.flow_rl.step_prompts`), so a resumed
run draws what the uninterrupted one would have, given the same file. The split is by a hash of each prompt's text,
like the LM tasks' (`tasks.split_of`): the same prompt is always on the same side, whatever the file's order, and
a prompt repeated in the file never leaks into both.
"""

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DIGIT_PROMPTS = tuple(f"digit {d}" for d in range(10))
"""The built-in model's prompts: they train, and each is evaluated `eval.per_prompt` times."""

TABLE_FORMATS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
"""File suffix -> the `datasets` builder that reads it."""


@dataclass(frozen=True)
class PromptSplit:
    train: tuple[str, ...]
    eval: tuple[str, ...]


def prompt_split(config) -> PromptSplit:
    """The run's train and eval prompts; a file that cannot give them is a ValueError, one line naming it."""
    section = config.prompts
    if section is None:
        return PromptSplit(DIGIT_PROMPTS, DIGIT_PROMPTS)
    stamps = tuple(_stamp(p) for p in (section.path, section.eval_path))
    return _split(section.path, section.field, section.eval_fraction, section.eval_path, stamps)


def train_prompts(config) -> tuple[str, ...]:
    return prompt_split(config).train


def eval_prompts(config) -> list[str]:
    """The prompts of an evaluation, each `eval.per_prompt` times: every digit, or the first prompts.eval_prompts of
    the eval split."""
    split = prompt_split(config)
    chosen = split.eval if config.prompts is None else split.eval[: config.prompts.eval_prompts]
    return [p for p in chosen for _ in range(config.eval.per_prompt)]


def _stamp(path: Path | None) -> tuple[int, int] | None:
    """What tells a file's versions apart for the cache: its size and modification time."""
    if path is None or not path.is_file():
        return None
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@lru_cache(maxsize=16)
def _split(path: Path, field: str, eval_fraction: float | None, eval_path: Path | None, stamps: tuple) -> PromptSplit:
    """The split of the files as they are (`stamps`: their sizes and times, so that an edited file is read again)."""
    prompts = read_prompts(path, field)
    if eval_path is not None:
        return PromptSplit(tuple(prompts), tuple(read_prompts(eval_path, field)))
    assert eval_fraction is not None  # PromptsSection sets it (0.1) where eval_path is not given
    held_out = [hash_share(p) < eval_fraction for p in prompts]
    train = tuple(p for p, held in zip(prompts, held_out) if not held)
    evaluated = tuple(dict.fromkeys(p for p, held in zip(prompts, held_out) if held))
    if not train or not evaluated:
        side = "train" if not train else "eval"
        raise ValueError(
            f"prompts.path {path}: its {len(prompts)} prompts split by eval_fraction={eval_fraction} leave no "
            f"{side} prompt; change prompts.eval_fraction or give prompts.eval_path"
        )
    return PromptSplit(train, evaluated)


def hash_share(prompt: str) -> float:
    """A prompt's place in [0, 1), from a hash of its text (stable across processes, unlike hash())."""
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") / 2**64


def read_prompts(path: Path, field: str) -> list[str]:
    """The non-empty prompts of a file, in its order: a line each (.txt), `field` of each JSON line (.jsonl), of
    each element of a JSON list (.json; or the list's strings), or of each row of a table (.parquet, .csv, .arrow,
    read by `datasets`)."""
    prompts = [_prompt(record, field, path, n) for n, record in enumerate(read_records(path, field), 1)]
    prompts = [p.strip() for p in prompts if p.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompt")
    return prompts


def read_records(path: Path, field: str, setting: str = "prompts.field") -> list:
    """The records of a prompts file, in its order, every field kept: strings (a .txt's lines, a JSON list's
    strings) or mappings (JSON lines, a JSON list's objects, a table's rows: .parquet, .csv, .arrow, or a directory
    `datasets.Dataset.save_to_disk` wrote). `field` is the prompt's, which a table must have as a column (else
    one line naming the config's `setting`)."""
    suffix = path.suffix.lower()
    try:
        if path.is_dir():
            return _table(path, field, setting)
        if suffix == ".txt":
            return path.read_text().splitlines()
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


def _prompt(record, field: str, path: Path, n: int) -> str:
    if isinstance(record, str):
        return record
    value = record.get(field) if isinstance(record, dict) else None
    if not isinstance(value, str):
        raise ValueError(f"{path} record {n} has no text field {field!r}; set prompts.field to the prompt's field")
    return value


def _table(path: Path, field: str, setting: str) -> list:
    """The rows of a table file, or of a dataset directory `save_to_disk` wrote, as mappings of every column."""
    import datasets

    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            table = datasets.load_from_disk(str(path))
        else:
            table = datasets.load_dataset(TABLE_FORMATS[path.suffix.lower()], data_files=str(path), split="train")
    except Exception as error:  # a damaged file raises whatever its reader does
        raise ValueError(f"unreadable prompts file {path}: {' '.join(str(error).split())[:300]}") from None
    if isinstance(table, datasets.DatasetDict):
        raise ValueError(f"{path} holds the splits {list(table)}: give the directory of one split")
    if field not in table.column_names:
        raise ValueError(f"{path} has no column {field!r} (columns: {table.column_names}); set {setting}")
    return table.to_list()
