"""Memory as a first-class figure: every device's bytes by kind in metrics.jsonl (Ray and reference runs), counted
from the tensors and checked here against the model's own parameter count; and `cluster.device_memory_gb`, the
per-device budget a run's replicated trainer and rollout engine must fit before it starts."""

import json
import re

import pytest
from running import train
from test_runtime_lm import SMALL
from typer.testing import CliRunner

from dovetail.cli import app
from dovetail.config.load import load_config
from dovetail.models.causal_lm import causal_lm_parameter_counts, load_causal_lm
from dovetail.models.diffusers_flow import load_flow_model
from dovetail.models.memory import parameter_counts
from dovetail.pipelines.lm.model import load_policy
from dovetail.runtime.launch import dry_run

FLOW_FAST = ["algo.prompts_per_step=2", "algo.group_size=2", "sampling.num_steps=4", "eval.per_prompt=2"]
KINDS = ("parameters", "gradients", "optimizer", "rollout", "peak")


def lines_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def lm_model_counts() -> tuple[int, int]:
    """The built-in LM's parameters and parameter tensors, from the model itself."""
    model, _ = load_policy(load_config(None, SMALL))
    parameters = list(model.parameters())
    return sum(p.numel() for p in parameters), len(parameters)


def check_lm_device(memory: dict, params: int, tensors: int, *, committed: bool) -> None:
    """A device holding the built-in LM's fp32 trainer: 4 bytes a parameter; a device that took the optimizer step,
    AdamW's two fp32 moments (8 bytes a parameter) and one fp32 step count per parameter tensor, and at its commit the
    fp32 gradient plus at least the fp64 sum it was rounded from (12 bytes a parameter); every kind at once in the
    process's peak."""
    assert set(memory) == set(KINDS)
    assert memory["parameters"] == 4 * params
    assert memory["rollout"] > 0  # the rollout engine's own weights and KV cache
    if committed:
        assert memory["optimizer"] == 8 * params + 4 * tensors
        assert memory["gradients"] >= 12 * params
    held = memory["parameters"] + memory["gradients"] + memory["optimizer"] + memory["rollout"]
    assert memory["peak"] >= held


@pytest.mark.usefixtures("local_ray")
def test_a_ray_run_reports_each_device_s_bytes_by_kind(tmp_path):
    params, tensors = lm_model_counts()
    train(load_config(None, [*SMALL, "policy=verl-sync"]), tmp_path, steps=2)
    for line in lines_of(tmp_path):
        devices = line["memory_bytes_per_device"]
        assert len(devices) == 2 and all(d is not None for d in devices)
        committed = [d for d in devices if d["optimizer"] > 0]
        assert committed, "a trainer device answered its commit with its optimizer state"
        for memory in devices:
            check_lm_device(memory, params, tensors, committed=memory in committed)
        assert line["memory_peak_bytes"] == max(d["peak"] for d in devices)


def test_the_reference_run_reports_its_one_device_s_bytes_by_kind(tmp_path):
    params, tensors = lm_model_counts()
    train(load_config(None, [*SMALL, "policy=reference"]), tmp_path, steps=2)
    for line in lines_of(tmp_path):
        [memory] = line["memory_bytes_per_device"]
        check_lm_device(memory, params, tensors, committed=True)
        assert line["memory_peak_bytes"] == memory["peak"]


def test_the_flow_reference_run_reports_its_bytes_by_kind(tmp_path):
    """The flow reference loop generates with its trainer (no rollout copy)."""
    config = load_config(None, ["policy=reference", *FLOW_FAST])
    train(config, tmp_path, steps=1)
    [line] = lines_of(tmp_path)
    [memory] = line["memory_bytes_per_device"]
    trained = [p for p in load_flow_model(config).parameters() if p.requires_grad]
    params, trained_params = parameter_counts(load_flow_model(config))
    assert memory["parameters"] == 4 * params and memory["rollout"] == 0
    assert memory["gradients"] == 4 * trained_params
    assert memory["optimizer"] == 8 * trained_params + 4 * len(trained)


