"""Every bad input — a config file, an override, a flag, a scenario, a custom reward — is refused with one line
naming the file, field or flag and the fix, exit code 2, and nothing written: a table of hand-written cases through
the real command line, and hypothesis mutating valid configs and scenarios."""

import json
import math
import os
import shutil
import signal
import sys
from dataclasses import asdict
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dovetail.cli import app, main
from dovetail.config.common import ConfigError
from dovetail.config.load import load_config, parse_config
from dovetail.config.multiplex import MultiplexConfig
from dovetail.models.lm import ASSETS_DIR as ASSETS
from dovetail.models.tokenizer import DEFAULT_ALPHABET
from dovetail.pipelines.flow.config import FlowTrainConfig
from dovetail.pipelines.lm.config import LMTrainConfig
from dovetail.plan.prepare import prepare
from dovetail.plan.report import compare
from dovetail.plan.scenario import Scenario, list_scenarios, load_scenario, parse_scenario
from dovetail.rewards import REWARDS, RewardError, score
from dovetail.rewards.text import TEXT_REWARDS, score_text

runner = CliRunner()

LONGEST_LINE = 500
"""An error line shows what it refuses cut short: never the megabytes a bad input may hold."""

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")
)

FIVE_PIPELINES = "kind: multiplex\npipelines:\n" + "".join(f"  - {{kind: lm, name: p{i}}}\n" for i in range(5))

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
    ("huge-per-prompt", None, ["eval.per_prompt=1000000"], "eval.per_prompt"),
    ("huge-per-digit", None, ["eval.per_digit=1000000"], "eval.per_digit"),
    ("per-digit-beside-per-prompt", None, ["eval.per_prompt=2", "eval.per_digit=3"], "give per_prompt alone"),
    ("true-as-group", None, ["algo.group_size=true"], "algo.group_size"),
    ("true-as-steps", "train:\n  steps: true\n", [], "train.steps"),
    ("true-as-lr", None, ["train.lr=true"], "train.lr"),
    ("string-as-int", None, ["eval.every='5'"], "eval.every"),
    ("malformed-address", None, ["cluster.address=not an address"], "cluster.address"),
    ("address-port-out-of-range", None, ["cluster.address=10.0.0.1:99999"], "cluster.address"),
    ("publication-unknown", None, ["cluster.publication=nccl"], "cluster.publication"),
    ("huge-name", None, ["name=" + "x" * 100_000], "name"),
    ("unknown-kind", None, ["kind=[flow]"], "kind"),
    ("unknown-field", None, ["train.learning_rate=1e-4"], "train.learning_rate"),
    ("override-without-value", None, ["algo.group_size=4", "train.lr"], "section.field=value"),
    ("reward-not-callable", None, ["reward.math:pi=1"], "reward 'math:pi' must be a function of (images, prompts)"),
    ("reward-wrong-arguments", None, ["reward.os:getcwd=1"], "reward 'os:getcwd' must be a function"),
    ("reward-not-importable", None, ["reward.no_such_module_here:f=1"], "cannot be imported"),
    ("lm-micro-batches", None, ["kind=lm", "algo.micro_batches=3"], "algo.micro_batches"),
    ("multiplex-not-a-list", "kind: multiplex\npipelines: sort\n", [], "pipelines"),
    ("multiplex-five-pipelines", FIVE_PIPELINES, [], "pipelines: List should have at most 4 items"),
    (
        "multiplex-cluster-unknown-key",
        "kind: multiplex\npipelines:\n  - {kind: lm, cluster: {devices: 2, gpus: 2}}\n",
        [],
        "pipelines.0.cluster.gpus: Extra inputs are not permitted",
    ),
    (
        "duplicate-key",
        "train:\n  lr: 1e-3\n  steps: 3\n  lr: 1e-4\n",
        [],
        "bad.yaml:4:3: invalid YAML: duplicate key 'lr', also on line 2",
    ),
    ("duplicate-key-one-line", "train: {lr: 1e-3, lr: 1e-4}\n", [], "duplicate key 'lr'"),
    (
        "lm-temperature-underflow",
        None,
        ["kind=lm", "sampling.temperature=1e-300"],
        "sampling.temperature: 1e-300 is below 1e-30",
    ),
    ("noise-level-underflow", None, ["sampling.noise_level=1e-300"], "sampling.noise_level"),
    ("lm-engine-unknown", None, ["kind=lm", "sampling.engine=sglang"], "sampling.engine"),
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


