"""Sharded language-model trainers on the Ray runtime (`train.sharding: fsdp`): two devices form one FSDP group,
each holding half the trainer's parameters, gradients and AdamW moments (counted from the tensors, in the step's
metrics), running each trainer node together in lockstep.

An fp32 sharded run is not the reference's bits (FSDP adds the members' gradients in fp32 in the backward, where the
replicated trainer adds each group's in fp64 and rounds once), so it is held to a bound set by what rounding can do
through Adam: each step moves a weight by about lr, so a rounding difference in a near-zero gradient can move it
by a fraction of lr. bf16 compute tracks fp32 within bf16's precision on the first step (the same rollouts: the
initial weights are the same). A worker killed in the middle of a step takes the step with it (each member holds a
piece of every gradient): the run goes on from its last committed step and ends at the undisturbed run's bits, with
activation checkpointing on (it recomputes the same forward). A checkpoint written by two members resumes on two
and on one, and exports as a replicated run's does."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from fault_injection import Fault
from running import train
from safetensors.torch import load_file
from test_runtime_lm import SMALL as RUNTIME_LM
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from dovetail.cli import app
from dovetail.config.common import ConfigError
from dovetail.config.load import load_config
from dovetail.cost.catalog import GB
from dovetail.cost.model import BF16, FP32, CostModel
from dovetail.graph.lm import engines
from dovetail.graph.node import Role
from dovetail.pipelines.lm.model import load_policy
from dovetail.sched import policy_class

LR = 3e-4
SMALL = [*RUNTIME_LM, f"train.lr={LR}"]
"""test_runtime_lm's small sort run at a smaller lr (at its 1e-3 the reward collapses by the third step)."""
CONFIGS = Path(__file__).parent.parent / "configs"
SHARDED = [*SMALL, "policy=verl-sync", "train.sharding=fsdp", "checkpoint.every=2"]
STEPS = 3
FP32_BOUND = 0.1 * LR
"""The largest weight difference from the reference after the run: a tenth of one step's move (measured: 2.8e-5 at
lr 1e-3)."""
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


@pytest.mark.slow
def test_bf16_tracks_fp32(sharded, tmp_path):
    """bf16 compute with fp32 master weights: the first step (same rollouts) within bf16's precision of fp32's, and
    the run ends near it."""
    train(load_config(None, [*SHARDED, "train.precision=bf16"]), tmp_path, steps=STEPS)
    fp32, bf16 = metrics(sharded), metrics(tmp_path)
    assert bf16[0]["reward/total"] == fp32[0]["reward/total"]
    for key in ("grad_norm", "loss"):
        assert bf16[0][key] == pytest.approx(fp32[0][key], rel=BF16_RELATIVE, abs=1e-4), key
    assert largest_difference(final_weights(sharded), final_weights(tmp_path)) < 10 * LR


@pytest.mark.slow
def test_a_killed_member_takes_the_step_and_the_run_ends_at_the_undisturbed_bits(sharded, tmp_path):
    """With activation checkpointing on, which recomputes each block's forward in the backward: the same bits."""
    fault = Fault("train", steps=STEPS)
    config = load_config(None, [*SHARDED, "train.activation_checkpointing=true"])
    train(config, tmp_path, steps=STEPS, **fault.hooks())
    assert fault.killed
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["restarts"] and ledger["went_on"], "the step went again from the last commit"
    assert ledger["problems"] == []
    got, expected = final_weights(tmp_path), final_weights(sharded)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 1])
def test_a_checkpoint_of_two_shards_resumes_on_two_devices_and_on_one(sharded, devices, tmp_path):
    """The checkpoint holds the whole state (the members' shards joined), which any group cuts again: on two devices
    the same bits, on one (a group of one, whose gradient adds in another order) within the fp32 bound."""
    checkpoint = sharded / "checkpoints" / "step_000002"
    config = load_config(None, [*SHARDED, f"cluster.devices={devices}"])
    train(config, tmp_path, steps=STEPS, resume=checkpoint)
    got, expected = final_weights(tmp_path), final_weights(sharded)
    assert largest_difference(expected, got) <= (0.0 if devices == 2 else FP32_BOUND)
    assert largest_difference(expected, load_file(str(checkpoint / "model.safetensors"))) > 0, "step 3 trained"


