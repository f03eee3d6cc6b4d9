"""`dovetail train --dry-run`: the config, checkpoint and devices checked and the plan predicted, nothing trained."""

import subprocess
import sys

import pytest

from dovetail.config.load import load_config
from dovetail.cost.calibration import DEFAULT
from dovetail.runtime.launch import dry_run, profiled_here

LM = [
    "kind=lm",
    "task=sort",
    "algo.prompts_per_step=4",
    "algo.group_size=4",
    "eval.prompts=8",
    "runtime.profile_samples=4",
]


def test_dry_run_on_cpu_cores_profiles_this_machine_and_keeps_the_config_s_choices():
    plan = dry_run(load_config(None, ["policy=digen", "runtime.fragments=2", "runtime.tsp_chunk=1"]), 200)
    assert plan["costs"] == "profiled" and (plan["shape"]["fragments"], plan["shape"]["tsp_chunk"]) == (2, 1)
    assert 0 < plan["step_time_s"] and plan["run_s"] == pytest.approx(200 * plan["step_time_s"])
    assert plan["samples_per_s"] == pytest.approx(64 / plan["step_time_s"], rel=0.05)
    assert 0 < plan["efficiency"] <= 1


def test_dry_run_on_gpus_uses_the_catalogue_and_splits_the_pools():
    plan = dry_run(
        load_config(
            None,
            [
                "policy=disaggregated",
                "cluster.device=H100",
                "cluster.devices=8",
                "runtime.trainer_devices=2",
                "runtime.reward_devices=1",
            ],
        ),
        10,
    )
    assert plan["costs"] == "analytic" and plan["trainer_devices"] == 2
    # one optimizer step per batch on the weights that sampled: the run trains on the rollout's log-probs, with no
    # recompute pass (verl's default, which the catalogue's disaggregated scenarios keep)
    assert not plan["shape"]["recompute_logprob"]


def test_a_dry_run_given_a_profile_prices_on_it_and_profiles_nothing():
    """Arrangements compared on one profile (benchmarks/agentic_multiplex.py): the profile given is what the costs
    are fitted to, so the same profile gives the same forecast, and one whose every measured second is doubled a
    step at most twice as long; what doubling leaves is each node's Ray call (`Calibration.cpu_node_call_s`: a step
    of this config runs prefill, decode, score, two train passes, the commit and the publication on each device) and
    the unmeasured analytic costs (under 5 % of a step)."""
    config = load_config(None, [*LM, "policy=verl-sync"])
    profiles = profiled_here(config)
    assert set(profiles) == {"sort"}
    plan = dry_run(config, 3, profiles)
    assert plan["costs"] == "profiled" and dry_run(config, 3, profiles) == plan
    doubled = {
        name: {key: 2 * value if isinstance(value, float) else value for key, value in profile.items()}
        for name, profile in profiles.items()
    }
    step_s, doubled_s = plan["step_time_s"], dry_run(config, 3, doubled)["step_time_s"]
    unchanged_s = 2 * step_s - doubled_s
    calls_s = 7 * DEFAULT.cpu_node_call_s
    assert calls_s - 1e-9 <= unchanged_s <= calls_s + 0.05 * step_s


def test_dry_run_refuses_what_the_run_would_refuse():
    with pytest.raises(FileNotFoundError, match="dovetail pretrain digits --out /nonexistent"):
        dry_run(load_config(None, ["model.checkpoint=/nonexistent"]), 10)
    with pytest.raises(ValueError, match="can be planned .* but not run"):
        dry_run(load_config(None, ["policy=digen", "cluster.device=Ascend-910B"]), 10)
    assert dry_run(load_config(None, ["policy=reference"]), 10) == {"policy": "reference"}


@pytest.mark.slow
def test_dry_run_on_the_command_line_writes_no_run(tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "dovetail.cli",
        "train",
        "--dry-run",
        "--policy",
        "colocated",
        "--out",
        str(out),
        "--steps",
        "50",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    assert "policy colocated on 2x cpu-core (2 shared)" in result.stdout and "50 steps in about" in result.stdout
    assert not out.exists()
