"""The training run's typed config: YAML file plus dotted overrides, validated before any work.

One schema per run, chosen by `kind`: `flow` (a text-to-image flow model, the default), `lm` (a causal language
model on a verifiable task), or `multiplex` (several flow / lm pipelines sharing one pool of devices, each entry
of `pipelines` a flow or lm config of its own). Each derives the planner's scenario itself (`scenario(steps)`),
without torch, so the simulator, the dry run and the replay of a run plan from the very config that trains."""

import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from dovetail.cost.catalog import device
from dovetail.rewards import check_reward_names
from dovetail.rewards.text import text_reward_fn
from dovetail.scenario import Scenario, check_pools, parse_scenario
from dovetail.tasks import task

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = PACKAGE_ROOT / "assets" / "digits-t2i"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(Section):
    checkpoint: Path = Field(DEFAULT_CHECKPOINT, description="directory holding model.safetensors + config.json")


class SamplingSection(Section):
    num_steps: int = Field(10, ge=2, description="denoising steps K")
    noise_level: float | None = Field(
        None, gt=0, description="SDE noise: a of Flow-GRPO (default 1.0), constant eta of DanceGRPO (default 0.5)"
    )
    sde_kind: Literal["flow_grpo", "cps"] = Field("flow_grpo", description="SDE of algorithm flow_grpo")
    shift: float = Field(1.0, gt=0, description="sigma schedule shift of the flow-matching scheduler")


class AlgoSection(Section):
    prompts_per_step: int = Field(8, ge=1, description="B: prompts per step")
    group_size: int = Field(8, ge=2, description="G: samples per prompt")
    timestep_fraction: float = Field(0.5, gt=0, le=1, description="share of the K-1 trainable steps trained")
    clip_range: float = Field(1e-4, gt=0)
    beta: float = Field(0.0, ge=0, description="weight of the KL to the base model")
    std_scope: Literal["group", "global", "none"] = "group"
    adv_clip: float = Field(5.0, gt=0)
    stale_max_weight: float = Field(
        2.0, ge=1, description="truncation of pi_prox/pi_behaviour for TCSS's stale samples"
    )


class TrainSection(Section):
    steps: int = Field(200, ge=1)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)


class FlowTrainSection(TrainSection):
    chunk_size: int = Field(128, ge=1, description="(sample, timestep) pairs per batched forward/backward")


class EvalSection(Section):
    every: int = Field(25, ge=1, description="evaluate every N steps (and at the start and end)")
    per_digit: int = Field(8, ge=1, description="held-out ODE samples per digit")
    seed: int = 10_000


class CheckpointSection(Section):
    every: int = Field(50, ge=1, description="save every N steps (and at the end)")


class ClusterSection(Section):
    """Where the Ray runtime (every policy but `reference`) runs."""

    devices: int = Field(2, ge=1, description="devices (DeviceWorker actors): GPUs, or CPU cores here")
    device: str = Field("cpu-core", description="device type in the cost model's catalogue (H100, H200, cpu-core...)")
    address: str | None = Field(None, description="Ray cluster address; None starts a local Ray instance")

    @field_validator("device")
    @classmethod
    def known_device(cls, name: str) -> str:
        device(name)
        return name


class RuntimeSection(Section):
    """How the Ray runtime cuts the step, where the policy should not choose."""

    fragments: int | None = Field(None, ge=1, description="GAP fragments M (whole groups); None: the policy's choice")
    tsp_chunk: int | None = Field(None, ge=1, description="timesteps per train node; None: the policy's choice")
    trainer_devices: int | None = Field(None, ge=1, description="trainer pool of disaggregated policies")
    reward_devices: int = Field(
        0, ge=0, description="devices that only score (for a reward model); 0: rollout devices score"
    )
    tag: Literal["auto", "off", "force"] = Field(
        "auto",
        description="digen's trainer-assisted generation: where it predicts a gain, never, or whenever a trainer idles",
    )
    profile_samples: int = Field(32, ge=1, description="samples in the start-up profile that seeds the cost model")


MULTIPLEXING_POLICIES = ("jigsaw", "jigsaw-greedy")
"""Policies that fit several pipelines' sub-stages together on one pool; either runs a pipeline alone too."""


