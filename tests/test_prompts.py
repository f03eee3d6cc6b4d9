"""One reader of prompts files for every kind (`dovetail.prompts.read_rows`, `split_rows`): a flow run's prompts and
a language-model run's dataset rows come from the same records and the same hash split, each kind keeping what is
its own (a flow run's text prompts, an eval prompt once; an LM's chat messages and every row's columns)."""

import json
import logging
import os

import datasets
import pytest

from dovetail.config.load import load_config
from dovetail.prompts import hash_share, prompt_split, read_records, read_rows, split_rows

PROMPTS = [f"a {colour} {animal}" for colour in ("red", "green", "blue", "black") for animal in ("cat", "dog", "owl")]


def flow_split(path, *extra):
    return prompt_split(load_config(None, [f"prompts.path={path}", *extra]))


def test_both_kinds_split_a_file_alike_by_each_prompt_s_hash(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS)))
    flow = flow_split(path, "prompts.eval_fraction=0.3")
    rows = split_rows(path, "prompt", 0.3, None, "prompts.prompt_field", chat=True)
    held_out = [p for p in PROMPTS if hash_share(p) < 0.3]  # the split, computed from its definition
    assert list(flow.eval) == [row.prompt for row in rows.eval] == held_out
    assert list(flow.train) == [row.prompt for row in rows.train] == [p for p in PROMPTS if p not in held_out]
    assert [row.columns for row in rows.train] == [{"id": PROMPTS.index(p)} for p in flow.train]  # an LM's columns


def test_a_text_line_is_its_prompt_without_its_ends_and_a_record_s_text_is_as_written(tmp_path):
    (tmp_path / "p.txt").write_text("  a red cat \t\n\n a dog\n")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": " a red cat\n"}) + "\n" + json.dumps({"prompt": " "}))
    for chat in (False, True):
        assert [row.prompt for row in read_rows(tmp_path / "p.txt", "prompt", chat=chat)] == ["a red cat", "a dog"]
        assert [row.prompt for row in read_rows(tmp_path / "p.jsonl", "prompt", chat=chat)] == [" a red cat\n"]


def test_chat_messages_are_a_language_model_s_prompt_and_no_flow_run_s(tmp_path):
    messages = [{"role": "user", "content": "a red cat"}]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": messages, "answer": "4"}) + "\n")
    (row,) = read_rows(path, "prompt", "prompts.prompt_field", chat=True)
    assert (row.prompt, row.columns) == (messages, {"answer": "4"})
    with pytest.raises(ValueError, match=f"^{path} record 1 has no text in 'prompt'; set prompts.field to the"):
        read_rows(path, "prompt")
    path.write_text(json.dumps({"prompt": [{"role": "user"}]}) + "\n")
    with pytest.raises(ValueError, match="record 1 has no text or a list of chat messages with role and content in"):
        read_rows(path, "prompt", "prompts.prompt_field", chat=True)


def test_a_prompt_repeated_in_the_eval_split_is_one_flow_eval_prompt_and_every_lm_row(tmp_path):
    held = next(p for p in PROMPTS if hash_share(p) < 0.3)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate([*PROMPTS, held])))
    assert flow_split(path, "prompts.eval_fraction=0.3").eval.count(held) == 1
    rows = split_rows(path, "prompt", 0.3, None, "prompts.prompt_field", chat=True).eval
    assert [row.columns["id"] for row in rows if row.prompt == held] == [PROMPTS.index(held), len(PROMPTS)]


def test_a_dataset_directory_written_again_is_read_again(tmp_path):
    path = tmp_path / "dataset"
    datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS]).save_to_disk(str(path))
    before = split_rows(path, "prompt", 0.3, None, "prompts.prompt_field", chat=True)
    datasets.Dataset.from_list([{"prompt": p} for p in [*PROMPTS, "a white owl"]]).save_to_disk(str(path) + ".new")
    os.rename(path, tmp_path / "old")
    os.rename(str(path) + ".new", path)
    after = split_rows(path, "prompt", 0.3, None, "prompts.prompt_field", chat=True)
    assert len(after.train) + len(after.eval) == len(before.train) + len(before.eval) + 1


@pytest.mark.parametrize("suffix", [".parquet", ".arrow", ".csv"])
def test_a_garbage_table_file_is_our_one_line_alone_and_datasets_logger_is_left_as_it_was(suffix, tmp_path):
    """pyarrow's reader logs its error through datasets' logger before raising it: the user sees it once, ours."""
    logger = logging.getLogger("datasets")
    before = logger.level
    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    path = tmp_path / f"prompts{suffix}"
    path.write_bytes(b"\x00\xffgarbage, not a table\n\x00" * 3)
    try:
        with pytest.raises(ValueError, match=rf"^unreadable prompts file {path}: [^\n]+$"):
            read_records(path, "prompt")
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in logged] == []
    assert logger.level == before
