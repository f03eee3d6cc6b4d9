"""The training run's typed config: YAML file plus dotted overrides, validated before any work."""

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dovetail.cost.catalog import device
from dovetail.rewards import check_reward_names

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


class TrainConfig(Section):
    algorithm: Literal["flow_grpo", "dance_grpo"] = "flow_grpo"
    policy: Literal["reference", "colocated", "disaggregated", "digen", "digen+tcss"] = "reference"
    seed: int = 0
    model: ModelSection = ModelSection()
    sampling: SamplingSection = SamplingSection()
    algo: AlgoSection = AlgoSection()
    train: TrainSection = TrainSection()
    reward: dict[str, float] = Field(default_factory=lambda: {"digit_match": 1.0})
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    cluster: ClusterSection = ClusterSection()
    runtime: RuntimeSection = RuntimeSection()

    @field_validator("reward")
    @classmethod
    def _known_rewards(cls, weights: dict[str, float]) -> dict[str, float]:
        check_reward_names(weights)
        if not weights:
            raise ValueError("name at least one reward, e.g. reward.digit_match=1.0")
        return weights

    @model_validator(mode="after")
    def _dance_grpo_sde(self) -> "TrainConfig":
        if self.algorithm == "dance_grpo" and self.sampling.sde_kind != "flow_grpo":
            raise ValueError("algorithm dance_grpo uses its own constant-eta SDE; leave sampling.sde_kind unset")
        return self

    @model_validator(mode="after")
    def _streaming_needs_group_statistics(self) -> "TrainConfig":
        if self.policy != "reference" and self.algo.std_scope == "global":
            raise ValueError(
                f"algo.std_scope=global needs the whole batch scored before any training; policy {self.policy} "
                "trains fragments as they finish: use algo.std_scope=group (or none), or policy=reference"
            )
        return self

    @model_validator(mode="after")
    def _pools_fit_the_devices(self) -> "TrainConfig":
        devices, runtime = self.cluster.devices, self.runtime
        if self.compute_devices < 1:
            raise ValueError(
                f"runtime.reward_devices={runtime.reward_devices} leaves none of cluster.devices={devices} "
                "to generate and train: lower it or add devices"
            )
        if runtime.trainer_devices is not None and runtime.trainer_devices >= self.compute_devices:
            raise ValueError(
                f"runtime.trainer_devices={runtime.trainer_devices} leaves no rollout device of "
                f"cluster.devices={devices}"
                + (f" besides runtime.reward_devices={runtime.reward_devices}" if runtime.reward_devices else "")
            )
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
    try:
        return TrainConfig(**tree)
    except ValidationError as error:
        lines = []
        for problem in error.errors():
            field = ".".join(str(part) for part in problem["loc"]) or "config"
            lines.append(f"  {field}: {problem['msg']} (got {problem.get('input')!r})")
        raise ConfigError("invalid config:\n" + "\n".join(lines)) from None


def dump_config(config: TrainConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
