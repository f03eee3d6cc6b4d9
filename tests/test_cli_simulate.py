"""`dovetail simulate` and `dovetail plan` as a user runs them."""

import json
import re

import pytest
from typer.testing import CliRunner

from dovetail.cli import app
from dovetail.config.load import load_config

runner = CliRunner()


def test_list_names_every_shipped_flow_scenario():
    result = runner.invoke(app, ["simulate", "--list"])
    assert result.exit_code == 0
    for name in (
        "calib-qwenimage-4xh200",
        "calib-wan22-colocated",
        "digen-flux-16",
        "digen-wan-16",
        "digen-hunyuan-32",
        "digen-qwenimage-32",
    ):
        assert name in result.output


def test_json_has_every_field_and_speedups_over_the_first_policy(tmp_path):
    trace, gantt = tmp_path / "t.json", tmp_path / "g.png"
    result = runner.invoke(
        app,
        [
            "simulate",
            "digen-flux-16",
            "--policies",
            "colocated,digen",
            "--steps",
            "1",
            "--json",
            "--trace",
            str(trace),
            "--gantt",
            str(gantt),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["scenario"] == "digen-flux-16" and list(data["policies"]) == ["colocated", "digen"]
    fields = {
        "samples_per_s",
        "tokens_per_s",
        "step_time_s",
        "efficiency",
        "bubble_ratio",
        "max_staleness",
        "peak_memory_gb",
        "phase_seconds",
    }
    for metrics in data["policies"].values():
        assert fields <= set(metrics)
        assert 0 < metrics["efficiency"] <= 1
    colocated, digen = data["policies"]["colocated"], data["policies"]["digen"]
    assert colocated["speedup"] == 1.0
    assert digen["speedup"] == digen["samples_per_s"] / colocated["samples_per_s"]
    assert "logprob" in colocated["phase_seconds"] and "logprob" not in digen["phase_seconds"]
    for policy in ("colocated", "digen"):
        chrome = json.loads((tmp_path / f"t.{policy}.json").read_text())
        assert any(e["ph"] == "X" for e in chrome["traceEvents"])
        assert (tmp_path / f"g.{policy}.png").read_bytes()[:4] == b"\x89PNG"


def test_table_lists_each_policy():
    result = runner.invoke(
        app, ["simulate", "calib-qwenimage-4xh200", "--policies", "colocated,disaggregated", "--steps", "1"]
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("calib-qwenimage-4xh200") and "speedup" in lines[1]
    assert lines[3].startswith("colocated") and " 1.00x" in lines[3] and lines[4].startswith("disaggregated")


def test_bad_input_is_named(tmp_path):
    result = runner.invoke(app, ["simulate", "no-such-scenario"])
    assert result.exit_code == 2 and "no scenario 'no-such-scenario'" in result.output
    result = runner.invoke(app, ["simulate", "digen-flux-16", "--policies", "colocated,fastest"])
    assert result.exit_code == 2 and "unknown policy 'fastest'" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: bad\ncluster: {device: H100, devices: 4}\nschedule: {policies: [colocated]}\n"
        "pipelines:\n  - "
        "{kind: flow, name: p, model: SD3.5-M, prompts: 4, group: 0, denoising_steps: 4, trained_timesteps: 2, "
        "height: 256, width: 256}\n"
    )
    result = runner.invoke(app, ["simulate", str(bad)])
    assert result.exit_code == 2 and "pipelines.0.flow.group" in result.output
    assert "greater than or equal to 2" in result.output  # a group of one compares nothing: the run config's rule


def test_plan_prints_a_best_configuration_that_fits():
    result = runner.invoke(app, ["plan", "calib-qwenimage-4xh200", "--devices", "4", "--policies", "colocated"])
    assert result.exit_code == 0, result.output
    best = result.output.splitlines()[-1]  # one policy: no runner-up to say why against
    assert best.startswith("best: trainer_devices=") and "samples/s" in best
    assert best.endswith("(colocated cuts this shape itself)")
    result = runner.invoke(app, ["plan", "calib-qwenimage-4xh200", "--devices", "1"])
    assert result.exit_code == 2 and "--devices must be at least 2" in result.output


def test_plans_best_line_names_the_run_config_keys_that_run_it():
    result = runner.invoke(app, ["plan", "calib-qwenimage-4xh200", "--devices", "4", "--policies", "digen"])
    assert result.exit_code == 0, result.output
    best = result.output.splitlines()[-1]
    assert best.endswith(" in the run config (digen searches its shape itself as the run starts)"), best
    keys = best.split("to run it, set ")[1].split(" in the run config")[0].split()
    config = load_config(None, keys)  # the shipped digits config takes them as overrides
    assert (config.policy, config.cluster.device, config.cluster.devices) == ("digen", "H200", 4)


def test_plan_weighs_every_listed_policy_and_names_the_shortest_steady_step():
    """A scenario listing five LM policies, the first of them not the fastest: plain `dovetail plan` simulates each
    (not only the first and the searching ones) and names the one whose chosen shape steps fastest once warm, which
    each policy's own simulation on the same devices and steps says independently of the plan's table."""
    from dovetail.plan.metrics import summarize
    from dovetail.plan.prepare import prepare, run_prepared
    from dovetail.plan.scenario import load_scenario
    from dovetail.sched.policy import search_horizon

    scenario = load_scenario("jigsaw-qwen3-4b-8xh100")
    listed = scenario.schedule.policies
    result = runner.invoke(app, ["plan", scenario.name, "--devices", "8"])
    assert result.exit_code == 0, result.output
    assert all(any(line.startswith(f"{name}: ") for line in result.output.splitlines()) for name in listed)
    steps = search_horizon(scenario.schedule.steps)
    steady = {
        name: summarize(run_prepared(scenario, prepare(scenario, name, steps=steps, devices=8))).steady_step_s
        for name in listed
    }
    fastest = min(steady, key=steady.__getitem__)
    assert fastest != listed[0], steady  # the case the plan got wrong: the first listed was named best
    (best,) = [line for line in result.output.splitlines() if line.startswith("best: ")]
    assert f" under {fastest} -> " in best and f"{steady[fastest]:.1f} s/step steady" in best, (best, steady)


def test_plan_ranks_every_policy_the_scenario_allows_and_says_why_the_best_wins():
    """Plain `plan` weighs every policy that schedules the scenario's kind, not only the listed ones, and its last
    line compares the best with the runner-up: the gap and the kind of work whose seconds a step differ most."""
    from dovetail.plan.report import allowed_policies
    from dovetail.plan.scenario import load_scenario
    from dovetail.sched import POLICIES, policy_class

    scenario = load_scenario("calib-qwenimage-4xh200")
    allowed = allowed_policies(scenario)
    assert set(allowed) == {name for name in POLICIES if "flow" in policy_class(name).pipeline_kinds}
    assert set(allowed) > set(scenario.schedule.policies)
    result = runner.invoke(app, ["plan", scenario.name, "--devices", "4"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(any(line.startswith(f"{name}: ") for line in lines) for name in allowed)
    why = re.fullmatch(
        r"why: (\S+) steps ([\d.]+) s faster than (\S+) once warm \(([\d.]+) vs ([\d.]+) s\); most of it (\S+): .*",
        lines[-1],
    )
    assert why, lines[-1]
    winner, gap, runner_up, best_s, runner_s = why.group(1), *why.group(2, 3, 4, 5)
    assert winner != runner_up and f"under {winner} -> " in next(line for line in lines if line.startswith("best: "))
    assert float(gap) == pytest.approx(float(runner_s) - float(best_s), abs=0.11) and float(gap) > 0
