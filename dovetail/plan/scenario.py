"""Scenarios: a cluster, one or more RL pipelines sharing it, and how to schedule them — in YAML.

Shipped scenarios live in `dovetail/scenarios/*.yaml`; `load_scenario` takes a shipped name or a path.
"""

from __future__ import annotations

import re
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dovetail.cost.catalog import Device
from dovetail.cost.catalog import device as lookup_device
from dovetail.files import read_text
from dovetail.graph.spec import MAX_DEVICES, FlowSpec, LMSpec
from dovetail.sched import POLICIES

MAX_SIMULATED_STEPS = 1000
"""RL steps one simulation runs: a step of a large scenario takes the simulator up to a second or so."""


class _Model(BaseModel):
    """Strict (`true` is not the number 1, "3" not 3) and finite: what a scenario file says is what is planned."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ClusterSpec(_Model):
    device: str = Field(
        max_length=100,
        description="Device from the catalogue: H100, H800, H200, A100-80G, A100-40G, L40S, Ascend-910B, cpu-core.",
    )
    devices: int = Field(gt=0, le=MAX_DEVICES, description="Number of devices in the pool.")
    network_gbps: float | None = Field(
        None,
        gt=0,
        le=100_000,
        description="Network bandwidth per device in Gb/s (its share of its node's NICs) where the cluster's differs "
        "from the catalogue device's reference node; None: the catalogue's.",
    )

    @field_validator("device")
    @classmethod
    def _known_device(cls, name: str) -> str:
        lookup_device(name)
        return name

    def catalogue_device(self) -> Device:
        """The catalogue's device, with this cluster's network where it names one."""
        found = lookup_device(self.device)
        return found if self.network_gbps is None else replace(found, network_bandwidth=self.network_gbps * 1e9 / 8)


class ScheduleSpec(_Model):
    steps: int = Field(
        3, gt=0, le=MAX_SIMULATED_STEPS, description=f"RL steps to simulate (at most {MAX_SIMULATED_STEPS})."
    )
    policies: list[str] = Field(
        min_length=1,
        max_length=32,
        description="Policies to compare (see `dovetail.sched.POLICIES`); the first is the baseline of speedups.",
    )
    trainer_devices: int | None = Field(
        None, gt=0, le=MAX_DEVICES, description="Trainer pool size of disaggregated policies; None lets them choose."
    )
    reward_devices: int = Field(
        0,
        ge=0,
        le=MAX_DEVICES,
        description="Devices that only score (flow policies); 0: reward engines share the rollout devices.",
    )
    seed: int = Field(0, ge=0, lt=2**63, description="Seed of the simulated durations' noise.")
    noise: float = Field(
        0.0,
        ge=0,
        le=3,
        description="Log-normal sigma of simulated durations (0: exactly the predicted costs; at most 3, a spread "
        "of e^3 = 20x per sigma).",
    )

    @field_validator("policies")
    @classmethod
    def _known_policies(cls, names: list[str]) -> list[str]:
        unknown = [clip(name, 40) for name in names if name not in POLICIES]
        if unknown:
            raise ValueError(f"unknown policies {unknown}; choose among {', '.join(sorted(POLICIES))}")
        return names


class PublishedShape(_Model):
    """What the published run's recipe fixed that a policy would otherwise choose: reproducing the run applies it."""

    trainer_group: int | None = Field(
        None,
        gt=0,
        le=MAX_DEVICES,
        description="Devices of one FSDP group (verl's fsdp_config.fsdp_size; the recipes' default -1 is the whole "
        "pool).",
    )