class RunSection(Section):
    """What every pipeline's run config has: a name, a seed, the optimizer loop, checkpoints, the cluster."""

    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="the pipeline's name (node ids, run sub-directory, trace colour); None: the task, or 'digits'",
    )
    priority: float = Field(1.0, gt=0, description="weight of this pipeline's step latency when multiplexed")
    seed: int = 0
    train: TrainSection = TrainSection()
    checkpoint: CheckpointSection = CheckpointSection()
    cluster: ClusterSection = ClusterSection()


class FlowTrainConfig(RunSection):
    """A FlowGRPO / DanceGRPO run of a text-to-image flow model."""

    kind: Literal["flow"] = "flow"
    algorithm: Literal["flow_grpo", "dance_grpo"] = "flow_grpo"
    policy: Literal["reference", "colocated", "disaggregated", "digen", "digen+tcss", *MULTIPLEXING_POLICIES] = (
        "reference"
    )
    model: ModelSection = ModelSection()
    sampling: SamplingSection = SamplingSection()
    algo: AlgoSection = AlgoSection()
    train: FlowTrainSection = FlowTrainSection()
    reward: dict[str, float] = Field(default_factory=lambda: {"digit_match": 1.0})
    eval: EvalSection = EvalSection()
    runtime: RuntimeSection = RuntimeSection()

    @field_validator("reward")
    @classmethod
    def _known_rewards(cls, weights: dict[str, float]) -> dict[str, float]:
        check_reward_names(weights)
        if not weights:
            raise ValueError("name at least one reward, e.g. reward.digit_match=1.0")
        return weights

    @model_validator(mode="after")
    def _dance_grpo_sde(self) -> "FlowTrainConfig":
        if self.algorithm == "dance_grpo" and self.sampling.sde_kind != "flow_grpo":
            raise ValueError("algorithm dance_grpo uses its own constant-eta SDE; leave sampling.sde_kind unset")
        return self

    @model_validator(mode="after")
    def _streaming_needs_group_statistics(self) -> "FlowTrainConfig":
        if self.policy != "reference" and self.algo.std_scope == "global":
            raise ValueError(
                f"algo.std_scope=global needs the whole batch scored before any training; policy {self.policy} "
                "trains fragments as they finish: use algo.std_scope=group (or none), or policy=reference"
            )
        return self

    @model_validator(mode="after")
    def _pools_fit_the_devices(self) -> "FlowTrainConfig":
        check_pools(self.cluster.devices, self.runtime.trainer_devices, self.runtime.reward_devices, "runtime")
        return self

    @property
    def compute_devices(self) -> int:
        """Devices that hold the policy's engines: all but the reward pool (the last runtime.reward_devices)."""
        return self.cluster.devices - self.runtime.reward_devices

    @property
    def noise_level(self) -> float:
        if self.sampling.noise_level is not None:
            return self.sampling.noise_level
        return 0.5 if self.algorithm == "dance_grpo" else 1.0

    @property
    def sde_kind(self) -> str:
        return "dance_grpo" if self.algorithm == "dance_grpo" else self.sampling.sde_kind

    @property
    def timestep_mode(self) -> str:
        """Flow-GRPO trains the first (noisiest) steps, DanceGRPO a random subset."""
        return "random" if self.algorithm == "dance_grpo" else "prefix"

    @property
    def shared_group_noise(self) -> bool:
        """DanceGRPO starts every sample of a group from the same initial noise."""
        return self.algorithm == "dance_grpo"

    @property
    def trained_timesteps(self) -> int:
        """Timesteps a step trains per sample: `algo.select_train_timesteps`'s count, without torch (the planner
        derives its scenario from the config; a test pins the two equal)."""
        trainable = self.sampling.num_steps - 1
        return max(1, min(trainable, math.ceil(self.algo.timestep_fraction * trainable - 1e-9)))

    @property
    def pairs_per_step(self) -> int:
        """(sample, timestep) pairs a step trains: the loss normaliser, whoever splits the step."""
        return self.algo.prompts_per_step * self.algo.group_size * self.trained_timesteps

    def scenario(self, steps: int) -> Scenario:
        """This run as the planner's scenario: the graph the simulator would schedule, built without torch."""
        trained = self.trained_timesteps
        pipeline = {
            "kind": "flow",
            "name": self.pipeline_name,
            "model": "digits-t2i",
            "algorithm": self.algorithm,
            "prompts": self.algo.prompts_per_step,
            "group": self.algo.group_size,
            "denoising_steps": self.sampling.num_steps,
            "trained_timesteps": trained,
            "height": 8,
            "width": 8,
            "reward": "rule",
            # train.chunk_size (sample, timestep) pairs share one forward/backward
            "micro_batch": max(1, self.train.chunk_size // trained),
            "priority": self.priority,
        }
        return _scenario(self, [pipeline], steps, self.runtime.trainer_devices, self.runtime.reward_devices)

    @property
    def pipeline_name(self) -> str:
        return self.name or "digits"

    def shape_overrides(self) -> dict:
        """The step's cut where the config fixes it instead of the policy."""
        runtime = self.runtime
        return {k: v for k, v in (("fragments", runtime.fragments), ("tsp_chunk", runtime.tsp_chunk)) if v is not None}

    def policy_options(self) -> dict:
        return {"tag": {"auto": True, "off": False, "force": "force"}[self.runtime.tag]}


class LMModelSection(Section):
    checkpoint: Path | None = Field(
        None, description="directory with model.safetensors, config.json, tokenizer.json; None: the task's base model"
    )


class LMSamplingSection(Section):
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int | None = Field(None, ge=1, description="None: the task's longest ideal completion + a margin")


class LMAlgoSection(Section):
    prompts_per_step: int = Field(16, ge=1, description="B: prompts per step")
    group_size: int = Field(8, ge=2, description="G: responses per prompt")
    micro_batches: int = Field(2, ge=1, description="train micro-batches per step (whole prompt groups each)")
    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO clip below 1")
    clip_high: float = Field(0.28, ge=0, description="PPO clip above 1 (DAPO's clip-higher)")
    aggregation: Literal["token", "sequence", "drgrpo"] = Field(
        "token", description="token (DAPO), sequence (GRPO), drgrpo (Dr. GRPO: / (B x max_new_tokens))"
    )
    beta: float = Field(0.0, ge=0, description="weight of the KL to the base model")
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0)
    std_scope: Literal["group", "none"] = Field("group", description="none: Dr. GRPO's unscaled advantages")
    adv_clip: float = Field(5.0, gt=0)
    stale_max_weight: float = Field(2.0, ge=1, description="truncation of pi_prox/pi_behaviour for stale samples")


