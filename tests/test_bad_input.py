"""Every bad input — a config file, an override, a flag, a scenario, a custom reward — is refused with one line
naming the file, field or flag and the fix, exit code 2, and nothing written: a table of hand-written cases through
the real command line, and hypothesis mutating valid configs and scenarios."""

import math
import os
import sys

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dovetail.cli import app, main
from dovetail.config.train import (
    ConfigError,
    FlowTrainConfig,
    LMTrainConfig,
    MultiplexConfig,
    load_config,
    parse_config,
)
from dovetail.report import compare
from dovetail.rewards import REWARDS, RewardError, score
from dovetail.rewards.text import TEXT_REWARDS, score_text
from dovetail.scenario import Scenario, list_scenarios, load_scenario, parse_scenario

runner = CliRunner()

LONGEST_LINE = 500
"""An error line shows what it refuses cut short: never the megabytes a bad input may hold."""

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")
)

CASES = [
    # (id, config file text or bytes (None: no file), arguments after `train`, what the line must name)
    ("malformed-yaml", "train: [1, 2\n", [], "bad.yaml:2:1: invalid YAML"),
    ("top-level-list", "- train\n- algo\n", [], "bad.yaml: a config is a mapping"),
    ("top-level-scalar", "42\n", [], "bad.yaml: a config is a mapping"),
    ("not-utf8", b"train:\n  lr: \xff\xfe\n", [], "bad.yaml: not UTF-8"),
    ("python-tag", "train: !!python/object/apply:os.system [echo pwned]\n", [], "bad.yaml:1:8"),
    ("anchor-bomb", BILLION_LAUGHS, [], "aliases (*name) are not read"),
    ("missing-file", None, ["{tmp}/missing.yaml"], "missing.yaml: no such file"),
    ("infinite-lr", None, ["train.lr=.inf"], "train.lr"),
    ("huge-lr", None, ["train.lr=1e30"], "train.lr"),
    ("huge-weight-decay", "train:\n  weight_decay: 1e30\n", [], "train.weight_decay"),
    ("infinite-noise", None, ["sampling.noise_level=.inf"], "sampling.noise_level"),
    ("huge-shift", None, ["sampling.shift=1e30"], "sampling.shift"),
    ("infinite-beta", None, ["algo.beta=.inf"], "algo.beta"),
    ("nan-reward-weight", None, ["reward.digit_match=.nan"], "reward.digit_match"),
    ("infinite-reward-weight", None, ["reward.brightness=-.inf"], "reward.brightness"),
    ("huge-devices", None, [f"cluster.devices={10**30}"], "cluster.devices"),
    ("huge-group", None, [f"algo.group_size={10**30}"], "algo.group_size"),
    ("huge-steps", None, [f"train.steps={10**30}"], "train.steps"),
    ("huge-per-digit", None, ["eval.per_digit=1000000"], "eval.per_digit"),
    ("true-as-group", None, ["algo.group_size=true"], "algo.group_size"),
    ("true-as-steps", "train:\n  steps: true\n", [], "train.steps"),
    ("true-as-lr", None, ["train.lr=true"], "train.lr"),
    ("string-as-int", None, ["eval.every='5'"], "eval.every"),
    ("malformed-address", None, ["cluster.address=not an address"], "cluster.address"),
    ("address-port-out-of-range", None, ["cluster.address=10.0.0.1:99999"], "cluster.address"),
    ("huge-name", None, ["name=" + "x" * 100_000], "name"),
    ("unknown-kind", None, ["kind=[flow]"], "kind"),
    ("unknown-field", None, ["train.learning_rate=1e-4"], "train.learning_rate"),
    ("override-without-value", None, ["algo.group_size=4", "train.lr"], "section.field=value"),
    ("reward-not-callable", None, ["reward.math:pi=1"], "reward 'math:pi' must be a function of (images, prompts)"),
    ("reward-wrong-arguments", None, ["reward.os:getcwd=1"], "reward 'os:getcwd' must be a function"),
    ("reward-not-importable", None, ["reward.no_such_module_here:f=1"], "cannot be imported"),
    ("lm-micro-batches", None, ["kind=lm", "algo.micro_batches=3"], "algo.micro_batches"),
    ("multiplex-not-a-list", "kind: multiplex\npipelines: sort\n", [], "pipelines"),
    ("devices-flag-zero", None, ["--devices", "0"], "--devices"),
    ("steps-flag-zero", None, ["--steps", "0"], "--steps"),
    ("policy-flag-empty", None, ["--policy", ""], "--policy"),
    ("policy-flag-unknown", None, ["--policy", "fastest"], "policy"),
]


