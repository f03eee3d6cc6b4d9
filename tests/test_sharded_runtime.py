"""Sharded language-model trainers on the Ray runtime (`train.sharding: fsdp`): two devices form one FSDP group,
each holding half the trainer's parameters, gradients and AdamW moments (counted from the tensors, in the step's
metrics), running each trainer node together in lockstep.

An fp32 sharded run is not the reference's bits (FSDP adds the members' gradients in fp32 in the backward, where the
replicated trainer adds each group's in fp64 and rounds once), so it is held to a bound set by what rounding can do
through Adam: each step moves a weight by about lr, so a rounding difference in a near-zero gradient can move it
by a fraction of lr. bf16 compute tracks fp32 within bf16's precision on the first step (the same rollouts: the
initial weights are the same). Activation checkpointing recomputes the same forward: the same bits. A worker killed
in the middle of a step takes the step with it (each member holds a piece of every gradient): the run goes on from
its last committed step and ends at the undisturbed run's bits."""

import json

import pytest
import torch
from fault_injection import Fault
from running import train
from safetensors.torch import load_file

from dovetail.config.load import load_config

SMALL = [
    "kind=lm",
    "task=sort",
    "algo.prompts_per_step=4",
    "algo.group_size=4",
    "eval.prompts=8",
    "eval.every=100",
    "runtime.profile_samples=4",
    "train.lr=1e-3",
]
SHARDED = [*SMALL, "policy=verl-sync", "train.sharding=fsdp"]
STEPS = 3
LR = 1e-3
FP32_BOUND = 0.1 * LR
"""The largest weight difference from the reference after the run: a tenth of one step's move (measured: 2.8e-5)."""
BF16_RELATIVE = 2e-2
pytestmark = pytest.mark.usefixtures("local_ray")


def final_weights(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"))


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    train(load_config(None, [*SMALL, "policy=reference"]), out, steps=STEPS)
    return out


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    train(load_config(None, SHARDED), out, steps=STEPS)
    return out


@pytest.mark.exactness
def test_an_fp32_sharded_run_ends_where_the_reference_does(reference, sharded):
    expected, got = final_weights(reference), final_weights(sharded)
    start = load_file(str(load_config(None, SMALL).model.checkpoint / "model.safetensors"))
    assert largest_difference(expected, start) > 10 * FP32_BOUND, "training moved the weights"
    assert largest_difference(expected, got) < FP32_BOUND
    ours, theirs = metrics(sharded), metrics(reference)
    assert ours[0]["reward/total"] == theirs[0]["reward/total"]  # the same initial weights: the same rollouts
    for mine, its in zip(ours, theirs):
        assert mine["grad_norm"] == pytest.approx(its["grad_norm"], rel=1e-4, abs=1e-6)


def test_each_device_of_a_sharded_trainer_holds_half_of_it(reference, sharded):
    (replica,) = metrics(reference)[-1]["memory_bytes_per_device"][:1]  # the reference loop's one trainer
    members = metrics(sharded)[-1]["memory_bytes_per_device"]
    assert len(members) == 2
    for kind in ("parameters", "optimizer"):
        halves = [member[kind] for member in members]
        assert sum(halves) == pytest.approx(replica[kind], rel=1e-3), kind  # the optimizer's step counts repeat
        assert max(halves) < 0.51 * replica[kind], kind
    # the replica keeps the step's fp64 parts and their sum beside the trainer's own gradient; a member its shard
    assert all(member["gradients"] == member["parameters"] for member in members)


def test_bf16_and_activation_checkpointing_track_fp32(sharded, tmp_path):
    """bf16 compute with fp32 master weights: the first step (same rollouts) within bf16's precision of fp32's, and
    training goes on; checkpointed activations change nothing but memory (one run tries both: bf16's own bits)."""
    config = load_config(None, [*SHARDED, "train.precision=bf16", "train.activation_checkpointing=true"])
    train(config, tmp_path, steps=STEPS)
    fp32, bf16 = metrics(sharded), metrics(tmp_path)
    assert bf16[0]["reward/total"] == fp32[0]["reward/total"]
    for key in ("grad_norm", "loss"):
        assert bf16[0][key] == pytest.approx(fp32[0][key], rel=BF16_RELATIVE, abs=1e-4), key
    assert largest_difference(final_weights(sharded), final_weights(tmp_path)) < 0.1, "bf16 followed fp32"


def test_activation_checkpointing_recomputes_the_same_bits(sharded, tmp_path):
    train(load_config(None, [*SHARDED, "train.activation_checkpointing=true"]), tmp_path, steps=STEPS)
    got, expected = final_weights(tmp_path), final_weights(sharded)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_a_killed_member_takes_the_step_and_the_run_ends_at_the_undisturbed_bits(sharded, tmp_path):
    fault = Fault("train", steps=STEPS)
    train(load_config(None, SHARDED), tmp_path, steps=STEPS, **fault.hooks())
    assert fault.killed
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["restarts"] and ledger["went_on"], "the step went again from the last commit"
    got, expected = final_weights(tmp_path), final_weights(sharded)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
