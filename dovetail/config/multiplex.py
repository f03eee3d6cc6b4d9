"""The config of several RL pipelines multiplexed on one pool of devices (`kind: multiplex`): each entry a run config
of a registered pipeline kind (`dovetail.kinds`), the run's policy, cluster and steps shared by every entry."""

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from dovetail.config.common import (
    AUTO,
    MAX_PIPELINES,
    MAX_STEPS,
    ClusterSection,
    RunSection,
    Section,
    invalid,
    multiplexing_policies,
    planner_scenario,
)
from dovetail.kinds import DEFAULT_KIND, KINDS
from dovetail.plan.scenario import Scenario, clip, problem_lines
from dovetail.sched.policy import MAX_STALENESS, Arrangement, PolicyOptions


def _kind_of(entry) -> str | None:
    """The entry's tag; None (an error naming the entry) for a kind that is not even a string."""
    kind = entry.get("kind", DEFAULT_KIND) if isinstance(entry, dict) else entry.kind
    return kind if isinstance(kind, str) else None


if TYPE_CHECKING:
    # The union below is built from the kind registry at import time, which the checker cannot evaluate; every
    # registered kind's config schema is a RunSection (`PipelineKind.config`), which is what callers may rely on.
    PipelineConfig = RunSection
else:
    PipelineConfig = Annotated[
        Union[tuple(Annotated[kind.load("config"), Tag(name)] for name, kind in KINDS.items())],  # noqa: UP007
        Discriminator(_kind_of),
    ]
"""One pipeline's run config: the schema of its `kind` (`flow`, the default, or `lm`)."""


class MultiplexTrainSection(Section):
    steps: int = Field(50, ge=1, le=MAX_STEPS, description="RL steps of every pipeline")


class MultiplexConfig(Section):
    """Several RL pipelines multiplexed on one pool of devices (JigsawRL). Each entry of `pipelines` is a flow or lm
    run config of its own — model, algorithm, reward, prompts, batch, optimizer, eval, checkpoints, `name`,
    `priority` — and trains its own weights into its own run sub-directory; the cluster, the policy and the number
    of steps are the run's (an entry may repeat them, not change them)."""

    kind: Literal["multiplex"]
    policy: str = Field(
        "jigsaw", description="a policy that multiplexes pipelines, or auto: `dovetail train --help` lists them"
    )
    arrangement: Arrangement = Field(
        "auto",
        description="how jigsaw arranges the pipelines on the pool: shared (every pipeline on the whole pool at once), "
        "split (each on a sub-pool of its own), back_to_back (one after another on the whole pool), or auto (the "
        "fastest its simulator predicts on the costs the run profiles)",
    )
    staleness: int = Field(
        0,
        ge=0,
        le=MAX_STALENESS,
        description="versions jigsaw lets a step's rollouts lag its training: 0 keeps every step on-policy (each "
        "pipeline's parameters are its reference run's); above, a pipeline's next step opens on the latest published "
        "weights once its step's rollout has begun, at most this many versions behind, so the next steps roll out "
        "while a step trains (1: streamrl's bound; areal's default is 4); a stale step trains with the decoupled PPO "
        "objective areal's does",
    )
    train: MultiplexTrainSection = MultiplexTrainSection()
    cluster: ClusterSection = ClusterSection()
    pipelines: list[PipelineConfig] = Field(
        min_length=1, max_length=MAX_PIPELINES, description="the pipelines; split more over several runs"
    )

    @field_validator("policy")
    @classmethod
    def _multiplexes(cls, policy: str) -> str:
        if policy != AUTO and policy not in multiplexing_policies():
            choices = [AUTO, *multiplexing_policies()]
            raise ValueError(f"{clip(repr(policy))} does not multiplex pipelines; use one of {choices}")
        return policy

    @model_validator(mode="after")
    def _arranged_by_jigsaw(self) -> "MultiplexConfig":
        if self.arrangement != "auto" and self.policy != "jigsaw":
            raise ValueError(
                f"arrangement={self.arrangement}: only policy jigsaw arranges the pipelines (policy is {self.policy}); "
                "set policy: jigsaw, or arrangement: auto"
            )
        if self.staleness and self.policy != "jigsaw":
            raise ValueError(
                f"staleness={self.staleness}: only policy jigsaw takes it (policy is {self.policy}, whose staleness is "
                "its own); set policy: jigsaw, or staleness: 0"
            )
        if self.arrangement == "split" and len(self.pipelines) < 2:
            raise ValueError("arrangement=split: one pipeline has no pool to split; add a pipeline or use auto")
        return self

    @model_validator(mode="after")
    def _replicated_trainers(self) -> "MultiplexConfig":
        """Multiplexed pipelines share devices whose interference is timed per kind of work alone and side by side,
        the train pass among them; a sharded trainer's runs only with its whole group (docs/architecture.md)."""
        for index, pipeline in enumerate(self.pipelines):
            if pipeline.train.sharding != "replicate":
                raise ValueError(
                    f"pipelines.{index}.train.sharding={pipeline.train.sharding}: a multiplexed pipeline trains "
                    "replicated; set train.sharding: replicate, or run the pipeline alone"
                )
        return self

    @model_validator(mode="after")
    def _names_unique(self) -> "MultiplexConfig":
        names = [p.pipeline_name for p in self.pipelines]
        if len(set(names)) != len(names):
            raise ValueError(f"pipelines: names must be unique, got {names}; give each entry a `name`")
        return self

    def pipeline_configs(self) -> dict[str, PipelineConfig]:
        return {p.pipeline_name: p for p in self.pipelines}

    @property
    def compute_devices(self) -> int:
        return self.cluster.devices

    @property
    def pipeline_name(self) -> str:
        return "+".join(self.pipeline_configs())

    def scenario(self, steps: int) -> Scenario:
        """Every pipeline's own scenario pipeline on the run's cluster."""
        pipelines = [p.scenario(steps).pipelines[0].model_dump() for p in self.pipelines]
        return planner_scenario(self, pipelines, steps, None, 0)

    def shape_overrides(self) -> dict:
        return {}

    def policy_options(self) -> PolicyOptions:
        return PolicyOptions(arrangement=self.arrangement, staleness=self.staleness)