def invoke_train(tmp_path, text, arguments: list[str], *extra: str):
    """`dovetail train` in this process with the case's file (if any) as its config and its run directory under
    tmp_path ({tmp} in an argument); the result and that directory."""
    arguments = [argument.replace("{tmp}", str(tmp_path)) for argument in arguments]
    if text is not None:
        path = tmp_path / "bad.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        arguments = [str(path), *arguments]
    out = tmp_path / "run"
    return runner.invoke(app, ["train", *arguments, "--out", str(out), *extra]), out


def assert_one_line(result, names: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert names in lines[0], lines[0]
    assert len(lines[0]) <= LONGEST_LINE, lines[0][:200]
    assert result.stdout == ""


@pytest.mark.parametrize(("text", "arguments", "names"), [case[1:] for case in CASES], ids=[c[0] for c in CASES])
def test_a_bad_config_is_one_line_naming_it_and_nothing_is_written(tmp_path, text, arguments, names):
    """--dry-run: a config accepted by mistake would plan and exit 0, not train."""
    result, out = invoke_train(tmp_path, text, arguments, "--dry-run")
    assert_one_line(result, names)
    assert not out.exists()


def test_a_directory_as_the_config_is_named(tmp_path):
    result = runner.invoke(app, ["train", str(tmp_path), "--dry-run", "--out", str(tmp_path / "run")])
    assert_one_line(result, f"{tmp_path}: is a directory")


def test_a_bad_config_leaves_an_existing_run_directory_as_it_was(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("kept\n")
    result = runner.invoke(app, ["train", "train.lr=.inf", "--out", str(out), "--steps", "1"])
    assert_one_line(result, "train.lr")
    assert [p.name for p in out.iterdir()] == ["config.yaml"] and (out / "config.yaml").read_text() == "kept\n"


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        pytest.param(
            ["cluster.device=H100", "policy=colocated"],
            "cluster.device=H100",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU"),
        ),
        (["cluster.device=cpu-core", f"cluster.devices={CORES + 1}", "policy=colocated"], "cluster.devices"),
    ],
)
def test_a_local_run_wanting_devices_this_machine_lacks_is_refused_before_training(tmp_path, overrides, names):
    result, out = invoke_train(tmp_path, None, overrides, "--steps", "1")
    assert_one_line(result, names)
    assert not out.exists()


def test_the_dry_run_still_plans_for_devices_this_machine_lacks(tmp_path):
    result, out = invoke_train(
        tmp_path, None, ["cluster.device=H100", "cluster.devices=8", "policy=digen"], "--dry-run"
    )
    assert result.exit_code == 0, result.output
    assert "policy digen on 8x H100" in result.stdout and not out.exists()


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["train", "--bogus"], ["dovetail train", "--bogus"]),
        (["train", "--steps", "abc"], ["dovetail train", "--steps"]),
        (["simulate", "--steps"], ["--steps", "requires an argument"]),
        (["frobnicate"], ["frobnicate"]),
    ],
)
def test_a_command_line_usage_error_is_one_line_naming_it(monkeypatch, capsys, argv, names):
    monkeypatch.setattr(sys, "argv", ["dovetail", *argv])
    with pytest.raises(SystemExit) as exit:
        main()
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and all(name in err for name in names), err


def test_no_arguments_print_the_help(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["dovetail"])
    with pytest.raises(SystemExit) as exit:
        main()
    assert exit.value.code == 0 and "Commands" in capsys.readouterr().out


def test_yaml_reads_exponent_floats_as_numbers():
    assert load_config(None, ["train.lr=3e-4", "sampling.shift=2E0"]).train.lr == 3e-4


@pytest.mark.parametrize(
    ("scenario", "arguments", "names"),
    [
        # a file's text, or changes to digen-flux-16 (None: it as shipped)
        ("schedule:\n  steps: [1\n", [], "bad.yaml:3:1: invalid YAML"),
        (b"name: \xff\n", [], "bad.yaml: not UTF-8"),
        ("- a\n", [], "bad.yaml: a scenario is a mapping"),
        (None, ["--steps", "0"], "--steps"),
        (None, ["--steps", "1000000000"], "--steps"),
        (None, ["--policies", ""], "--policies"),
        (None, ["--policies", "colocated,"], "--policies"),
        ({"schedule": {"steps": 10**9}}, [], "schedule.steps"),
        ({"cluster": {"devices": 10**9}}, [], "cluster.devices"),
        ({"pipelines": [{"prompts": 4096, "group": 1024}]}, [], "prompts x group"),
        ({"pipelines": [{"height": True}]}, [], "pipelines.0.flow.height"),
        ({"cluster": {"device": "H9000"}}, [], "cluster.device"),
        ({"pipelines": [{"model": "FLUX.9"}]}, [], "pipelines.0.model"),
    ],
)
def test_a_bad_scenario_is_one_line_naming_it(tmp_path, scenario, arguments, names):
    target = tmp_path / "bad.yaml"
    if scenario is None:
        target = "digen-flux-16"
    elif isinstance(scenario, dict):
        target.write_text(yaml.safe_dump(merged(load_scenario("digen-flux-16").model_dump(mode="json"), scenario)))
    else:
        target.write_bytes(scenario if isinstance(scenario, bytes) else scenario.encode())
    result = runner.invoke(app, ["simulate", str(target), *arguments])
    assert_one_line(result, names)


