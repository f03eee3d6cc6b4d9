"""Every pipeline kind is whole in its registry record (`dovetail.kinds`), and what differs by kind derives from it:
the schemas a config is read with, the policies a run may take, the `--policy` help."""

import ast
import inspect
import re
from pathlib import Path
from typing import get_args

import pytest
from typer.testing import CliRunner

from dovetail.cli import app
from dovetail.config.common import ConfigError, RunSection, policies_for, scheduling_policies
from dovetail.config.load import load_config, parse_config
from dovetail.graph.node import Kind
from dovetail.kinds import DEFAULT_KIND, KINDS
from dovetail.runtime.launch import AUTO_TIE, chosen_policy
from dovetail.runtime.pipeline import PipelineAdapter, PipelineEngines
from dovetail.sched import POLICIES, policy_class


@pytest.mark.parametrize("name", list(KINDS))
def test_a_kinds_record_names_parts_that_exist_and_agree_with_it(name):
    kind = KINDS[name]
    config, spec = kind.load("config"), kind.load("spec")
    assert issubclass(config, RunSection) and config.pipeline_kind() == name
    assert get_args(spec.model_fields["kind"].annotation) == (name,)
    assert issubclass(kind.load("adapter"), PipelineAdapter) and issubclass(kind.load("engines"), PipelineEngines)
    assert not inspect.isabstract(kind.load("adapter")) and not inspect.isabstract(kind.load("engines"))
    for part in ("profile", "fit", "check_checkpoint", "local"):
        assert callable(kind.load(part)), part
    assert {Kind(k) for k in kind.interference} and {Kind(k) for k in kind.creates_samples}
    assert name in policy_class(kind.staged_baseline).pipeline_kinds


def test_every_policy_schedules_registered_kinds_and_every_kind_has_a_policy():
    for name in POLICIES:
        assert policy_class(name).pipeline_kinds <= KINDS.keys(), name
    for name in KINDS:
        assert len(policies_for(name)) > 1, name


@pytest.mark.parametrize("name", list(KINDS))
def test_a_config_takes_exactly_the_policies_of_its_kind(name):
    tree = {} if name == DEFAULT_KIND else {"kind": name}
    for policy in ["reference", *POLICIES]:
        schedules = policy == "reference" or name in policy_class(policy).pipeline_kinds
        if schedules:
            assert parse_config(tree | {"policy": policy}).policy == policy
        else:
            with pytest.raises(ConfigError, match=re.escape(f"policy: '{policy}' is not a policy of a {name} run")):
                parse_config(tree | {"policy": policy})


def test_a_tuned_baseline_of_the_docs_is_accepted_by_train_and_dry_runs():
    assert load_config("configs/digits.yaml", ["policy=colocated-hsdp"]).policy == "colocated-hsdp"
    result = CliRunner().invoke(app, ["train", "configs/digits.yaml", "policy=colocated-hsdp", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "policy colocated-hsdp" in result.output


def test_the_policy_help_lists_every_policy_of_every_kind():
    result = CliRunner().invoke(app, ["train", "--help"], terminal_width=400)
    text = " ".join(result.output.replace("│", " ").split())
    for name in KINDS:
        assert f"{name}: {', '.join(policies_for(name))}" in text


def test_no_module_outside_the_registry_branches_on_a_pipeline_kind():
    """A comparison with a kind's name (`config.kind == "flow"`) is a table kept by hand: what differs by kind is a
    part of its record. The kind's own schema and spec may name it (their `kind` field); nothing may compare it."""
    package = Path(__file__).resolve().parent.parent / "dovetail"
    branches = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                named = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in KINDS]
                branches += [f"{path.relative_to(package)}:{node.lineno} compares with {name!r}" for name in named]
    assert branches == []


def test_policy_auto_dry_runs_and_names_the_fastest_predicted_policy_of_the_kind():
    """On GPUs the dry run plans with the catalogue's costs: every flow policy is weighed, the one auto names is the
    fastest within AUTO_TIE (the first such in the registry's order), and the plan below it is that policy's."""
    config = load_config("configs/digits.yaml", ["policy=auto", "cluster.device=H100", "cluster.devices=8"])
    choice = chosen_policy(config, 3, None)
    assert set(choice.predicted) | set(choice.refused) == set(scheduling_policies("flow"))
    fastest = max(choice.predicted.values())
    assert choice.policy == next(p for p, rate in choice.predicted.items() if rate >= (1 - AUTO_TIE) * fastest)
    result = CliRunner().invoke(app, ["train", "configs/digits.yaml", "policy=auto", "--dry-run"])
    assert result.exit_code == 0, result.output
    first, second = result.output.splitlines()[:2]
    assert first.startswith("policy auto: ") and second.startswith(f"policy {first.split()[2].rstrip(',')} on 2x")


def test_policy_auto_skips_a_policy_the_config_rules_out_and_says_why():
    config = load_config("configs/digits.yaml", ["policy=auto", "runtime.trainer_devices=1"])
    choice = chosen_policy(config, 3, None)
    fixing = {name for name in scheduling_policies("flow") if "trainer_devices" in policy_class(name).fixes}
    assert fixing and set(choice.refused) >= fixing and choice.policy not in fixing
    assert all("trainer_devices" in choice.refused[name] for name in fixing)
