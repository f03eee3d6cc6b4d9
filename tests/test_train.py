"""The reference training path: it improves the shipped model, writes its run directory, resumes
bitwise, and the command line rejects bad input before any work."""

import json
import subprocess
import sys

import pytest
import torch
from running import train
from safetensors.torch import load_file

from dovetail.config.load import load_config

FAST = ["algo.prompts_per_step=6", "algo.group_size=6", "sampling.num_steps=8", "eval.per_prompt=6"]


LEARNABLE = ["reward={brightness: 1.0}", "train.lr=3e-4", "algo.prompts_per_step=4", "algo.group_size=8"]
LEARNABLE += ["eval.per_prompt=2", "eval.every=100", "checkpoint.every=100"]
"""A reward the built-in model learns within 10 steps (0.33 -> 0.9 here): the fast "it learns" runs. The 30-step
curves on digit_match are in benchmarks/learning_curves.py."""


def test_flow_grpo_raises_the_eval_reward(tmp_path):
    summary = train(load_config(None, LEARNABLE), tmp_path, steps=10)
    assert summary["final_eval_reward"] >= summary["base_eval_reward"] + 0.3, summary


def test_run_directory_holds_what_the_user_needs(tmp_path):
    config = load_config(None, FAST + ["eval.every=2", "checkpoint.every=2"])
    summary = train(config, tmp_path, steps=3)
    assert {"base_eval_reward", "final_eval_reward", "steps", "samples_per_s"} <= set(summary)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for key in ("reward/total", "clip_frac", "approx_kl", "samples_per_s", "generate_s", "train_s", "ratio_mean"):
        assert key in lines[0]
    assert lines[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # one update per rollout: on-policy
    assert "eval_reward" in lines[1] and "eval_reward" in lines[2] and "eval_reward" not in lines[0]
    recorded = load_config(tmp_path / "config.yaml")  # the config as run: --steps 3 is train.steps 3
    assert recorded == config.model_copy(update={"train": config.train.model_copy(update={"steps": 3})})
    for name in ("eval_base.png", "eval_latest.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    for step in (2, 3):
        checkpoint = tmp_path / "checkpoints" / f"step_{step:06d}"
        assert {"model.safetensors", "optimizer.pt", "rng.pt", "state.json"} <= {p.name for p in checkpoint.iterdir()}


@pytest.mark.slow
def test_resume_is_bitwise_identical_to_the_uninterrupted_run(tmp_path):
    config = load_config(None, FAST + ["algo.beta=0.01", "eval.every=100", "checkpoint.every=1"])
    train(config, tmp_path / "straight", steps=3)
    train(config, tmp_path / "first", steps=2)
    train(config, tmp_path / "resumed", steps=3, resume=tmp_path / "first")
    straight = load_file(tmp_path / "straight/checkpoints/step_000003/model.safetensors")
    resumed = load_file(tmp_path / "resumed/checkpoints/step_000003/model.safetensors")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    before = load_file(tmp_path / "first/checkpoints/step_000002/model.safetensors")
    assert not all(torch.equal(before[k], resumed[k]) for k in before)  # the resumed step did train


def test_resume_from_a_missing_checkpoint_says_how_to_find_one(tmp_path):
    config = load_config(None, FAST)
    with pytest.raises(FileNotFoundError, match="RUN_DIR/checkpoints/step_NNNNNN"):
        train(config, tmp_path / "run", steps=1, resume=tmp_path / "nowhere")


def test_cli_rejects_a_bad_value_before_any_work(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dovetail.cli", "train", "train.lr=-1", "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "train.lr" in result.stderr and "greater than 0" in result.stderr
    assert not (tmp_path / "run").exists()
