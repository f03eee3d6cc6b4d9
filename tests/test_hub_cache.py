"""Hub ids and datasets, with no network: `model.path: org/name` (an LM's, a flow run's) and `prompts.path: org/name`
resolve to their snapshot in the local Hugging Face cache (HF_HUB_CACHE), as TRL and verl take them; an id the cache
lacks is one line naming it and how to fetch it. `prompts.split` picks a split of a dataset of several. The cache
here is built by hand in the hub's own layout (`models--org--name/snapshots/<commit>`, `refs/main`) around models
saved with save_pretrained, and a short LM run trains through it."""

import json
import shutil
from pathlib import Path

import datasets
import pytest
from running import train
from test_user_lm import save_tiny_model, sums
from tiny_pipelines import PROMPTS
from typer.testing import CliRunner

from dovetail.cli import app
from dovetail.config.common import ConfigError
from dovetail.config.load import load_config
from dovetail.models.causal_lm import HFTokenizer
from dovetail.prompts import PromptSplit, prompt_split, read_rows

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_repo(cache: Path, repo_id: str, repo_type: str = "model") -> Path:
    """An empty snapshot of `repo_id` at COMMIT, `refs/main` naming it, as `hf download` leaves one in `cache`."""
    storage = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(COMMIT)
    snapshot = storage / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


def jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """A hub cache holding a tiny Llama (tiny-org/tiny-llama) and a dataset of sums (tiny-org/sums: data/train.jsonl,
    data/test.jsonl), where HF_HUB_CACHE points; HF_HOME elsewhere, so only HF_HUB_CACHE can find them."""
    cache = tmp_path / "hub"
    save_tiny_model(hub_repo(cache, "tiny-org/tiny-llama"), "llama")
    data = hub_repo(cache, "tiny-org/sums", "dataset")
    jsonl(data / "data" / "train.jsonl", sums(0, 8))
    jsonl(data / "data" / "test.jsonl", sums(8, 2))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    return cache


def lm_overrides(*extra: str) -> list[str]:
    return [
        "kind=lm",
        "model.path=tiny-org/tiny-llama",
        "prompts.path=tiny-org/sums",
        "prompts.split=train",
        "prompts.eval_path=tiny-org/sums",
        "prompts.eval_split=test",
        "reward={answer_match: 1.0}",
        "sampling.max_new_tokens=4",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "eval.prompts=2",
        "eval.every=100",
        "checkpoint.every=100",
        "runtime.profile_samples=4",
        *extra,
    ]


def test_an_lm_run_trains_a_hub_id_on_a_hub_dataset_split_from_the_local_cache(hub_cache, tmp_path):
    config = load_config(None, lm_overrides("policy=reference"))
    snapshot = hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert config.model.path == snapshot and config.pipeline_name == "tiny-llama"
    assert config.prompts.path == hub_cache / "datasets--tiny-org--sums" / "snapshots" / COMMIT
    train(config, tmp_path / "run", steps=2)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("reward" in k for line in lines for k in line) and any("eval" in k for line in lines for k in line)
    # the config the run recorded names the snapshot: a resumed run, or a Ray worker, finds the same files
    assert str(snapshot) in (tmp_path / "run" / "config.yaml").read_text()


def test_a_hub_id_the_cache_lacks_is_one_line_naming_it_and_how_to_fetch_it(hub_cache):
    for setting, value, fetch in (
        ("model.path", "nobody/nothing", "hf download nobody/nothing"),
        ("prompts.path", "nobody/no-data", "hf download --repo-type dataset nobody/no-data"),
    ):
        result = CliRunner().invoke(app, ["train", *lm_overrides(f"{setting}={value}"), "--dry-run"])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
        line = result.output
        assert f"{setting}: no" in line and f"{value}, nor a hub" in line and fetch in line and str(hub_cache) in line
    # a path that cannot be a hub id is still a missing directory, said as before
    with pytest.raises(ConfigError, match="/no/such/model is not a directory; give a transformers model"):
        load_config(None, lm_overrides("model.path=/no/such/model"))


