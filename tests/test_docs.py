"""The documentation holds what a reader needs and stays true to the code: the README's first screen, its
references to other files, and docs/scenarios.md against the scenario schema."""

import re
import typing
from importlib.util import find_spec
from pathlib import Path

import typer
from pydantic import BaseModel

from dovetail.cli import app
from dovetail.graph.latency import Latency
from dovetail.graph.spec import FlowSpec, LengthDistribution, LMSpec, LoRASpec, ModelShape, TurnsSpec
from dovetail.pipelines.lm.config import LMTrainConfig
from dovetail.plan.scenario import (
    ClusterSpec,
    PublishedRun,
    PublishedShape,
    Scenario,
    ScheduleSpec,
    parse_scenario,
    parse_yaml,
)

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
SCENARIOS = (ROOT / "docs" / "scenarios.md").read_text()
TRL = (ROOT / "docs" / "trl.md").read_text()

SECTIONS = {
    "The file": Scenario,
    "`cluster`": ClusterSpec,
    "`schedule`": ScheduleSpec,
    "`pipelines`: `kind: flow`": FlowSpec,
    "`pipelines`: `kind: lm`": LMSpec,
    "`lora` (either kind)": LoRASpec,
    "`lengths` (`kind: lm`)": LengthDistribution,
    "`turns` (`kind: lm`)": TurnsSpec,
    "`latency` (`turns.latency`)": Latency,
    "`architecture` (`kind: lm`)": ModelShape,
    "`published`": PublishedRun,
    "`published.shape`": PublishedShape,
}
"""docs/scenarios.md's section headings and the schema each documents."""


def test_the_readme_opens_with_the_two_commands_then_says_what_runs_today_and_how_to_get_dovetail_on_the_path():
    first_block = README.split("```bash\n")[1].split("```")[0].splitlines()
    assert [line.split()[:2] for line in first_block] == [["make", "demo"], ["make", "test"]]
    first_screen = "\n".join(README.splitlines()[:25])
    for said in ("source .venv/bin/activate", "CPU, tiny models", "checked on one H200", "local Hugging Face cache"):
        assert said in first_screen, said


def test_every_markdown_file_the_readme_and_docs_name_exists():
    for document in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for name in re.findall(r"[\w./-]+\.md\b", document.read_text()):
            assert (ROOT / name).is_file() or (document.parent / name).is_file(), f"{document.name} names {name}"
    assert "docs/scenarios.md" in README


def schema_models(model: type[BaseModel]) -> set[type[BaseModel]]:
    """`model` and every model its fields hold, however nested in lists, unions and annotations."""
    found = {model}

    def visit(annotation) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation not in found:
                found.update(schema_models(annotation))
            return
        for argument in typing.get_args(annotation):
            visit(argument)

    for field in model.model_fields.values():
        visit(field.annotation)
    return found


def test_docs_scenarios_documents_every_field_of_every_part_of_the_scenario_schema_and_no_other():
    assert set(SECTIONS.values()) == schema_models(Scenario)  # a new part of the schema needs a section
    sections = dict(re.findall(r"^## (.+)\n((?:(?!^## ).*\n)*)", SCENARIOS, flags=re.MULTILINE))
    for heading, model in SECTIONS.items():
        rows = re.findall(r"^\| (`[^|]+`) \|", sections[heading], flags=re.MULTILINE)
        documented = {name for row in rows for name in re.findall(r"`(\w+)`", row)}
        assert documented == set(model.model_fields), heading


def test_the_example_in_docs_scenarios_is_a_scenario():
    example = SCENARIOS.split("```yaml\n")[1].split("```")[0]
    assert parse_scenario(parse_yaml(example, "docs/scenarios.md")).pipelines[0].model == "FLUX.1-12B"


def schema_field(model: type[BaseModel], dotted: str):
    """The pydantic field at `dotted` (e.g. `train.lr`) of `model`, through nested (and optional) sections; None
    where there is none."""
    head, _, rest = dotted.partition(".")
    field = model.model_fields.get(head)
    if field is None or not rest:
        return field
    sections = [a for a in (field.annotation, *typing.get_args(field.annotation)) if isinstance(a, type)]
    inner = next((a for a in sections if issubclass(a, BaseModel)), None)
    return None if inner is None else schema_field(inner, rest)


def train_flags() -> set[str]:
    """The options `dovetail train` takes."""
    command = typing.cast(typing.Any, typer.main.get_command(app))
    return {flag for param in command.commands["train"].params for flag in param.opts if flag.startswith("--")}


def test_docs_trl_maps_the_grpo_config_fields_users_set_to_keys_the_lm_schema_has():
    rows = [row.split(" | ") for row in re.findall(r"^\| (.+) \|$", TRL, flags=re.MULTILINE)[2:]]
    assert rows and all(len(row) == 3 for row in rows)
    trl_fields = {name for row in rows for name in re.findall(r"`(\w+)`", row[0])}
    for field in ("learning_rate", "per_device_train_batch_size", "num_generations", "max_completion_length", "beta"):
        assert field in trl_fields, field
    for field in ("epsilon", "epsilon_high", "loss_type", "scale_rewards", "temperature", "top_p", "warmup_steps"):
        assert field in trl_fields, field
    for field in ("lr_scheduler_type", "num_iterations", "max_grad_norm", "logging_steps", "save_steps"):
        assert field in trl_fields, field
    assert {"reward_funcs", "reward_weights"} <= trl_fields
    flags = train_flags()
    named = 0
    for trl_field, dovetail, notes in rows:
        assert dovetail == "not supported" or re.fullmatch(r"`[^`]+`", dovetail), trl_field
        keys = re.findall(r"`([^`]+)`", dovetail) + [
            key for key in re.findall(r"`([a-z_]+\.[a-z_.]+(?:: \w+)?)`", notes) if key.split(".")[0] != "RUN_DIR"
        ]
        for key in keys:
            if key.startswith("--"):
                assert key in flags, f"{trl_field}: dovetail train has no {key}"
                continue
            dotted, _, value = key.partition(": ")
            field = schema_field(LMTrainConfig, dotted)
            assert field is not None, f"{trl_field}: the LM config has no key {dotted}"
            choices = typing.get_args(field.annotation)
            if value and typing.get_origin(field.annotation) is typing.Literal:
                assert value in choices, f"{trl_field}: {dotted} takes {choices}, not {value}"
            named += 1
    assert named >= 40


def test_docs_cluster_says_what_every_node_needs_and_ray_s_token_authentication_as_the_installed_ray_has_it():
    """The token's file, the variables and the command are Ray's own names (read from the installed Ray)."""
    from ray._private.authentication import authentication_token_setup as setup
    from ray._private.authentication_test_utils import _AUTH_ENV_VARS

    cluster = (ROOT / "docs" / "cluster.md").read_text()
    for said in ("The same environment on every node", "The same paths on every node", "only the driver writes it"):
        assert said in cluster, said
    assert f"{setup.AUTH_MODE_ENV_VAR}=token" in cluster and setup.AUTH_MODE_ENV_VAR in _AUTH_ENV_VARS
    for variable in _AUTH_ENV_VARS:
        assert f"`{variable}=" in cluster, variable
    assert "~/" + setup._get_default_token_path().relative_to(Path.home()).as_posix() in cluster
    scripts = Path(str(find_spec("ray.scripts.scripts").origin)).read_text()  # the ray CLI (importing it is slow)
    assert "ray get-auth-token --generate" in cluster and '@cli.command(name="get-auth-token")' in scripts