class PublishedRun(_Model):
    """A published measurement a calibration scenario reproduces."""

    source: str
    step_time_s: float = Field(gt=0)
    held_out: bool = Field(
        False,
        description="true: no calibration factor was fitted to this run (a check, within 20 %); false: the cost "
        "model's free parameters were fitted to it (within 10 %).",
    )
    figure: Literal["measured", "approximate", "upper_bound"] = Field(
        "measured",
        description="What the source's number is: a measured step (held to the bound of `held_out`), a rounded "
        'remark ("about 8 minutes": reported beside the others, no bound), or an upper bound ("within 12 hours": '
        "the simulated step must not pass it by more than the bound).",
    )
    phases_s: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict, description="Published seconds per phase (generate, logprob, train, publish...)."
    )
    device_assumption: str = Field(
        "",
        max_length=400,
        description="Where `cluster.device` comes from: the source's own device, or what was assumed and why (a "
        "device chosen after seeing the figure makes the run a fitted point, `held_out: false`).",
    )
    network_assumption: str = Field(
        "",
        max_length=400,
        description="Where the cluster's network comes from: none crossed, the catalogue's NICs and why they are "
        "the source's, or `cluster.network_gbps` fitted to the run.",
    )
    shape: PublishedShape = Field(
        default_factory=PublishedShape, description="Settings of the published run's recipe, applied to reproduce it."
    )


class Scenario(_Model):
    name: str = Field(max_length=100)
    description: str = ""
    cluster: ClusterSpec
    pipelines: list[Annotated[FlowSpec | LMSpec, Field(discriminator="kind")]] = Field(min_length=1, max_length=16)
    schedule: ScheduleSpec
    published: PublishedRun | None = None

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        names = [p.name for p in self.pipelines]
        if len(set(names)) != len(names):
            raise ValueError(f"pipelines: names must be unique, got {names}")
        for index, spec in enumerate(self.pipelines):
            try:
                spec.catalogue_model()
            except ValueError as error:
                raise ValueError(f"pipelines.{index}.model: {error}") from None
        check_pools(self.cluster.devices, self.schedule.trainer_devices, self.schedule.reward_devices, "schedule")
        return self


def check_pools(devices: int, trainer_devices: int | None, reward_devices: int, section: str) -> None:
    """The pools by role fit the cluster: the reward pool leaves devices to generate and train, a trainer pool
    leaves at least one rollout device. One check for scenarios and run configs; `section` names the fields."""
    if reward_devices >= devices:
        raise ValueError(
            f"{section}.reward_devices={reward_devices} must leave devices to generate and train of "
            f"cluster.devices={devices}: lower it or add devices"
        )
    if trainer_devices is not None and trainer_devices + reward_devices >= devices:
        raise ValueError(
            f"{section}.trainer_devices={trainer_devices} must leave at least one rollout device of "
            f"cluster.devices={devices}"
            + (f" after {section}.reward_devices={reward_devices}" if reward_devices else "")
        )


def _shipped() -> dict[str, Path]:
    folder = resources.files("dovetail") / "scenarios"
    return {Path(str(p)).stem: Path(str(p)) for p in folder.iterdir() if str(p).endswith(".yaml")}


def list_scenarios() -> dict[str, str]:
    """Shipped scenario names -> their one-line description."""
    return {name: load_scenario(name).description.strip().splitlines()[0] for name in sorted(_shipped())}


def parse_scenario(data: Any, origin: str = "scenario") -> Scenario:
    """Validate a scenario dict; errors name the field (dotted path) and what is wrong with it, one line for a
    single problem, one line each under a heading for several."""
    if not isinstance(data, dict):
        raise ValueError(f"{origin}: a scenario is a mapping with cluster, pipelines and schedule")
    try:
        return Scenario.model_validate(data)
    except ValidationError as error:
        raise ValueError(problem_report(f"{origin}: invalid scenario", problem_lines(error))) from None


def load_scenario(name_or_path: str | Path) -> Scenario:
    shipped = _shipped()
    path = shipped.get(str(name_or_path), Path(name_or_path))
    if not path.exists():
        raise ValueError(
            f"no scenario {clip(str(name_or_path))!r}: give a YAML path or one of {', '.join(sorted(shipped))}"
        )
    return parse_scenario(read_yaml(path), str(path))