class LMEvalSection(Section):
    every: int = Field(10, ge=1, description="evaluate every N steps (and at the start and end)")
    prompts: int = Field(100, ge=1, description="held-out prompts (the task's eval split), one sample each")
    seed: int = 10_000


class LMRuntimeSection(Section):
    """How the Ray runtime cuts an LM step, where the policy should not choose."""

    trainer_devices: int | None = Field(None, ge=1, description="trainer pool of disaggregated policies")
    length_bands: list[int] = Field(
        default_factory=list, description="upper edges (tokens) of decode length bands; [] one band to the end"
    )
    profile_samples: int = Field(16, ge=1, description="responses in the start-up profile that seeds the cost model")


class LMTrainConfig(RunSection):
    """A GRPO run of a causal language model on a verifiable task."""

    kind: Literal["lm"]
    task: str = Field("sort", description="a task of dovetail.tasks: its prompts, answers and base model")
    policy: Literal["reference", "verl-sync", "streamrl", "areal", *MULTIPLEXING_POLICIES] = "reference"
    model: LMModelSection = LMModelSection()
    sampling: LMSamplingSection = LMSamplingSection()
    algo: LMAlgoSection = LMAlgoSection()
    reward: dict[str, float] | None = Field(None, description="text rewards and weights; None: the task's own")
    eval: LMEvalSection = LMEvalSection()
    runtime: LMRuntimeSection = LMRuntimeSection()

    @field_validator("task")
    @classmethod
    def _known_task(cls, name: str) -> str:
        task(name)
        return name

    @field_validator("reward")
    @classmethod
    def _known_text_rewards(cls, weights: dict[str, float] | None) -> dict[str, float] | None:
        if weights is not None:
            if not weights:
                raise ValueError("name at least one reward, e.g. reward.exact_answer=1.0, or leave it unset")
            for name in weights:
                text_reward_fn(name)
        return weights

    @model_validator(mode="after")
    def _shape_fits(self) -> "LMTrainConfig":
        algo, runtime = self.algo, self.runtime
        if algo.prompts_per_step % algo.micro_batches:
            raise ValueError(
                f"algo.micro_batches={algo.micro_batches} must divide algo.prompts_per_step={algo.prompts_per_step}"
            )
        check_pools(self.cluster.devices, runtime.trainer_devices, 0, "runtime")
        bands = runtime.length_bands
        if bands != sorted(set(bands)) or (bands and not 0 < bands[0] <= bands[-1] < self.max_new_tokens):
            raise ValueError(
                f"runtime.length_bands={bands} must be strictly ascending token counts between 1 and "
                f"max_new_tokens - 1 = {self.max_new_tokens - 1}"
            )
        return self

    @model_validator(mode="after")
    def _task_base_model(self) -> "LMTrainConfig":
        """No checkpoint given: the task's shipped base model."""
        if self.model.checkpoint is None:
            self.model.checkpoint = PACKAGE_ROOT / "assets" / f"{self.task}-lm"
        return self

    @property
    def rewards(self) -> dict[str, float]:
        return self.reward if self.reward is not None else task(self.task).reward_names

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens or task(self.task).max_new_tokens

    @property
    def compute_devices(self) -> int:
        return self.cluster.devices

    @property
    def pipeline_name(self) -> str:
        return self.name or self.task

    def shape_overrides(self) -> dict:
        return {}

    def policy_options(self) -> dict:
        return {}

    def scenario(self, steps: int) -> Scenario:
        """This run as the planner's scenario, without torch: response lengths are the task's ideal completions
        on a step's worth of training prompts (the base model's are near them; the run's profile corrects)."""
        problems = task(self.task).prompts("train", self.seed, 0, self.algo.prompts_per_step * self.algo.group_size)
        lengths = [min(self.max_new_tokens, len(task(self.task).solution(p)) + 1) for p in problems]
        pipeline = {
            "kind": "llm",
            "name": self.pipeline_name,
            "model": "tiny-lm",
            "batch": self.algo.prompts_per_step,
            "group": self.algo.group_size,
            "prompt_length": round(sum(len(p) + 1 for p in problems) / len(problems)),
            "lengths": {"kind": "empirical", "values": lengths},
            "max_length": self.max_new_tokens,
            "length_bands": self.runtime.length_bands,
            "micro_batches": self.algo.micro_batches,
            "reference": self.algo.beta > 0,
            "lengths_known": False,  # a run learns them by decoding
            "priority": self.priority,
        }
        return _scenario(self, [pipeline], steps, self.runtime.trainer_devices, 0)