def test_a_sharded_run_exports_a_transformers_model(sharded, tmp_path):
    result = CliRunner().invoke(app, ["export", str(sharded), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in final_weights(sharded).items())


def test_what_a_sharded_trainer_does_not_run_is_refused_in_one_line_naming_the_field(tmp_path, sd3_pipeline_dir):
    refusals = [
        (["train.precision=bf16"], "precision=bf16: applied by the sharded trainer; set train.sharding: fsdp"),
        (["train.activation_checkpointing=true"], "activation_checkpointing=True: applied by the sharded trainer"),
        (
            ["train.sharding=fsdp", "train.cpu_offload=true"],
            "train.cpu_offload=true: cluster.device=cpu-core is the host's memory already",
        ),
        (
            [f"model.path={sd3_pipeline_dir}", "model.lora.rank=4", "train.sharding=fsdp"],
            "train.sharding=fsdp: a LoRA adapter trains replicated",
        ),
    ]
    for overrides, said in refusals:
        with pytest.raises(ConfigError) as refused:
            load_config(None, overrides)
        assert said in str(refused.value) and "\n" not in str(refused.value)
    multiplex = yaml.safe_load((CONFIGS / "multiplex.yaml").read_text())
    multiplex["pipelines"][1].setdefault("train", {})["sharding"] = "fsdp"
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(multiplex))
    with pytest.raises(ConfigError, match=r"pipelines\.1\.train\.sharding=fsdp: a multiplexed pipeline trains"):
        load_config(tmp_path / "run.yaml", [])


def test_the_planner_prices_the_trainer_each_device_holds(reference, sharded, tmp_path):
    """The planner's resident trainer memory for the run's shape (`graph.lm.engines`), per parameter of its model,
    against the bytes each device held at the commit, per parameter of the model trained: a replica's 24 (fp32 weights,
    gradient, the fp64 sum of the parts, AdamW's moments), a shard's 16 / 2."""
    replicated = tmp_path / "replicated"
    train(load_config(None, [*SMALL, "policy=verl-sync"]), replicated, steps=1)
    params = sum(p.numel() for p in load_policy(load_config(None, SMALL))[0].parameters())
    for out, overrides in ((replicated, []), (sharded, ["train.sharding=fsdp"])):
        config = load_config(None, [*SMALL, "policy=verl-sync", *overrides])
        spec = config.scenario(STEPS).pipelines[0]
        cost = CostModel(config.cluster.device)
        planned = engines(spec, cost, policy_class("verl-sync").shape(spec, 2, None, cost))
        per_parameter = planned.resident_gb[Role.TRAINER] * 1e9 / spec.catalogue_model().params
        held = [m["parameters"] + m["gradients"] + m["optimizer"] for m in metrics(out)[0]["memory_bytes_per_device"]]
        assert max(held) / params == pytest.approx(per_parameter, rel=1e-3), overrides  # AdamW's step counts


def shard_sizes(model: torch.nn.Module, devices: int) -> list[int]:
    """Parameters each member of an FSDP group of `devices` holds: FSDP2 cuts every parameter along dim 0 as
    `torch.chunk` does (ceil(rows / N) rows a member, the last the rest), so an odd row count leaves the first member a
    row more."""
    held = [0] * devices
    for parameter in model.parameters():
        row = parameter.numel() // parameter.shape[0]
        for member, rows in enumerate(torch.chunk(torch.empty(parameter.shape[0]), devices)):
            held[member] += rows.numel() * row
    return held