def merged(tree, changes):
    """tree with changes written in: mappings key by key, lists item by item."""
    if isinstance(changes, dict):
        return {**tree, **{key: merged(tree.get(key), change) for key, change in changes.items()}}
    if isinstance(changes, list):
        return [merged(item, change) for item, change in zip(tree, changes)] + tree[len(changes) :]
    return changes


# --- hypothesis: a valid tree with one node replaced by a bad value parses, or names its fields -----------------

BAD_VALUES = [
    math.nan,
    math.inf,
    -math.inf,
    -1,
    0,
    10**30,
    1e30,
    True,
    None,
    "",
    "1e-4",
    [1, 2],
    {"nested": {"x": 1}},
    "x" * 10_000,
]

RUN_FIELDS = {*FlowTrainConfig.model_fields, *LMTrainConfig.model_fields, *MultiplexConfig.model_fields}

VALID_CONFIGS = [
    parse_config({}).model_dump(mode="json"),
    parse_config(
        {"kind": "lm", "task": "sort", "reward": {"exact_answer": 1.0}, "runtime": {"length_bands": [4, 12]}}
    ).model_dump(mode="json"),
    {
        "kind": "multiplex",
        "policy": "jigsaw",
        "train": {"steps": 5},
        "cluster": {"devices": 2},
        "pipelines": [{"kind": "lm", "task": "sort", "name": "sort"}, {"kind": "flow", "name": "digits"}],
    },
]


def paths(tree, prefix=()) -> list[tuple]:
    """Every node below the root: a key or index path."""
    children = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else []
    found = []
    for key, child in children:
        found += [(*prefix, key), *paths(child, (*prefix, key))]
    return found


def replaced(tree, path: tuple, value):
    if not path:
        return value
    head, *rest = path
    if isinstance(tree, list):
        return [replaced(child, tuple(rest), value) if i == head else child for i, child in enumerate(tree)]
    return {key: replaced(child, tuple(rest), value) if key == head else child for key, child in tree.items()}


@st.composite
def mutated(draw, valid: list):
    tree = draw(st.sampled_from(valid))
    return replaced(tree, draw(st.sampled_from(paths(tree))), draw(st.sampled_from(BAD_VALUES)))


def problem_lines(message: str, heading: str) -> list[str]:
    """The lines of a one-line or several-line report after its heading, each a problem."""
    assert message.startswith(heading), message[:200]
    lines = [line.strip() for line in message.removeprefix(heading).removeprefix(":").splitlines() if line.strip()]
    assert lines, message
    return lines


def names_a_field(line: str, fields: set[str]) -> bool:
    leading = line.split(":", 1)[0].split("=", 1)[0]
    return leading.split(".")[0] in fields


FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(mutated(VALID_CONFIGS))
def test_a_mutated_config_parses_or_names_each_bad_field(tree):
    try:
        config = parse_config(tree)
    except ConfigError as error:
        for line in problem_lines(str(error), "invalid config"):
            assert names_a_field(line, RUN_FIELDS), line
            assert len(line) <= LONGEST_LINE, line[:200]
        return
    config.scenario(3)  # what the config accepts, the planner accepts


SHIPPED_SCENARIOS = [load_scenario(name).model_dump(mode="json") for name in list_scenarios()]


@FUZZ
@given(mutated(SHIPPED_SCENARIOS))
def test_a_mutated_scenario_parses_or_names_each_bad_field(tree):
    try:
        parse_scenario(tree)
    except ValueError as error:
        for line in problem_lines(str(error), "scenario: invalid scenario"):
            assert names_a_field(line, set(Scenario.model_fields)), line
            assert len(line) <= LONGEST_LINE, line[:200]