def _kind_of(entry) -> str:
    return entry.get("kind", "flow") if isinstance(entry, dict) else entry.kind


PipelineConfig = Annotated[
    Annotated[FlowTrainConfig, Tag("flow")] | Annotated[LMTrainConfig, Tag("lm")], Discriminator(_kind_of)
]
"""One pipeline's run config: `kind: flow` (the default) or `kind: lm`."""


class MultiplexTrainSection(Section):
    steps: int = Field(50, ge=1, description="RL steps of every pipeline")


class MultiplexConfig(Section):
    """Several RL pipelines multiplexed on one pool of devices (JigsawRL). Each entry of `pipelines` is a flow or lm
    run config of its own — model, algorithm, reward, prompts, batch, optimizer, eval, checkpoints, `name`,
    `priority` — and trains its own weights into its own run sub-directory; the cluster, the policy and the number
    of steps are the run's (an entry may repeat them, not change them)."""

    kind: Literal["multiplex"]
    policy: Literal[MULTIPLEXING_POLICIES] = "jigsaw"
    train: MultiplexTrainSection = MultiplexTrainSection()
    cluster: ClusterSection = ClusterSection()
    pipelines: list[PipelineConfig] = Field(min_length=1)

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
        return _scenario(self, pipelines, steps, None, 0)

    def shape_overrides(self) -> dict:
        return {}

    def policy_options(self) -> dict:
        return {}


TrainConfig = FlowTrainConfig | LMTrainConfig | MultiplexConfig
"""One run's config: `kind: flow` (the default), `kind: lm`, or `kind: multiplex`."""