def test_the_memory_model_is_what_each_member_of_a_sharded_trainer_holds(sharded, tmp_path):
    """The planner's FSDP trainer memory (`CostModel.training_memory`, what `graph.lm.engines` prices a
    `replicated_trainer: false` spec's resident trainer with) for the run's own shape (`config.scenario`, 2 trainer
    devices) against the bytes each member held at its commit (metrics.jsonl: gradients before the optimizer step,
    parameters and AdamW's state after it), in fp32 (`sharded`, 3 steps) and in bf16 (1 step; FSDP2's
    `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, as verl runs FSDP on GPUs).

    What each side counts, per trained parameter, on N devices:
    - the runtime, in either precision: the sharded parameter is the fp32 master (4/N; bf16 only gathers a bf16 copy
      of one block to compute, freed after it and not held at the commit), its gradient lands on it in fp32 (4/N: the
      reduce-scatter's dtype), AdamW's two moments are fp32 (8/N): 16/N;
    - the model: bf16 weights (2/N) and gradients (2/N), an fp32 master copy and two moments (12/N): 16/N.
    The split by kind differs (the runtime's fp32 parameter is the master itself, and no bf16 gradient is kept), the
    total does not. Beyond 16/N a member holds exactly what the model leaves out: AdamW's step count, one fp32
    scalar per parameter tensor on every member (not sharded), and the uneven cut of a tensor with an odd row count
    (the 53-row embedding: 27 rows on the first member, 26 on the second, 16 bytes a parameter each way).

    The planner prices the built-in model as the catalogue's `tiny-lm`, whose parameter count is the model's: the
    plan's resident trainer is the model's figure for the trained model (10.55 MB a device)."""
    bf16 = tmp_path / "bf16"
    train(load_config(None, [*SHARDED, "train.precision=bf16"]), bf16, steps=1)
    for out, precision, steps in ((sharded, "fp32", STEPS), (bf16, "bf16", 1)):
        config = load_config(None, [*SHARDED, f"train.precision={precision}"])
        spec = config.scenario(steps).pipelines[0]
        cost = CostModel(config.cluster.device)
        shape = policy_class("verl-sync").shape(spec, 2, None, cost)
        assert shape.trainer_devices == 2 and not spec.replicated_trainer
        catalogue = spec.catalogue_model()
        planned = engines(spec, cost, shape).resident_gb[Role.TRAINER] * GB
        assert planned == pytest.approx(
            cost.training_memory(catalogue.params, catalogue.layers, catalogue.hidden, 0, devices=2).total, rel=1e-12
        ), "the plan's resident trainer is the FSDP model's, at the catalogue's parameter count"

        model = load_policy(config)[0]
        params, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
        assert catalogue.params == params and planned == pytest.approx(8 * params, rel=1e-12)
        modelled = cost.training_memory(params, catalogue.layers, catalogue.hidden, 0, devices=2)
        assert (modelled.weights, modelled.grads, modelled.optimizer) == (
            BF16 * params / 2,
            BF16 * params / 2,
            3 * FP32 * params / 2,
        )
        sizes = shard_sizes(model, 2)
        assert sum(sizes) == params and sizes[0] - sizes[1] == 128  # one embedding row of 128 more on the first
        lines = metrics(out)
        assert len(lines) == steps
        for line in lines:
            for member, held in zip(sizes, line["memory_bytes_per_device"], strict=True):
                assert held["parameters"] == FP32 * member, precision  # the fp32 master shard
                assert held["gradients"] == FP32 * member, precision  # reduced in fp32 onto it
                assert held["optimizer"] == 2 * FP32 * member + FP32 * tensors, precision  # moments, step counts
                total = held["parameters"] + held["gradients"] + held["optimizer"]
                assert total == modelled.total + 16 * (member - params / 2) + FP32 * tensors, precision


@pytest.mark.slow
def test_a_replica_group_no_train_node_reached_commits_as_a_shard():
    """HYBRID: two FSDP groups of one device each, replicas of the trainer. The policy gave the first step's trainer
    work to device 0's group alone, so device 1 reaches the commit never sharded: the commit carries its group, it
    joins it there and adds its zeros across the replicas as device 0 adds its shards (before, it took the
    replicated all-reduce and both waited out the rendezvous). Both commit, to the same trainer."""
    import ray

    from dovetail.config.multiplex import pipeline_configs
    from dovetail.graph.node import SampleId
    from dovetail.models.flow_rl import recompute_passes
    from dovetail.models.training import trainer_state_of
    from dovetail.pipelines.flow.local import FlowLocal
    from dovetail.pipelines.flow.messages import FlowLogProbs, Generate
    from dovetail.pipelines.flow.recipe import sample_timesteps
    from dovetail.prompts import train_prompts
    from dovetail.runtime.launch import device_pool, start_workers
    from dovetail.runtime.messages import Commit, Committed

    config = load_config(None, ["policy=digen", "train.sharding=fsdp", "runtime.trainer_group=1", "cluster.devices=2"])
    (name, pipeline), *_ = pipeline_configs(config).items()
    local = FlowLocal(pipeline)
    started = start_workers(config, device_pool(config), {name: trainer_state_of(local.model, local.optimizer)})
    first, second = started[name].workers
    ids = [SampleId(0, 0, member) for member in range(2)]
    generated = first.run.remote(Generate(name, ids, [train_prompts(pipeline)[0]] * 2, 0, started[name].weights))
    passes = recompute_passes([[sample_timesteps(pipeline, s)[0]] for s in ids])
    ray.get(first.run.remote(FlowLogProbs(name, [0], [generated], samples=ids, group=(0,), passes=passes)))
    commits = [worker.run.remote(Commit(name, (0, 1), group=(d,))) for d, worker in ((0, first), (1, second))]
    answers = ray.get(commits, timeout=90)
    assert all(isinstance(a, Committed) and a.group == (d,) for d, a in enumerate(answers)), answers
    first_state, second_state = ray.get([worker.trainer_state.remote() for worker in (first, second)])
    assert first_state["weights"].keys() == second_state["weights"].keys()
    assert all(np.array_equal(first_state["weights"][k], second_state["weights"][k]) for k in first_state["weights"])