def test_a_flow_run_takes_a_diffusers_pipeline_and_its_prompts_by_their_hub_ids(sd3_pipeline_dir, hub_cache):
    shutil.copytree(sd3_pipeline_dir, hub_repo(hub_cache, "tiny-org/tiny-sd3"), dirs_exist_ok=True)
    captions = hub_repo(hub_cache, "tiny-org/captions", "dataset")
    jsonl(captions / "train.jsonl", [{"caption": p} for p in PROMPTS])
    jsonl(captions / "test.jsonl", [{"caption": p} for p in PROMPTS[:2]])
    overrides = ["model.path=tiny-org/tiny-sd3", "prompts.path=tiny-org/captions", "prompts.field=caption"]
    overrides += ["prompts.split=train", "prompts.eval_path=tiny-org/captions", "prompts.eval_split=test"]
    config = load_config(None, [*overrides, "reward={brightness: 1.0}"])
    assert config.model.path == hub_cache / "models--tiny-org--tiny-sd3" / "snapshots" / COMMIT
    assert config.pipeline_name == "tiny-sd3"
    assert prompt_split(config) == PromptSplit(tuple(PROMPTS), tuple(PROMPTS[:2]))
    with pytest.raises(ConfigError, match="hf download nobody/no-pipeline"):
        load_config(None, ["model.path=nobody/no-pipeline", "reward={brightness: 1.0}"])


def test_a_split_of_a_dataset_of_splits_and_the_lines_a_wrong_split_or_column_gets(tmp_path):
    records = sums(0, 3)
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(records), "test": datasets.Dataset.from_list(sums(5, 1))}
    )
    splits.save_to_disk(tmp_path / "saved")
    jsonl(tmp_path / "files" / "train.jsonl", records)
    jsonl(tmp_path / "files" / "validation.jsonl", sums(5, 1))
    for directory in (tmp_path / "saved", tmp_path / "files"):
        rows = read_rows(directory, "prompt", "prompts.prompt_field", split="train")
        assert [r.prompt for r in rows] == [r["prompt"] for r in records]
        assert rows[0].columns == {"answer": records[0]["answer"], "source": "sums"}
    jsonl(tmp_path / "one.jsonl", records)
    for path, split, says in (
        (tmp_path / "saved", None, "holds the splits ['train', 'test']: set prompts.split"),
        (tmp_path / "saved", "dev", "has no split 'dev' (its splits: ['train', 'test'])"),
        (tmp_path / "files", "test", "has no split 'test' (its splits: ['train', 'validation'])"),
        (tmp_path / "one.jsonl", "train", "is one table, not a dataset of splits"),
    ):
        with pytest.raises(ValueError) as refused:
            read_rows(path, "prompt", "prompts.prompt_field", split=split)
        assert says in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ValueError) as refused:
        read_rows(tmp_path / "saved", "question", "prompts.prompt_field", split="train")
    message = str(refused.value)
    assert "no column 'question'" in message and "set prompts.prompt_field" in message and "\n" not in message


def test_a_chat_prompt_is_rendered_by_the_tokenizers_template_and_a_text_prompt_is_tokenized_as_it_is(hub_cache):
    """TRL's two formats: conversational prompts through the chat template with the generation prompt, standard
    (text) ones as they are, the template not applied."""
    config = load_config(None, lm_overrides())
    tokenizer = HFTokenizer.load(config.model.path)
    chat = [{"role": "user", "content": "1+2="}]
    templated = tokenizer.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert templated == "<|user|>1+2=<|assistant|>"
    assert tokenizer.prompt_ids(chat) == tokenizer.tokenizer(templated, add_special_tokens=False)["input_ids"]
    assert tokenizer.prompt_ids("1+2=") == tokenizer.tokenizer("1+2=")["input_ids"]
    assert tokenizer.decode(tokenizer.prompt_ids("1+2=")) == "1+2="