def pipeline_configs(config: TrainConfig) -> dict[str, PipelineConfig]:
    """The run's pipelines by name: one for a flow or lm run, each entry of a multiplexed run."""
    if isinstance(config, MultiplexConfig):
        return config.pipeline_configs()
    return {config.pipeline_name: config}


def _scenario(config: TrainConfig, pipelines: list[dict], steps: int, trainer_devices: int | None, reward_devices: int):
    return parse_scenario(
        {
            "name": f"train-{config.pipeline_name}-{config.policy}",
            "cluster": {"device": config.cluster.device, "devices": config.cluster.devices},
            "pipelines": pipelines,
            "schedule": {
                "steps": steps,
                "policies": [config.policy],
                "trainer_devices": trainer_devices,
                "reward_devices": reward_devices,
            },
        },
        "training config",
    )


class ConfigError(ValueError):
    """An invalid config: the message names each bad field and what it allows."""


def apply_override(tree: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.field=value, e.g. train.lr=1e-4")
    dotted, raw = override.split("=", 1)
    *parents, leaf = dotted.strip().split(".")
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {key!r} is a value, not a section")
    node[leaf] = yaml.safe_load(raw)


def load_config(path: Path | str | None = None, overrides: list[str] = ()) -> TrainConfig:
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        tree = yaml.safe_load(path.read_text()) or {}
    for override in overrides:
        apply_override(tree, override)
    return parse_config(tree)


def parse_config(tree: Any) -> TrainConfig:
    """A config tree (YAML's, or `model_dump(mode="json")`'s) as the run config of its `kind`."""
    if not isinstance(tree, dict):
        raise ConfigError(f"invalid config: a config is a mapping of sections, got {type(tree).__name__}")
    kinds = {"flow": FlowTrainConfig, "lm": LMTrainConfig, "multiplex": MultiplexConfig}
    kind = tree.get("kind", "flow")
    if kind not in kinds:
        raise ConfigError(f"invalid config:\n  kind: {kind!r} is not a run kind; use one of {sorted(kinds)}")
    if kind == "multiplex":
        tree = _multiplexed(tree)
    try:
        return kinds[kind](**tree)
    except ValidationError as error:
        lines = []
        for problem in error.errors():
            field = ".".join(str(part) for part in problem["loc"] if part not in ("flow", "lm"))
            if field:
                lines.append(f"  {field}: {problem['msg']} (got {problem.get('input')!r})")
            else:  # a check across fields: its message names them
                lines.append(f"  {problem['msg'].removeprefix('Value error, ')}")
        raise ConfigError("invalid config:\n" + "\n".join(lines)) from None


RUN_WIDE = {"policy": "policy", "cluster": "cluster", "train.steps": "train.steps"}
"""What every pipeline of a multiplexed run shares: the run's (an entry may repeat it, not change it)."""


def _multiplexed(tree: dict) -> dict:
    """The run's policy, cluster and steps written into every pipeline entry (each is a whole pipeline config);
    an entry that says otherwise is an error naming the field, not silently overridden."""
    defaults = MultiplexConfig.model_fields
    run = {
        "policy": tree.get("policy", defaults["policy"].default),
        "cluster": tree.get("cluster", {}),
        "train.steps": (tree.get("train") or {}).get("steps", MultiplexTrainSection().steps),
    }
    entries = tree.get("pipelines")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError("invalid config:\n  pipelines: a list of pipeline configs (mappings, each kind flow or lm)")
    filled = []
    for index, entry in enumerate(entries):
        entry = {**entry, "train": dict(entry.get("train") or {})}
        for field, value in run.items():
            section, _, leaf = field.partition(".")
            holder = entry["train"] if leaf else entry
            key = leaf or section
            if key in holder and holder[key] != value and not (key == "cluster" and _same_cluster(holder[key], value)):
                raise ConfigError(
                    f"invalid config:\n  pipelines.{index}.{field}: a multiplexed pipeline takes the run's "
                    f"{field} ({value!r}); set it at the top of the config"
                )
            holder[key] = value
        filled.append(entry)
    return {**tree, "pipelines": filled}


def _same_cluster(a, b) -> bool:
    try:
        return ClusterSection(**a) == ClusterSection(**b)
    except (TypeError, ValidationError):
        return False


def dump_config(config: TrainConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
