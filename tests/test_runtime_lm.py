"""LM GRPO on the Ray runtime: every LM policy runs the graph's nodes on DeviceWorkers; the synchronous one ends
at the reference loop's parameters, the asynchronous ones bound and record their staleness, and the ledger (checked
by the run itself) finds every response generated, scored and trained once."""

import itertools
import json
import math
import random
import re

import pytest
import ray
import torch
from conftest import train_until_the_reward_breaks
from running import train
from safetensors.torch import load_file
from typer.testing import CliRunner

from dovetail.cli import app
from dovetail.config.common import ConfigError
from dovetail.config.load import load_config
from dovetail.cost.calibration import DEFAULT
from dovetail.cost.model import CostModel
from dovetail.graph.lm import LMShape, build_lm
from dovetail.graph.node import Kind
from dovetail.pipelines.lm.adapter import balanced
from dovetail.pipelines.lm.config import ROLLOUT_PASS, STEP_PASS
from dovetail.pipelines.lm.messages import LMTrain, Prefill
from dovetail.pipelines.lm.startup import fitted_cost, profile_here
from dovetail.plan.prepare import prepare
from dovetail.rewards import RewardError
from dovetail.runtime.launch import dry_run
from dovetail.runtime.replay import replay_run
from dovetail.sched import policy_class

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
pytestmark = [pytest.mark.usefixtures("local_ray"), pytest.mark.slow]