KIND_CASES = [
    ("kind-10000-chars", None, ["kind=" + "x" * 10_000], "kind: 'xxxx"),
    (
        "multiplex-kind-10000-chars",
        yaml.safe_dump({"kind": "multiplex", "pipelines": [{"kind": "x" * 10_000}]}),
        [],
        "pipelines.0: kind 'xxxx",
    ),
    ("multiplex-kind-unknown", "kind: multiplex\npipelines: [{kind: flux}]\n", [], "kind 'flux' is not one of"),
    ("multiplex-kind-number", "kind: multiplex\npipelines: [{kind: 5}]\n", [], "kind must name the entry's kind"),
]
"""A kind that is no kind, at the top or in a multiplexed entry, where pydantic's own message would echo it whole
and name the function that reads it."""


@pytest.mark.parametrize(("text", "arguments", "names"), [c[1:] for c in KIND_CASES], ids=[c[0] for c in KIND_CASES])
def test_a_bad_kind_is_clipped_and_names_no_internal_function(tmp_path, text, arguments, names):
    result, out = invoke_train(tmp_path, text, arguments, "--dry-run")
    assert_one_line(result, names)
    assert len(result.stderr) < 250 and "()" not in result.stderr, result.stderr[:300]
    assert not out.exists()


def test_a_scenario_pipelines_bad_kind_is_clipped_and_names_no_internal_function(tmp_path):
    scenario = load_scenario(next(iter(list_scenarios()))).model_dump(mode="json", exclude_none=True)
    scenario["pipelines"][0]["kind"] = "x" * 10_000
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(scenario))
    result = runner.invoke(app, ["simulate", str(tmp_path / "bad.yaml")])
    assert_one_line(result, "pipelines.0: kind 'xxxx")
    assert len(result.stderr) < 250 and "()" not in result.stderr, result.stderr[:300]


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


@pytest.mark.parametrize(
    ("base", "changes", "names"),
    [
        # what the run config refuses, a scenario refuses by the same rule
        ("digen-flux-16", {"pipelines": [{"group": 1}]}, "pipelines.0.flow.group"),
        ("digen-flux-16", {"pipelines": [{"name": ""}]}, "pipelines.0.flow.name"),
        ("jigsaw-qwen3-4b-8xh100", {"pipelines": [{"group": 1}]}, "pipelines.0.lm.group"),
        ("jigsaw-qwen3-4b-8xh100", {"pipelines": [{"length_bands": [0]}]}, "length_bands=[0, 2048, 4096] must be"),
        ("jigsaw-qwen3-4b-8xh100", {"pipelines": [{"max_length": 4096}]}, "between 1 and max_length - 1 = 4095"),
    ],
)
def test_a_scenario_is_held_to_the_run_config_s_rules(tmp_path, base, changes, names):
    target = tmp_path / "bad.yaml"
    target.write_text(yaml.safe_dump(merged(load_scenario(base).model_dump(mode="json"), changes)))
    assert_one_line(runner.invoke(app, ["simulate", str(target), "--steps", "1"]), names)


def test_the_run_config_refuses_what_the_scenario_refuses():
    for override, field in (("algo.group_size=1", "algo.group_size"), ("name=''", "name")):
        with pytest.raises(ConfigError, match=field):
            load_config(None, ["kind=lm", override])


@pytest.mark.parametrize(("flag", "several"), [("--gantt", False), ("--trace", True)])
def test_a_directory_for_a_simulation_s_output_is_refused_and_nothing_is_written_beside_it(tmp_path, flag, several):
    folder = tmp_path / "out"
    folder.mkdir()
    policies = ["--policies", "colocated,digen"] if several else []
    result = runner.invoke(app, ["simulate", "digen-flux-16", "--steps", "1", *policies, flag, str(folder)])
    assert_one_line(result, f"{flag} {folder}: is a directory")
    assert list(tmp_path.iterdir()) == [folder] and not any(folder.iterdir())


def test_a_long_report_is_cut_with_a_count_of_the_rest(tmp_path):
    text = "train:\n" + "".join(f"  unknown_{i}: 1\n" for i in range(80))
    result, out = invoke_train(tmp_path, text, [], "--dry-run")
    lines = result.stderr.splitlines()
    assert result.exit_code == 2 and not out.exists()
    assert lines[0] == "invalid config:" and len(lines) == 52, lines[:3]
    assert lines[1].strip().startswith("train.unknown_0: Extra inputs") and lines[-1].strip() == "... and 30 more"


# --- files a run reads: a checkpoint, a FIFO ---------------------------------------------------------------------


@pytest.fixture
def fails_rather_than_hangs():
    """Opening a FIFO for reading waits for a writer: a regression fails here after a while instead of hanging."""

    def expire(signum, frame):
        raise TimeoutError("blocked reading a FIFO")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def copied_checkpoint(tmp_path, name: str) -> Path:
    directory = tmp_path / name
    shutil.copytree(ASSETS / name, directory)
    return directory


WIDER_ALPHABET = json.dumps({"alphabet": DEFAULT_ALPHABET + "ABC"})