TrainConfig = RunSection | MultiplexConfig
"""One run's config: one pipeline's (the schema of a registered kind, `dovetail.kinds`), or `kind: multiplex`."""


def refined_by_profiles(config: TrainConfig, measured: Mapping[str, dict]) -> TrainConfig:
    """The run's config with each pipeline's scenario refined by its start-up profile (`RunSection.profiled`;
    `measured`: pipeline name -> what its profile measured)."""
    if isinstance(config, MultiplexConfig):
        pipelines = [p.profiled(measured[p.pipeline_name]) for p in config.pipelines]
        return config.model_copy(update={"pipelines": pipelines})
    return config.profiled(measured[config.pipeline_name])


def pipeline_configs(config: TrainConfig) -> dict[str, PipelineConfig]:
    """The run's pipelines by name: one for a flow or lm run, each entry of a multiplexed run."""
    if isinstance(config, MultiplexConfig):
        return config.pipeline_configs()
    return {config.pipeline_name: config}


RUN_WIDE = {"policy": "policy", "cluster": "cluster", "train.steps": "train.steps"}
"""What every pipeline of a multiplexed run shares: the run's (an entry may repeat it, not change it)."""


def multiplexed_tree(tree: dict) -> dict:
    """The run's policy, cluster and steps written into every pipeline entry (each is a whole pipeline config);
    an entry that says otherwise is an error naming the field, not silently overridden."""
    defaults = MultiplexConfig.model_fields
    train = _section(tree, "train", "train")
    run = {
        "policy": tree.get("policy", defaults["policy"].default),
        "cluster": tree.get("cluster", {}),
        "train.steps": train.get("steps", MultiplexTrainSection().steps),
    }
    cluster = _cluster(run["cluster"], "cluster")
    entries = tree.get("pipelines")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise invalid("pipelines: a list of pipeline configs (mappings, each kind flow or lm)")
    filled = []
    for index, entry in enumerate(entries):
        entry = {**entry, "train": dict(_section(entry, "train", f"pipelines.{index}.train"))}
        for field, value in run.items():
            section, _, leaf = field.partition(".")
            holder = entry["train"] if leaf else entry
            key = leaf or section
            differs = key in holder and (
                _cluster(holder[key], f"pipelines.{index}.cluster") != cluster
                if key == "cluster"
                else holder[key] != value
            )
            if differs:
                raise invalid(
                    f"pipelines.{index}.{field}: a multiplexed pipeline takes the run's {field} "
                    f"({clip(repr(value))}); set it at the top of the config"
                )
            holder[key] = value
        filled.append(entry)
    return {**tree, "pipelines": filled}


def _section(tree: dict, key: str, field: str) -> dict:
    """tree[key], a mapping ({} where it is absent)."""
    section = tree.get(key, {})
    if not isinstance(section, dict):
        raise invalid(f"{field}: a mapping of fields, e.g. {key}: {{steps: 50}} (got {clip(repr(section))})")
    return section


def _cluster(section: Any, field: str) -> ClusterSection:
    """A cluster section validated alone (an entry's may only repeat the run's, defaults filled in): what is wrong in
    it is named under `field`, not reported as a mismatch."""
    try:
        return ClusterSection.model_validate(section)
    except ValidationError as error:
        raise invalid(*problem_lines(error, within=(field,))) from None