def same_bits(expected: dict, got: dict) -> bool:
    """The LM policies end at the reference loop's parameters to the bit, on any CPU: the trainer's unit is a group,
    whose fp32 gradient is the same bits in any part or device, and groups add up in fp64, so no split of the batch
    changes the gradient the optimizer sees (tests/test_lm_exactness.py). A tolerance would not do: Adam turns a
    rounding difference in a near-zero gradient into a step of ~lr."""
    return expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def final_weights(out):
    return load_file(str(out / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    train(load_config(None, [*SMALL, "policy=reference"]), out, steps=STEPS)
    return out


@pytest.mark.exactness
def test_verl_sync_on_ray_ends_at_the_reference_parameters(reference, tmp_path):
    train(load_config(None, [*SMALL, "policy=verl-sync"]), tmp_path, steps=STEPS)
    replay = replay_run(tmp_path)
    assert abs(replay["relative_error"]) < 0.3, replay
    expected, got = final_weights(reference), final_weights(tmp_path)
    start = load_file(str(load_config(None, SMALL).model.checkpoint / "model.safetensors"))
    assert max((expected[k] - start[k]).abs().max().item() for k in expected) > 1e-4, "training moved the weights"
    assert same_bits(expected, got)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    reference_lines = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward/total"] for m in lines] == [m["reward/total"] for m in reference_lines]
    for key in ("reward_std", "frac_reward_zero_std"):  # the same rewards: the same spread, bit for bit
        assert [m[key] for m in lines] == [m[key] for m in reference_lines]
    assert [m["loss"] for m in lines] == pytest.approx([m["loss"] for m in reference_lines], rel=1e-5)
    assert not any("tag_decisions" in m for m in lines)  # digen's alone: no LM policy lends its trainer
    assert all(m["staleness"] == 0 and abs(m["ratio_mean"] - 1) < 1e-5 for m in lines)
    # the commit's own split: inside the commit node's time on its devices
    assert all(0 < m["commit_sync_s"] and 0 < m["commit_optimizer_s"] for m in lines)
    assert all(m["commit_sync_s"] + m["commit_optimizer_s"] <= m["commit_s"] for m in lines)


def test_trainer_devices_get_groups_of_about_equal_tokens_within_the_longest_processing_time_bound():
    """`balanced` against the best split, found by trying every one: each group once, each share in order, and the
    largest share within Graham's bound for the rule, (4/3 - 1/(3 m)) of the best on m devices."""
    assert balanced([10, 9, 8, 1, 1, 1], 2) == [[0, 3, 4, 5], [1, 2]]  # by count: 27 tokens against 3
    rng = random.Random(0)
    for _ in range(200):
        shares, costs = rng.choice([2, 3]), [rng.randint(1, 60) for _ in range(rng.randint(1, 8))]
        split_up = balanced(costs, shares)
        assert sorted(i for share in split_up for i in share) == list(range(len(costs)))
        assert all(share == sorted(share) for share in split_up)
        best = min(
            max(sum(c for c, s in zip(costs, owners) if s == share) for share in range(shares))
            for owners in itertools.product(range(shares), repeat=len(costs))
        )
        largest = max(sum(costs[i] for i in share) for share in split_up)
        assert largest <= (4 / 3 - 1 / (3 * shares)) * best + 1e-9


def test_decode_by_length_band_pauses_and_continues_responses_exactly(reference, tmp_path):
    """Three bands per shard: each continues the responses the last one paused, on the engine's cache."""
    train(load_config(None, [*SMALL, "policy=verl-sync", "runtime.length_bands=[6, 12]"]), tmp_path, steps=STEPS)
    ran = json.loads((tmp_path / "run_profile.json").read_text())["node_seconds"]
    bands = {node.rsplit("/", 1)[1] for node in ran if "/decode/" in node}
    assert bands == {"0", "6", "12"}
    expected, got = final_weights(reference), final_weights(tmp_path)
    assert same_bits(expected, got)


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


def test_killed_workers_lose_no_response_and_train_as_if_undisturbed(reference, tmp_path):
    """One device dies with a paused response in its engine (after a prefill), another holding gradients of the
    open step (after a train part): responses are re-prefilled token for token, gradients rebuilt."""
    killed = []

    def kill(executor, part):
        victim = (not killed and isinstance(part.work, Prefill) and part.work.samples[0].step == 1) or (
            len(killed) == 1 and isinstance(part.work, LMTrain) and part.work.samples[0].step == 2
        )
        if victim:
            killed.append((part.device, part.node))
            ray.kill(executor.worker_of(part), no_restart=False)

    summary = train(load_config(None, [*SMALL, "policy=verl-sync"]), tmp_path, steps=STEPS, after_part=kill)
    assert len(killed) == 2 and summary["restarts"] >= 2
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["problems"] == [] and dict(zip(("device", "node"), killed[1])) in ledger["reruns"]
    expected, got = final_weights(reference), final_weights(tmp_path)
    assert same_bits(expected, got)


def test_dry_run_of_an_lm_config_profiles_and_predicts():
    plan = dry_run(load_config(None, [*SMALL, "policy=streamrl"]), 50)
    assert plan["costs"] == "profiled" and plan["shape"]["shards"] >= 1 and plan["shape"]["stream"]
    assert plan["trainer_devices"] + plan["rollout_devices"] == 2
    assert 0 < plan["step_time_s"] and plan["run_s"] == pytest.approx(50 * plan["step_time_s"])


def test_a_failing_reward_saves_the_last_step_and_the_run_resumes_where_it_stopped(local_ray, reference, tmp_path):
    flag = local_ray
    overrides = [*SMALL, "policy=verl-sync", "reward={faulty_reward:nan_text_when_flagged: 1.0}"]

    def break_reward_after_first_commit(executor, part):
        if part.node == "sort/0/commit":
            flag.touch()

    with pytest.raises(RewardError, match=r"faulty_reward:nan_text_when_flagged.*sample 1.*resume"):
        train(load_config(None, overrides), tmp_path, steps=STEPS, after_part=break_reward_after_first_commit)
    flag.unlink()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
    train(load_config(None, overrides), tmp_path, steps=STEPS, resume=tmp_path)
    expected, got = final_weights(reference), final_weights(tmp_path)
    assert same_bits(expected, got)


@pytest.mark.exactness
def test_with_an_lr_schedule_verl_sync_and_its_resumed_run_end_at_the_reference_parameters_and_the_replay_says_so(
    local_ray, reference, tmp_path
):
    """Every step's lr is a function of the optimizer's own step count (`models.training.commit`): the reference
    loop, the Ray trainer and a trainer restored from the checkpoint of step 1 take the same steps."""
    flag = local_ray
    scheduled = [*SMALL, "train.lr_schedule=cosine", "reward={faulty_reward:nan_text_when_flagged: 1.0}"]
    train(load_config(None, [*scheduled, "policy=reference"]), tmp_path / "reference", steps=STEPS)
    expected = final_weights(tmp_path / "reference")
    assert not same_bits(final_weights(reference), expected), "the schedule changed the run"
    train(load_config(None, [*scheduled, "policy=verl-sync"]), tmp_path / "ray", steps=STEPS)
    assert same_bits(expected, final_weights(tmp_path / "ray"))

    def break_reward_after_first_commit(executor, part):
        if part.node == "sort/0/commit":
            flag.touch()

    resumed = tmp_path / "resumed"
    with pytest.raises(RewardError):
        train(
            load_config(None, [*scheduled, "policy=verl-sync"]),
            resumed,
            steps=STEPS,
            after_part=break_reward_after_first_commit,
        )
    flag.unlink()
    train(load_config(None, [*scheduled, "policy=verl-sync"]), resumed, steps=STEPS, resume=resumed)
    assert same_bits(expected, final_weights(resumed))
    # each step logs the lr it took, transformers' cosine schedule's: lr x (1 + cos(pi k / 3)) / 2 for step k
    lrs = [1e-3 * (1 + math.cos(math.pi * k / STEPS)) / 2 for k in range(STEPS)]
    for run in ("reference", "ray", "resumed"):
        logged = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert [m["learning_rate"] for m in logged] == pytest.approx(lrs, abs=1e-15, rel=0), run

    # the replay of the resumed run is of the steps its last process ran, and says so; a fresh run's says nothing
    assert (replay_run(resumed)["resumed_from"], replay_run(resumed)["steps"]) == (1, STEPS - 1)
    said = CliRunner().invoke(app, ["simulate", "--from-run", str(resumed)])
    assert said.exit_code == 0 and said.stdout.splitlines()[0] == (
        f"the run was resumed from step 1: this replays steps 2-{STEPS} alone, the last --resume's (each writes "
        "run_profile.json anew)"
    )
    fresh = CliRunner().invoke(app, ["simulate", "--from-run", str(tmp_path / "ray")])
    assert fresh.exit_code == 0 and fresh.stdout.startswith("verl-sync over 3 steps"), fresh.output


@pytest.mark.parametrize("policy", ["verl-sync", "streamrl", "areal"])
def test_a_reward_failing_mid_run_stops_every_policy_saved_at_its_last_commit_in_one_line(local_ray, policy, tmp_path):
    """The reward turns NaN once step 0 is committed. The run is long enough that a step which cannot open before
    that commit (its staleness bound + 1) scores after it, and that the policy has steps left to open once the
    pipeline stopped, which it must not. Which step fails first depends on how far the rollouts ran ahead: whichever
    it is, the run stops at the last committed one, saved, and says so in one line."""
    flag = local_ray
    steps = policy_class(policy).max_staleness + 3
    config = load_config(None, [*SMALL, f"policy={policy}", "reward={faulty_reward:nan_text_when_flagged: 1.0}"])
    saved, committed, message = train_until_the_reward_breaks(flag, config, "sort", steps, tmp_path)
    assert saved == f"step_{committed:06d}" and 1 <= committed < steps
    run = re.escape(str(tmp_path))
    assert re.fullmatch(
        r"reward 'faulty_reward:nan_text_when_flagged' returned nan for sample 1 \(prompt [^\n]*, completion "
        rf"[^\n]*\); pipeline sort stopped, its last committed step is saved in {run}/checkpoints/{saved}: "
        rf"fix the reward and resume with `dovetail train --resume {run}`",
        message,
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sampling.max_new_tokens=120", "exceed the model's context of 128 tokens .*lower sampling.max_new_tokens"),
        ("model.checkpoint=/nonexistent-lm", "no language-model checkpoint in /nonexistent-lm; run `dovetail pretrain"),
    ],
)
def test_bad_lm_input_is_one_line_with_the_fix_and_exit_code_2(override, message, tmp_path):
    result = CliRunner().invoke(app, ["train", *SMALL, "policy=reference", override, "--out", str(tmp_path)])
    assert result.exit_code == 2 and re.search(message, result.output)
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_lm_grpo_on_ray_raises_a_learnable_reward(tmp_path):
    """GRPO under verl-sync on 2 devices learns a toy reward (short completions) within 10 steps: the mean reward
    of the last 3 steps beats the first 3's by 0.15 (the 30-step held-out curve of configs/sort.yaml is in
    benchmarks/learning_curves.py)."""
    overrides = ["kind=lm", "task=sort", "policy=verl-sync", "algo.prompts_per_step=8", "algo.group_size=8"]
    overrides += ["train.lr=1e-3", "eval.every=100", "eval.prompts=8", "checkpoint.every=100"]
    train(load_config(None, [*overrides, "reward={toy_rewards:short_completions: 1.0}"]), tmp_path, steps=10)
    rewards = [json.loads(line)["reward/total"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(rewards[-3:]) / 3 >= sum(rewards[:3]) / 3 + 0.15, rewards


def test_the_profile_s_two_sizes_give_each_kind_of_pass_its_fixed_cost():
    """The start-up profile times each kind of LM work at its size and at the responses a device trains in one pass
    of the run's step, and the rollout's kinds at what a device decodes in one call too where that is more, from the
    same weights (a larger size's first responses are the smaller's), and the fit takes a line through them: a device
    that pays 10 ms a pass plus twice the analytic seconds (the profile's real responses, seconds made so) is fitted
    exactly that, then priced as a run on busy cores pays it (`CostModel.on_busy_cores`: both slowed by the run's
    share of the cores, a Ray call per node on top), each graph node carrying the fixed cost beside its work."""
    config = load_config(None, [*SMALL, "algo.prompts_per_step=16", "algo.micro_batches=2"])
    measured = profile_here(config, carry=lambda weights: weights)
    samples = config.runtime.profile_samples
    nodes = prepare(config.scenario(1), "verl-sync").graph.nodes.values()
    (train_node, *_) = [n for n in nodes if n.kind == Kind.TRAIN]
    (decode_node, *_) = [n for n in nodes if n.kind == Kind.DECODE]
    per_device = len(train_node.samples) // config.cluster.devices  # verl-sync trains a micro-batch on every device
    per_call = len(decode_node.samples)  # and decodes a shard of the step on each
    assert len(measured["lengths"]) == samples and len(measured[f"lengths{STEP_PASS}"]) == per_device > 2 * samples
    assert len(measured[f"lengths{ROLLOUT_PASS}"]) == per_call > per_device
    for suffix in (STEP_PASS, ROLLOUT_PASS):
        assert measured[f"lengths{suffix}"][:samples] == measured["lengths"], "every size decodes from the same weights"
    scenario = config.scenario(1)
    spec = scenario.pipelines[0]
    model, analytic = spec.catalogue_model(), CostModel(config.cluster.device)
    for suffix in ("", STEP_PASS, ROLLOUT_PASS):
        prompts, lengths = measured[f"prompt_tokens{suffix}"], measured[f"lengths{suffix}"]
        full = [p + n for p, n in zip(prompts, lengths)]
        work = {"prefill": analytic.prefill(model, prompts), "decode": analytic.decode(model, prompts, lengths)}
        work |= {"logprob": analytic.logprob(model, full), "train": analytic.train(model, full)}
        measured |= {f"{kind}{suffix}": 0.01 + 2 * seconds for kind, seconds in work.items()}
    cost = fitted_cost(config, scenario, measured | {"switch": 0.0})
    slowdown, fixed = DEFAULT.cpu_run_slowdown, 0.01 * DEFAULT.cpu_run_slowdown + DEFAULT.cpu_node_call_s
    for kind in ("prefill", "decode", "logprob", "train"):
        assert cost.fixed(kind) == pytest.approx(fixed, rel=1e-6)
        assert cost.scale(kind) == pytest.approx(2 * slowdown, rel=1e-6)
    (train, *_) = [
        n for n in build_lm(spec, 1, LMShape(1, 1, stream=False, shared=False), cost) if n.kind == Kind.TRAIN
    ]
    assert train.fixed_s == pytest.approx(fixed, rel=1e-6)


def test_a_run_s_commit_across_trainer_replicas_is_priced_at_the_sync_its_devices_measured(tmp_path, monkeypatch):
    """The runtime replicates the trainer on every trainer device, so its commit is a whole optimizer step plus the
    gradients added across the replicas: the start-up profile times that adding (`DeviceWorker.time_sync`) and the
    planner charges the commit on two devices exactly the optimizer step plus what was measured; on one device the
    optimizer step alone (each as a run on busy cores pays it: `Calibration.cpu_run_slowdown` longer)."""
    config = load_config(None, [*SMALL, "policy=verl-sync", "cluster.devices=2"])
    scenario = config.scenario(1)
    spec = scenario.pipelines[0]
    assert spec.replicated_trainer
    measured = profile_here(config, carry=lambda weights: weights) | {"switch": 0.0, "sync": 0.05, "sync_devices": 2}
    cost = fitted_cost(config, scenario, measured)
    for devices, sync in ((2, 0.05 * DEFAULT.cpu_run_slowdown), (1, 0.0)):
        shape = LMShape(1, devices, stream=False, shared=False)
        (commit,) = [node for node in build_lm(spec, 1, shape, cost) if node.kind == Kind.COMMIT]
        optimizer = cost.optimizer_step(spec.catalogue_model().params)
        assert commit.cost_s == pytest.approx(optimizer + sync, rel=1e-9)
    optimizer_s = measured["optimizer"] * DEFAULT.cpu_run_slowdown
    assert cost.optimizer_step(spec.catalogue_model().params) == pytest.approx(optimizer_s, rel=1e-9)
    monkeypatch.setenv("DOVETAIL_CACHE", str(tmp_path / "cache"))
    train(config, tmp_path / "run", steps=1)
    (entry,) = (tmp_path / "cache").glob("sync-*.json")
    timed = json.loads(entry.read_text())
    assert timed["sync_devices"] == 2 and 0 < timed["sync"] < 5