@pytest.mark.parametrize(
    ("file", "content", "names"),
    [
        ("tokenizer.json", "{}", "tokenizer.json is not a tokenizer: give the one saved with the model"),
        ("tokenizer.json", "[]", "tokenizer.json is not a tokenizer"),
        ("tokenizer.json", '{"alphabet": 5}', "tokenizer.json is not a tokenizer"),
        ("tokenizer.json", "directory", "tokenizer.json: is a directory; give a file holding"),
        ("tokenizer.json", "fifo", "tokenizer.json: not a regular file"),
        ("tokenizer.json", None, "holds a model but no tokenizer.json: copy in what was saved with that model"),
        ("tokenizer.json", WIDER_ALPHABET, "tokenizer.json has 56 tokens and the model"),
        ("config.json", "fifo", "config.json: not a regular file"),
        ("config.json", "sort -> arithmetic", "is a model of task 'arithmetic', not task=sort: set task=arithmetic"),
    ],
    ids=["empty", "list", "number", "directory", "fifo", "missing", "wider", "config-fifo", "other-task"],
)
def test_a_bad_lm_checkpoint_is_refused_by_the_reference_dry_run(
    tmp_path, fails_rather_than_hangs, file, content, names
):
    """What the run would crash on (or hang on, or train the wrong model with) is refused before it starts, with a
    fix that keeps the user's model: never `pretrain --out` over it."""
    checkpoint = copied_checkpoint(tmp_path, "sort-lm")
    target = checkpoint / file
    if content == "sort -> arithmetic":
        target.write_text(target.read_text().replace('"sort"', '"arithmetic"'))
    elif content in ("directory", "fifo", None):
        target.unlink()
        {"directory": target.mkdir, "fifo": lambda: os.mkfifo(target), None: lambda: None}[content]()
    else:
        target.write_text(content)
    before = sorted(p.name for p in checkpoint.iterdir())
    result, out = invoke_train(tmp_path, None, ["kind=lm", f"model.checkpoint={checkpoint}"], "--dry-run")
    assert_one_line(result, names)
    assert f"--out {checkpoint}" not in result.stderr  # pretraining into it would overwrite the model
    assert not out.exists() and sorted(p.name for p in checkpoint.iterdir()) == before


def test_a_fifo_as_the_config_is_refused(tmp_path, fails_rather_than_hangs):
    os.mkfifo(tmp_path / "config.yaml")
    result = runner.invoke(app, ["train", str(tmp_path / "config.yaml"), "--dry-run", "--out", str(tmp_path / "run")])
    assert_one_line(result, "config.yaml: not a regular file (a FIFO, socket or device); give a YAML file")


@pytest.mark.parametrize(
    ("arguments", "names"),
    [
        (["kind=lm", "sampling.max_new_tokens=120"], "exceed the model's context of 128 tokens"),
        (["model.checkpoint={truncated}"], "cannot load {truncated}/model.safetensors"),
        pytest.param(
            ["kind=lm", "sampling.engine=vllm"],
            "sampling.engine=vllm: this environment has no vLLM",
            marks=pytest.mark.skipif(find_spec("vllm") is not None, reason="this environment has vLLM"),
        ),
    ],
    ids=["lm-context", "flow-truncated", "lm-no-vllm"],
)
def test_the_reference_dry_run_checks_what_the_run_meets_as_it_starts(tmp_path, arguments, names):
    truncated = copied_checkpoint(tmp_path, "digits-t2i")
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    arguments = [argument.format(truncated=truncated) for argument in arguments]
    result, out = invoke_train(tmp_path, None, [*arguments, "policy=reference"], "--dry-run")
    assert_one_line(result, names.format(truncated=truncated))
    assert not out.exists()


@pytest.mark.parametrize(
    ("arguments", "names"),
    [
        (["sampling.max_new_tokens=120"], "exceed the model's context of 128 tokens"),
        (["model.checkpoint={wider}"], "tokenizer.json has 56 tokens and the model"),
    ],
    ids=["context", "wider-tokenizer"],
)
def test_the_run_refuses_what_the_dry_run_refuses_before_writing_anything(tmp_path, arguments, names):
    wider = copied_checkpoint(tmp_path, "sort-lm")
    (wider / "tokenizer.json").write_text(WIDER_ALPHABET)
    arguments = [argument.format(wider=wider) for argument in arguments]
    result, out = invoke_train(tmp_path, None, ["kind=lm", *arguments], "--steps", "1")
    assert_one_line(result, names)
    assert not out.exists()


# --- simulate --from-run on a damaged run profile ----------------------------------------------------------------


