"""LM GRPO on the Ray runtime: every LM policy runs the graph's nodes on DeviceWorkers; the synchronous one ends
at the reference loop's parameters, the asynchronous ones bound and record their staleness, and the ledger (checked
by the run itself) finds every response generated, scored and trained once."""

import json

import pytest
from safetensors.torch import load_file

from dovetail.config.train import ConfigError, load_config
from dovetail.train import train

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
STEPS = 3
pytestmark = pytest.mark.usefixtures("local_ray")


def final_weights(out):
    return load_file(str(out / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    train(load_config(None, [*SMALL, "policy=reference"]), out, steps=STEPS)
    return out


def test_verl_sync_on_ray_ends_at_the_reference_parameters(reference, tmp_path):
    train(load_config(None, [*SMALL, "policy=verl-sync"]), tmp_path, steps=STEPS)
    expected, got = final_weights(reference), final_weights(tmp_path)
    start = load_file(str(load_config(None, SMALL).model.checkpoint / "model.safetensors"))
    assert max((expected[k] - start[k]).abs().max().item() for k in expected) > 1e-4, "training moved the weights"
    assert max((expected[k] - got[k]).abs().max().item() for k in expected) <= 1e-5
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    reference_lines = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward/total"] for m in lines] == [m["reward/total"] for m in reference_lines]
    assert all(m["staleness"] == 0 and abs(m["ratio_mean"] - 1) < 1e-5 for m in lines)


@pytest.mark.parametrize(("policy", "bound"), [("streamrl", 1), ("areal", 4)])
def test_asynchronous_lm_policies_bound_their_staleness(policy, bound, tmp_path):
    summary = train(load_config(None, [*SMALL, f"policy={policy}"]), tmp_path, steps=STEPS)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == STEPS and all(0 <= m["staleness"] <= bound for m in lines)
    assert max(m["staleness"] for m in lines) >= 1, "the rollout pool ran ahead of the trainer"
    assert summary["max_staleness"] <= bound
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["problems"] == [] and len(ledger["trained"]) == STEPS * 4 * 4


@pytest.mark.parametrize(
    ("override", "field"),
    [("task=poetry", "task"), ("reward.nonsense=1", "reward"), ("algo.micro_batches=3", "micro_batches")],
)
def test_bad_lm_configs_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, [*SMALL, override])