SMALL_SCENARIOS = [tree for tree in SHIPPED_SCENARIOS if tree["cluster"]["devices"] <= 8]
"""The shipped scenarios a simulation of every policy takes a second or so on."""

PLAUSIBLE_VALUES = [1, 2, 3, 5, 8, 64, 4096, True, False, None]
"""Values a scenario may well hold: most of these mutations parse, and each then has to simulate."""


@st.composite
def perturbed(draw, valid: list):
    """A valid tree with one number, flag or unset field replaced by a plausible value."""
    tree = draw(st.sampled_from(valid))
    leaves = [path for path in paths(tree) if isinstance(value_at(tree, path), int | float | bool | type(None))]
    return replaced(tree, draw(st.sampled_from(leaves)), draw(st.sampled_from(PLAUSIBLE_VALUES)))


def value_at(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(mutated(SMALL_SCENARIOS), perturbed(SMALL_SCENARIOS)))
def test_a_mutated_scenario_that_parses_gets_every_policy_s_row_or_one_line_why(tree):
    """What the scenario accepts, `dovetail simulate` runs: numbers, or a one-line reason per policy."""
    try:
        scenario = parse_scenario(tree)
    except ValueError:
        return  # named above
    result = compare(scenario, steps=1)
    assert list(result["policies"]) == scenario.schedule.policies
    for row in result["policies"].values():
        assert "error" not in row or ("\n" not in row["error"] and len(row["error"]) <= LONGEST_LINE), row


# --- custom rewards: what may be imported, and what they may return -------------------------------------------


@pytest.fixture
def marking_reward(tmp_path, monkeypatch):
    """A reward module that leaves a file behind when imported: whether a config ran its code."""
    marker = tmp_path / "imported"
    (tmp_path / "marking_reward.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\ndef score(images, prompts):\n    return [0.0] * len(prompts)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "marking_reward", raising=False)
    return marker


@pytest.mark.parametrize("allowed", ["", "other", "marking", "other.marking_reward"])
def test_a_reward_module_outside_the_allow_list_is_refused_without_importing_it(tmp_path, marking_reward, allowed):
    result = runner.invoke(
        app,
        ["train", "reward.marking_reward:score=1", "--dry-run", "--out", str(tmp_path / "run")],
        env={"DOVETAIL_REWARD_MODULES": allowed},
    )
    assert_one_line(result, "DOVETAIL_REWARD_MODULES")
    assert not marking_reward.exists()


@pytest.mark.parametrize("allowed", [None, "marking_reward", "other, marking_reward"])
def test_a_reward_module_the_allow_list_names_is_imported(monkeypatch, marking_reward, allowed):
    if allowed is None:
        monkeypatch.delenv("DOVETAIL_REWARD_MODULES", raising=False)
    else:
        monkeypatch.setenv("DOVETAIL_REWARD_MODULES", allowed)
    assert load_config(None, ["reward.marking_reward:score=1"]).reward == {"marking_reward:score": 1.0}
    assert marking_reward.exists()


@pytest.mark.parametrize(
    "output",
    [None, 3.0, np.zeros((4, 2)), np.zeros(3), ["1", "2", "3", "4"], [[1.0], [2.0, 3.0], [], [4.0]], {"a": 1}],
    ids=["none", "scalar", "wrong-shape", "wrong-length", "numeric-strings", "ragged", "dict"],
)
def test_a_reward_returning_anything_but_one_number_per_sample_is_named(monkeypatch, output):
    monkeypatch.setitem(REWARDS, "odd", lambda images, prompts: output)
    with pytest.raises(RewardError, match=r"^reward 'odd' returned .*; return one number per sample: shape \(4,\)$"):
        score(np.zeros((4, 8, 8)), ["digit 0"] * 4, {"odd": 1.0})
    monkeypatch.setitem(TEXT_REWARDS, "odd", lambda completions, prompts: output)
    with pytest.raises(RewardError, match=r"^reward 'odd' returned .*; return one number per sample"):
        score_text(["1"] * 4, ["sort ab:"] * 4, {"odd": 1.0})


def test_a_reward_returning_booleans_or_integers_is_scored(monkeypatch):
    monkeypatch.setitem(REWARDS, "flags", lambda images, prompts: np.arange(len(prompts)) % 2 == 0)
    monkeypatch.setitem(REWARDS, "counts", lambda images, prompts: list(range(len(prompts))))
    scores = score(np.zeros((3, 8, 8)), ["digit 0"] * 3, {"flags": 1.0, "counts": 2.0})
    np.testing.assert_array_equal(scores["total"], [1.0, 2.0, 5.0])