def clip(text: str, limit: int = 80) -> str:
    """text cut to `limit` characters: an error line shows what it refuses, never megabytes of it."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def problem_lines(error: ValidationError, hidden: tuple[str, ...] = (), within: tuple[str, ...] = ()) -> list[str]:
    """One "field: what is wrong (got value)" per problem of a validation, the field a dotted path (its parts in
    `hidden` left out; `within`: the path of what was validated, for a section validated alone); a check across
    fields (a value error) names its fields in its own words."""
    lines = []
    for problem in error.errors():
        field = clip(".".join(str(part) for part in (*within, *problem["loc"]) if part not in hidden))
        line = clip(problem["msg"].removeprefix("Value error, "), 300)  # some echo their input
        if problem["type"] == "union_tag_invalid":  # pydantic's own words echo the whole tag and its finder
            line = f"kind {clip(repr(problem['ctx']['tag']))} is not one of {problem['ctx']['expected_tags']}"
        elif problem["type"] == "union_tag_not_found":
            line = f"kind must name the entry's kind, e.g. kind: flow (got {clip(repr(problem['input']))})"
        elif problem["type"] not in ("value_error", "missing"):  # they say what they got, or got nothing
            line += f" (got {clip(repr(problem['input']))})"
        lines.append(f"{field}: {line}" if field else line)
    return lines


MAX_REPORTED = 50
"""Problems a report lists; the rest are counted: a file wrong everywhere gets a screenful, not thousands of lines."""


def problem_report(heading: str, problems: list[str]) -> str:
    """One line for one problem; the heading and a line each for several, the first MAX_REPORTED of them."""
    if len(problems) == 1:
        return f"{heading}: {problems[0]}"
    lines = [f"  {problem}" for problem in problems[:MAX_REPORTED]]
    if len(problems) > MAX_REPORTED:
        lines.append(f"  ... and {len(problems) - MAX_REPORTED} more")
    return f"{heading}:\n" + "\n".join(lines)


class _Loader(yaml.SafeLoader):
    """`yaml.safe_load`'s loader (no tags that build Python objects) with three changes. It refuses aliases: `*name`
    repeats a node, so a few hundred bytes of nested aliases expand to gigabytes, and no config or scenario needs
    one. It refuses a key repeated in one mapping, which YAML libraries merge silently (the last wins, the other
    value is dropped unseen). And it reads YAML 1.2's floats: `1e-4` is a number, not the string YAML 1.1 makes of
    it."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not read: write the value out", self.peek_event().start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        first: dict[object, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` overrides by design
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                mark = first.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the base class says so
                break
            if mark is not key_node.start_mark:
                raise yaml.MarkedYAMLError(
                    problem=f"duplicate key {clip(repr(key))}, also on line {mark.line + 1}: keep one of them",
                    problem_mark=key_node.start_mark,
                )
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str, origin: str) -> Any:
    """YAML text's value, or a one-line ValueError saying where (`origin`:line:column) and what is wrong."""
    try:
        return yaml.load(text, _Loader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{origin}:{mark.line + 1}:{mark.column + 1}" if mark else origin
        fix = (
            "; only plain YAML values are read (no !!python or other tags)"
            if isinstance(error, yaml.constructor.ConstructorError)
            else ""
        )
        raise ValueError(f"{where}: invalid YAML: {error.problem or error.context}{fix}") from None
    except yaml.YAMLError as error:  # a character YAML does not allow
        raise ValueError(f"{origin}: invalid YAML: {' '.join(str(error).split())}") from None
    except ValueError as error:  # an integer of thousands of digits
        raise ValueError(f"{origin}: invalid YAML: {error}") from None
    except RecursionError:
        raise ValueError(f"{origin}: invalid YAML: nested too deeply") from None


def read_yaml(path: Path) -> Any:
    """A YAML file's value, or a one-line ValueError naming the file and what to fix: every way a config or
    scenario file can be unreadable ends here, never in a traceback (or a hang: `files.read_text`)."""
    return parse_yaml(read_text(path, "a YAML file"), str(path))
