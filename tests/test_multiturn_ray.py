"""Multi-turn (env) runs on the Ray runtime (`pipelines.lm.engines`: an env run's decode rolls each trajectory out
whole on its device's rollout engine, with the environment process its engines hold): a policy that runs them ends
at the reference loop's parameters for the same trajectories, to the bit, with the same rewards and episode figures;
the policies that do not run them yet refuse an env config in one line."""

import json

import pytest
from running import train
from safetensors.torch import load_file
from test_runtime_lm import same_bits

from dovetail.config.common import ConfigError
from dovetail.config.load import load_config
from dovetail.cost.model import CostModel
from dovetail.graph.lm import LMShape, build_lm
from dovetail.graph.node import Kind

CALC = "configs/calc.yaml"
SMALL = [
    "algo.prompts_per_step=4",
    "algo.group_size=4",
    "algo.micro_batches=2",
    "eval.prompts=4",
    "eval.every=100",
    "runtime.profile_samples=4",
    "train.lr=1e-3",
]
STEPS = 2
EPISODES = ("env/turns", "env/tool_calls", "env/tool_errors", "env/unfinished")
pytestmark = pytest.mark.usefixtures("local_ray")


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def final_weights(out):
    return load_file(str(out / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    train(load_config(CALC, [*SMALL, "policy=reference"]), out, steps=STEPS)
    return out


@pytest.mark.exactness
def test_verl_sync_rolls_out_an_env_run_and_ends_at_the_reference_parameters(reference, tmp_path):
    train(load_config(CALC, [*SMALL, "policy=verl-sync"]), tmp_path, steps=STEPS)
    expected, got = final_weights(reference), final_weights(tmp_path)
    start = load_file(str(load_config(CALC, SMALL).model.checkpoint / "model.safetensors"))
    assert max((expected[k] - start[k]).abs().max().item() for k in expected) > 1e-4, "training moved the weights"
    assert same_bits(expected, got)
    lines, reference_lines = metrics(tmp_path), metrics(reference)
    for key in ("reward/total", "reward/env", "reward_std", "frac_reward_zero_std", *EPISODES):
        assert [m[key] for m in lines] == [m[key] for m in reference_lines], key
    assert [m["loss"] for m in lines] == pytest.approx([m["loss"] for m in reference_lines], rel=1e-5)
    assert all(m["env/tool_calls"] > 0 for m in lines), "the base model calls its tool: the turns were decoded"
    assert [m["env/wait_s"] for m in lines] == [0.0] * STEPS  # no latency: no engine ever waited
    assert [m["response_tokens"] for m in lines] == [m["response_tokens"] for m in reference_lines]
    ran = json.loads((tmp_path / "run_profile.json").read_text())["node_seconds"]
    assert {node.split("/", 2)[2] for node in ran if "/decode/" in node} == {"decode/0/0", "decode/1/0"}  # 2 engines


def test_an_env_run_decodes_each_shard_in_one_band_and_never_migrates():
    """Whatever the shape asks: a trajectory alternates turns with its environment's steps (`graph.lm.build_lm`)."""
    config = load_config(CALC, [*SMALL, "policy=verl-sync"])
    (spec,) = config.scenario(1).pipelines
    assert spec.multi_turn
    nodes = build_lm(spec, 1, LMShape(2, 2, migrate_at=spec.max_length // 2), CostModel(config.cluster.device))
    decodes = [n for n in nodes if n.kind == Kind.DECODE]
    assert sorted(n.shard for n in decodes) == [0, 1] and {n.band for n in decodes} == {(0, spec.max_length)}
    assert not any(n.kind == Kind.MIGRATE for n in nodes)
    single = spec.model_copy(update={"multi_turn": False, "length_bands": [spec.max_length // 4]})
    migrating = build_lm(single, 1, LMShape(2, 2, migrate_at=spec.max_length // 2), CostModel(config.cluster.device))
    assert any(n.kind == Kind.MIGRATE for n in migrating)  # the same shape migrates a single-turn step


@pytest.mark.parametrize("policy", ["streamrl", "areal", "jigsaw"])
def test_the_policies_that_run_no_environment_yet_refuse_one_in_one_line(policy):
    with pytest.raises(ConfigError) as refused:
        load_config(CALC, [*SMALL, f"policy={policy}"])
    assert str(refused.value).endswith(
        f"env: policy {policy} does not run environments yet; set policy: verl-sync (or reference)"
    )


def test_an_env_run_refuses_length_bands_in_one_line():
    with pytest.raises(ConfigError, match=r"runtime.length_bands: an env run decodes each trajectory whole"):
        load_config(CALC, [*SMALL, "policy=verl-sync", "runtime.length_bands=[8]"])
