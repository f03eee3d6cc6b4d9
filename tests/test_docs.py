"""The documentation holds what a reader needs and stays true to the code: the README's first screen, its
references to other files, and docs/scenarios.md against the scenario schema."""

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from dovetail.graph.spec import FlowSpec, LengthDistribution, LMSpec, LoRASpec, ModelShape
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

SECTIONS = {
    "The file": Scenario,
    "`cluster`": ClusterSpec,
    "`schedule`": ScheduleSpec,
    "`pipelines`: `kind: flow`": FlowSpec,
    "`pipelines`: `kind: lm`": LMSpec,
    "`lora` (either kind)": LoRASpec,
    "`lengths` (`kind: lm`)": LengthDistribution,
    "`architecture` (`kind: lm`)": ModelShape,
    "`published`": PublishedRun,
    "`published.shape`": PublishedShape,
}
"""docs/scenarios.md's section headings and the schema each documents."""


def test_the_readme_opens_with_the_two_commands_then_says_what_runs_today_and_how_to_get_dovetail_on_the_path():
    first_block = README.split("```bash\n")[1].split("```")[0].splitlines()
    assert [line.split()[:2] for line in first_block] == [["make", "demo"], ["make", "test"]]
    first_screen = "\n".join(README.splitlines()[:25])
    for said in ("source .venv/bin/activate", "CPU, tiny models", "checked on one H200", "local directories only"):
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