@pytest.fixture(scope="module")
def run_profile() -> dict:
    """A run profile as a 2-step colocated run of the digits model writes it (its measurements made up)."""
    config = load_config(None, ["policy=colocated", "algo.prompts_per_step=2", "algo.group_size=2"])
    prepared = prepare(config.scenario(2), config.policy, steps=2)
    return {
        "config": config.model_dump(mode="json"),
        "steps": 2,
        "shapes": {name: asdict(shape) for name, shape in prepared.setup.shapes.items()},
        "node_seconds": {node.id: [0.01, [0]] for node in prepared.graph if node.cost_s > 0},
        "switch_seconds": [0.001],
        "calibration": {"digits": {}},
        "measured_step_time_s": 0.5,
    }


def shape_with(profile: dict, **fields) -> dict:
    return {"digits": profile["shapes"]["digits"] | fields}


PROFILE_DAMAGE = {
    "cut-short": (lambda p: json.dumps(p)[:100], "Invalid JSON"),
    "no-shapes": (lambda p: {k: v for k, v in p.items() if k != "shapes"}, "shapes: Field required"),
    "steps-a-string": (lambda p: p | {"steps": "2"}, "steps: Input should be a valid integer"),
    "another-pipeline": (lambda p: p | {"shapes": {"other": p["shapes"]["digits"]}}, "shapes: pipelines ['other']"),
    "shape-field-type": (lambda p: p | {"shapes": shape_with(p, fragments="x")}, "shapes.digits.fragments"),
    "shape-unknown-field": (lambda p: p | {"shapes": shape_with(p, bogus=1)}, "shapes.digits.bogus"),
    "calibration-unknown-field": (lambda p: p | {"calibration": {"digits": {"bogus": 1}}}, "calibration.digits.bogus"),
    "calibration-type": (lambda p: p | {"calibration": {"digits": {"train_mfu": "x"}}}, "calibration.digits.train_mfu"),
    "device-out-of-range": (
        lambda p: p | {"node_seconds": {node: [0.01, [7]] for node in p["node_seconds"]}},
        "devices [7] in a 2-device run",
    ),
    "no-step-time": (lambda p: p | {"measured_step_time_s": 0}, "measured_step_time_s: Input should be greater"),
}


def test_the_made_up_run_profile_replays(tmp_path, run_profile):
    (tmp_path / "run_profile.json").write_text(json.dumps(run_profile))
    result = runner.invoke(app, ["simulate", "--from-run", str(tmp_path)])
    assert result.exit_code == 0 and "colocated over 2 steps" in result.stdout, result.output


@pytest.mark.parametrize("damage", list(PROFILE_DAMAGE))
def test_a_damaged_run_profile_is_one_line_naming_the_field(tmp_path, run_profile, damage):
    damaged, names = PROFILE_DAMAGE[damage]
    written = damaged(json.loads(json.dumps(run_profile)))
    (tmp_path / "run_profile.json").write_text(written if isinstance(written, str) else json.dumps(written))
    result = runner.invoke(app, ["simulate", "--from-run", str(tmp_path)])
    assert_one_line(result, f"{tmp_path / 'run_profile.json'} is damaged (rerun `dovetail train`")
    assert names in result.stderr, result.stderr


# --- a valid tree with one node replaced by a bad value parses, or names its fields -----------------

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


def every_mutation(valid: list) -> list:
    """Each valid tree with one node replaced by each bad value: all of them (a few thousand parse in a second),
    so no run depends on which a random draw picked (a draw once found a too-long path on CI alone)."""
    return [replaced(tree, path, value) for tree in valid for path in paths(tree) for value in BAD_VALUES]


def test_a_mutated_config_parses_or_names_each_bad_field():
    for tree in every_mutation(VALID_CONFIGS):
        try:
            config = parse_config(tree)
        except ConfigError as error:
            for line in problem_lines(str(error), "invalid config"):
                assert names_a_field(line, RUN_FIELDS), line
                assert len(line) <= LONGEST_LINE, line[:200]
            continue
        config.scenario(3)  # what the config accepts, the planner accepts


SHIPPED_SCENARIOS = [load_scenario(name).model_dump(mode="json") for name in list_scenarios()]


def test_a_mutated_scenario_parses_or_names_each_bad_field():
    for tree in every_mutation(SHIPPED_SCENARIOS):
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


def test_replaying_or_exporting_a_run_directory_imports_none_of_its_rewards(tmp_path, run_profile, marking_reward):
    """Neither scores anything, so reading a run directory someone else wrote runs none of its code."""
    run = tmp_path / "run"
    run.mkdir()
    foreign = run_profile | {"config": run_profile["config"] | {"reward": {"marking_reward:score": 1.0}}}
    (run / "run_profile.json").write_text(json.dumps(foreign))
    result = runner.invoke(app, ["simulate", "--from-run", str(run)])
    assert result.exit_code == 0 and "colocated over 2 steps" in result.stdout, result.output
    (run / "config.yaml").write_text(yaml.safe_dump(foreign["config"]))
    assert_one_line(runner.invoke(app, ["export", str(run), str(tmp_path / "export")]), "trained no model.path")
    assert not marking_reward.exists()


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