def replicated_gb(params: int) -> float:
    """The built-in LM's replicated trainer (24 bytes a parameter, all trained: fp32 weights, gradient and moments,
    and the fp64 sum of the step's parts) and rollout weights (4), in GB."""
    return 28 * params / 1e9


def test_a_budget_below_the_replicated_state_is_refused_naming_the_field_and_above_it_runs(tmp_path):
    params, _ = lm_model_counts()
    below = f"cluster.device_memory_gb={replicated_gb(params) * 0.99:.6g}"
    result = CliRunner().invoke(app, ["train", *SMALL, "policy=reference", below, "--out", str(tmp_path / "no")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert re.search(r"raise cluster\.device_memory_gb to 0\.0\d+ or more, or train a LoRA", result.output)
    assert f"{params:,} parameters" in result.output
    with pytest.raises(ValueError, match="cluster.device_memory_gb"):  # the dry run's check too
        dry_run(load_config(None, [*SMALL, "policy=verl-sync", below]), 3)
    above = f"cluster.device_memory_gb={replicated_gb(params) * 1.01:.6g}"
    result = CliRunner().invoke(
        app, ["train", *SMALL, "policy=reference", above, "--steps", "1", "--out", str(tmp_path / "yes")]
    )
    assert result.exit_code == 0, result.output
    assert len(lines_of(tmp_path / "yes")) == 1


def sharded_gb(params: int, devices: int) -> float:
    """A trainer sharded over `devices`: its rollout weights (4 bytes a parameter) and the larger of the whole
    model's fp32 weights, which it holds while it starts, and its share of 16 bytes a parameter."""
    return (4 * params + max(4 * params, 16 * params / devices)) / 1e9


def test_a_model_refused_replicated_trains_sharded_within_the_budget(tmp_path):
    """The budget that refuses a replicated trainer (naming `train.sharding: fsdp`, which fits) trains the run
    sharded over two devices; below what a shard needs, the refusal names more devices."""
    params, _ = lm_model_counts()
    budget = f"cluster.device_memory_gb={sharded_gb(params, 2) * 1.01:.6g}"
    result = CliRunner().invoke(app, ["train", *SMALL, "policy=verl-sync", budget, "--out", str(tmp_path / "no")])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"set train.sharding: fsdp (each of the 2 trainer devices then holds {sharded_gb(params, 2):.3g} GB)" in (
        result.output
    )
    sharded = ["policy=verl-sync", budget, "train.sharding=fsdp", "--steps", "1", "--out", str(tmp_path / "yes")]
    result = CliRunner().invoke(app, ["train", *SMALL, *sharded])
    assert result.exit_code == 0, result.output
    [line] = lines_of(tmp_path / "yes")
    for device in line["memory_bytes_per_device"]:  # the shard the check counts, counted from the tensors
        trainer = device["parameters"] + device["gradients"] + device["optimizer"]
        assert trainer == pytest.approx(16 * params / 2, rel=1e-3)  # AdamW's step counts and an uneven cut
    tight = f"cluster.device_memory_gb={sharded_gb(params, 2) * 0.99:.6g}"
    result = CliRunner().invoke(app, ["train", *SMALL, "policy=verl-sync", tight, "train.sharding=fsdp"])
    assert result.exit_code == 2 and "shard over more devices (cluster.devices)" in result.output, result.output


def test_a_user_model_is_counted_from_its_config_as_loading_it_counts(tmp_path):
    """What the budget check counts without reading weights (a meta-device build, LoRA adapter included) is what the
    loaded model holds."""
    from test_user_lm import save_tiny_model

    save_tiny_model(tmp_path / "qwen", "qwen2")
    for lora in (None, {"rank": 4, "alpha": None, "target_modules": "all-linear"}):
        loaded = parameter_counts(load_causal_lm(tmp_path / "qwen", lora=lora, seed=0))
        assert causal_lm_parameter_counts(tmp_path / "qwen", lora=lora, seed=0) == loaded
