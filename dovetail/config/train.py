"""The training run's typed config: YAML file plus dotted overrides, validated before any work.

One schema per run, chosen by `kind`: `flow` (a text-to-image flow model, the default), `lm` (a causal language
model on a verifiable task), or `multiplex` (several flow / lm pipelines sharing one pool of devices, each entry
of `pipelines` a flow or lm config of its own). Each derives the planner's scenario itself (`scenario(steps)`),
without torch, so the simulator, the dry run and the replay of a run plan from the very config that trains.

Every number is bounded: floats finite, sizes below maxima that keep a run's allocations (and the planner's
simulation) sane, each bound's reason in its description. Types are strict: `true` is not the number 1, nor "8"
the number 8 (an int is a float). Every way a config can be wrong is a ConfigError: one line per problem, naming the
file or the field and what it allows."""

import json
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dovetail.cost.catalog import device, diffusion_model
from dovetail.files import read_text
from dovetail.graph.spec import MAX_DEVICES, MAX_SAMPLES, GroupSize, PipelineName, check_length_bands
from dovetail.rewards import REWARD_TIMEOUT_S, check_reward_names
from dovetail.rewards.text import text_reward_fn
from dovetail.scenario import (
    MAX_SIMULATED_STEPS,
    Scenario,
    check_pools,
    clip,
    parse_scenario,
    parse_yaml,
    problem_lines,
    problem_report,
    read_yaml,
)
from dovetail.sched import POLICIES, policy_class
from dovetail.tasks import task

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = PACKAGE_ROOT / "assets" / "digits-t2i"

MAX_STEPS = 10**7
"""Steps of a run, and of anything counted in steps (eval, checkpoints): far beyond any run, finite."""

MAX_PER_STEP = 256
"""Prompts per step, and samples per prompt: 256 x 256 is the planner's MAX_SAMPLES."""

Seed = Annotated[int, Field(ge=0, lt=2**63, description="a non-negative 63-bit seed")]

RewardWeights = dict[
    Annotated[str, StringConstraints(max_length=120)],
    Annotated[float, Field(ge=-1000, le=1000)],
]
"""Reward name (a built-in, or module:function) -> weight: finite, at most 1000 either way (only the weights'
ratios matter once advantages are standardised)."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


DIFFUSERS_TRANSFORMERS = ("SD3Transformer2DModel", "FluxTransformer2DModel", "WanTransformer3DModel")
"""Flow transformers `model.path` loads (dovetail.models.diffusers_flow)."""


class LoraSection(Section):
    """A peft LoRA adapter on the transformer: only the adapter trains, is published and checkpointed."""

    rank: int = Field(8, ge=1, le=1024, description="r: the adapter's rank")
    alpha: float | None = Field(None, gt=0, le=10_000, description="lora_alpha (scale alpha / rank); None: rank")
    target_modules: list[Annotated[str, StringConstraints(min_length=1, max_length=200)]] = Field(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"],
        min_length=1,
        max_length=64,
        description="names (suffixes) of the transformer's linear layers that get an adapter",
    )


class ModelSection(Section):
    checkpoint: Path | None = Field(
        None,
        strict=False,
        description="the built-in model's directory (model.safetensors + config.json); None: the shipped digits model",
    )
    path: Path | None = Field(
        None,
        strict=False,
        description="a diffusers directory (save_pretrained layout): a pipeline, or transformer/ with "
        "prompt_embeds.safetensors",
    )
    lora: LoraSection | None = Field(None, description="train a LoRA adapter of model.path's transformer")
    max_sequence_length: int = Field(
        256, ge=1, le=4096, description="T5 tokens of an SD3 pipeline's prompt encoding (its encode_prompt's)"
    )
    sample_size: int | None = Field(
        None,
        ge=2,
        le=1024,
        multiple_of=2,
        description="latent pixels a side; None: the transformer's sample_size (FLUX has none: FluxPipeline's 128)",
    )
    frames: int | None = Field(
        None, ge=1, le=1024, description="a video model's (Wan's) frames a sample; None: WanPipeline's 81 (1: images)"
    )
    guidance: float = Field(3.5, ge=0, le=100, description="a guidance-distilled FLUX's (FLUX.1-dev's) guidance")
    cost_model: str = Field(
        "digits-t2i",
        max_length=100,
        description="the cost catalogue's diffusion model the planner prices this one as before the run profiles "
        "it (e.g. SD3.5-M): what a dry run on GPUs plans with",
    )

    @field_validator("cost_model")
    @classmethod
    def _known_cost_model(cls, name: str) -> str:
        diffusion_model(name)
        return name

    @field_validator("checkpoint")
    @classmethod
    def _not_diffusers(cls, checkpoint: Path | None) -> Path | None:
        if checkpoint is not None and (
            _is_file(checkpoint / "model_index.json") or _is_file(checkpoint / "transformer" / "config.json")
        ):
            raise ValueError(f"{checkpoint} is a diffusers directory: give it as model.path")
        if checkpoint is not None and "_class_name" in _json_or_empty(checkpoint / "config.json"):
            raise ValueError(
                f"{checkpoint} is a diffusers model directory: give the directory that holds it as transformer/ "
                "as model.path"
            )
        return checkpoint

    @field_validator("path")
    @classmethod
    def _diffusers_layout(cls, path: Path | None) -> Path | None:
        problem = None if path is None else diffusers_layout_problem(path)
        if problem:
            raise ValueError(problem)
        return path

    @model_validator(mode="after")
    def _one_model(self) -> "ModelSection":
        if self.path is not None and self.checkpoint is not None:
            raise ValueError("model: give model.path (a diffusers directory) or model.checkpoint, not both")
        if self.lora is not None and self.path is None:
            raise ValueError("model.lora: LoRA trains a diffusers model; give its directory as model.path")
        if self.path is None and self.checkpoint is None:
            self.checkpoint = DEFAULT_CHECKPOINT
        return self

    @model_validator(mode="after")
    def _video_frames(self) -> "ModelSection":
        """A Wan directory's frames (1 + a multiple of its VAE's temporal stride: WanPipeline would round others) and
        size, WanPipeline's 81 frames and 480 pixels a side unless set; an image model's frames are 1."""
        vae = _json_or_empty(self.path / "vae" / "config.json") if self.path is not None else {}
        if vae.get("_class_name") != "AutoencoderKLWan":
            if self.frames not in (None, 1):
                raise ValueError(f"model.frames={self.frames}: model.frames is a video model's (Wan's); remove it")
            self.frames = 1
            return self
        stride, self.frames = vae.get("scale_factor_temporal") or 4, self.frames or 81
        if (self.frames - 1) % stride:
            fit = (self.frames - 1) // stride * stride + 1
            raise ValueError(
                f"model.frames={self.frames}: {self.path / 'vae'} makes 1 + a multiple of {stride} frames; set "
                f"model.frames={fit} or {fit + stride}"
            )
        self.sample_size = self.sample_size or 480 // (vae.get("scale_factor_spatial") or 8) // 2 * 2
        return self


def _is_file(path: Path) -> bool:
    """Path.is_file, a path the system cannot look up (one too long) being no file."""
    try:
        return path.is_file()
    except OSError:
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def _json_or_empty(path: Path) -> dict:
    try:
        loaded = json.loads(read_text(path, "a JSON file"))
    except ValueError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


def diffusers_layout_problem(path: Path) -> str | None:
    """What a `model.path` directory lacks, in one line naming it; None when the model can load from it."""
    if not _is_dir(path):
        return f"{path} is not a directory; give a diffusers pipeline directory (save_pretrained layout)"
    transformer = _json_or_empty(path / "transformer" / "config.json")
    if not transformer:
        return f"{path} has no transformer/config.json: not a diffusers pipeline directory (save_pretrained layout)"
    if transformer.get("_class_name") not in DIFFUSERS_TRANSFORMERS:
        return (
            f"{path / 'transformer'} holds a {transformer.get('_class_name')!r}; model.path loads "
            f"{', '.join(DIFFUSERS_TRANSFORMERS)}"
        )
    index = _json_or_empty(path / "model_index.json")
    if not index and not _is_file(path / "prompt_embeds.safetensors"):
        return f"{path} has neither model_index.json with text encoders nor prompt_embeds.safetensors"
    for name, entry in index.items():
        if isinstance(entry, list) and entry[:1] != [None] and not _is_dir(path / name):
            return f"{path / 'model_index.json'} lists {name}, and {path} has no {name}/"
    if not _is_dir(path / "vae") and transformer.get("in_channels") not in (1, 3):
        return f"{path} has no vae/ to decode the transformer's {transformer.get('in_channels')}-channel latents"
    if transformer["_class_name"] == "WanTransformer3DModel":
        vae = _json_or_empty(path / "vae" / "config.json").get("_class_name")
        if vae != "AutoencoderKLWan":
            return f"{path / 'vae' / 'config.json'} holds a {vae!r}; put the Wan pipeline's AutoencoderKLWan there"
        if isinstance(index.get("transformer_2"), list) and index["transformer_2"][:1] != [None]:
            return (
                f"{path / 'model_index.json'} lists transformer_2 (Wan2.2's low-noise expert); dovetail trains one "
                "transformer: give a one-transformer Wan pipeline (Wan2.1, Wan2.2-TI2V-5B)"
            )
    return None


MIN_NOISE_LEVEL = 1e-4
"""The least SDE noise level: a step's noise is the level times a schedule factor down to ~1e-3 (1000 steps, near
sigma 0), and below ~1e-7 of a latent it vanishes in fp32 rounding: the SDE then samples the ODE and GRPO trains
nothing (at 1e-12 on the digits model), and near 1e-30 its variance underflows and the log-probs are NaN."""


class SamplingSection(Section):
    num_steps: int = Field(10, ge=2, le=1000, description="denoising steps K")
    noise_level: float | None = Field(
        None,
        ge=MIN_NOISE_LEVEL,
        le=10,
        description="SDE noise: a of Flow-GRPO (default 1.0), constant eta of DanceGRPO (default 0.5); beyond a "
        f"few the samples are noise, and from {MIN_NOISE_LEVEL:g} to 10 the SDE's arithmetic stays finite",
    )
    sde_kind: Literal["flow_grpo", "cps"] = Field("flow_grpo", description="SDE of algorithm flow_grpo")
    shift: float = Field(
        1.0, gt=0, le=100, description="sigma schedule shift of the flow-matching scheduler (SD3 uses 3)"
    )
    schedule: Literal["diffusers", "dance_grpo"] = Field(
        "diffusers", description="sigmas as diffusers' scheduler lays them, or DanceGRPO's own (models.t2i.flow_sigmas)"
    )
    cps_log_prob: Literal["gaussian", "squared_error"] = Field(
        "gaussian", description="log-prob of the cps SDE: the Gaussian's, or -(x - mean)^2 as Flow-GRPO and verl-omni"
    )


COMPAT_PRESETS = ("dovetail", "flow_grpo", "flow_grpo_fast", "dance_grpo", "verl_omni")


class AlgoSection(Section):
    prompts_per_step: int = Field(8, ge=1, le=MAX_PER_STEP, description="B: prompts per step")
    group_size: GroupSize = Field(8, le=MAX_PER_STEP, description="G: samples per prompt")
    timestep_fraction: float = Field(0.5, gt=0, le=1, description="share of the K-1 trainable steps trained")
    clip_range: float = Field(1e-4, gt=0, le=1, description="PPO clip of the ratio: 1 +- clip_range")
    beta: float = Field(0.0, ge=0, le=100, description="weight of the KL to the base model")
    std_scope: Literal["group", "global", "none"] = "group"
    adv_clip: float = Field(5.0, gt=0, le=1000, description="clip of the (standardised) advantages")
    stale_max_weight: float = Field(
        2.0, ge=1, le=1000, description="truncation of pi_prox/pi_behaviour for TCSS's stale samples"
    )
    compat: Literal[COMPAT_PRESETS] = Field(
        "dovetail", description="whose conventions fill the knobs below left unset (COMPAT: docs/architecture.md)"
    )
    adv_baseline: Literal["group", "batch"] = Field(
        "group", description="advantages subtract the group's mean, or the batch's (Flow-GRPO without per-prompt stats)"
    )
    adv_group: Literal["prompt", "prompt_text"] = Field(
        "prompt", description="a group is one prompt's samples, or every sample of an equal prompt text (Flow-GRPO)"
    )
    adv_eps: float = Field(1e-4, ge=0, le=1, description="added to the std the advantages divide by")
    adv_unbiased: bool = Field(False, description="the sample std (n - 1, torch's) instead of the population std")
    kl_std: Literal["total", "std_dev_t"] = Field(
        "total",
        description="the KL divides by the step's total std^2 (the exact Gaussian KL), or by the SDE's std_dev_t^2 "
        "(Flow-GRPO, verl-omni: 1/(-dt) times weaker)",
    )
    timesteps: Literal["prefix", "random", "window"] | None = Field(
        None, description="which steps train: the first, a random subset, an SDE window; None: the algorithm's"
    )
    timestep_rounding: Literal["ceil", "floor"] = Field(
        "ceil", description="fraction x pool rounded up (at least one) or down (Python's int(), as upstream)"
    )
    timestep_pool: Literal["trainable", "all"] = Field(
        "trainable", description="the fraction is of the K - 1 trainable steps, or of all K (Flow-GRPO)"
    )
    per_sample_timesteps: bool = Field(
        False, description="each sample draws its own steps (DanceGRPO), keyed by its identity; else one draw a step"
    )
    window_size: int | None = Field(None, ge=1, le=1000, description="steps of the SDE window (timesteps=window)")
    window_range: list[Annotated[int, Field(ge=0, le=1000)]] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="[lo, hi]: the window lies in steps lo..hi-1; None: [0, K - 1], every trainable step",
    )


COMPAT = {
    "dovetail": {},
    "flow_grpo": {
        "sampling.noise_level": 0.7,
        "sampling.cps_log_prob": "squared_error",
        "algo.std_scope": "global",
        "algo.adv_group": "prompt_text",
        "algo.kl_std": "std_dev_t",
        "algo.timesteps": "prefix",
        "algo.timestep_rounding": "floor",
        "algo.timestep_pool": "all",
    },
    "flow_grpo_fast": {
        "sampling.noise_level": 0.7,
        "sampling.cps_log_prob": "squared_error",
        "algo.std_scope": "global",
        "algo.adv_group": "prompt_text",
        "algo.kl_std": "std_dev_t",
        "algo.timesteps": "window",
        "algo.window_size": 2,
    },
    "dance_grpo": {
        "algorithm": "dance_grpo",
        "sampling.noise_level": 0.3,
        "sampling.schedule": "dance_grpo",
        "algo.adv_eps": 1e-8,
        "algo.adv_unbiased": True,
        "algo.timesteps": "random",
        "algo.timestep_rounding": "floor",
        "algo.per_sample_timesteps": True,
    },
    "verl_omni": {
        "sampling.noise_level": 1.0,
        "sampling.cps_log_prob": "squared_error",
        "algo.std_scope": "global",
        "algo.adv_unbiased": True,
        "algo.kl_std": "std_dev_t",
        "algo.timesteps": "prefix",
        "algo.timestep_fraction": 1.0,
    },
}
"""Each `algo.compat` preset's values for the fields a config leaves unset (`section.field`): the conventions of
Flow-GRPO (yifan123/flow_grpo), Flow-GRPO-Fast, DanceGRPO (XueZeyue/DanceGRPO) and verl-omni, each transcribed and
tested against its upstream in tests/test_compat.py. `dovetail` keeps dovetail's own (docs/architecture.md says why).
`sampling.cps_log_prob` applies only where the SDE is cps."""


class TrainSection(Section):
    steps: int = Field(200, ge=1, le=MAX_STEPS)
    lr: float = Field(1e-4, gt=0, le=1, description="Adam's learning rate: beyond 1 every step diverges")
    weight_decay: float = Field(
        0.0, ge=0, le=1, description="AdamW's decoupled decay: at most 1, so lr x weight_decay only shrinks weights"
    )
    max_grad_norm: float = Field(1.0, gt=0, le=1e4)


class FlowTrainSection(TrainSection):
    chunk_size: int = Field(
        128, ge=1, le=MAX_SAMPLES, description="(sample, timestep) pairs per batched forward/backward"
    )


class EvalSection(Section):
    every: int = Field(25, ge=1, le=MAX_STEPS, description="evaluate every N steps (and at the start and end)")
    per_digit: int = Field(
        8,
        ge=1,
        le=1000,
        description="held-out ODE samples per eval prompt: each digit's, or each of prompts.eval_prompts (at most "
        "1000: every eval generates them all)",
    )
    seed: Seed = 10_000


class PromptsSection(Section):
    """The run's prompts from a file or dataset (dovetail.prompts): one per line (.txt), a field of JSON lines
    (.jsonl), of a JSON list (.json), or of a table `datasets` reads (.parquet, .csv); split into train and eval by a
    hash of each prompt's text (eval_fraction), or the eval prompts from a file of their own (eval_path)."""

    path: Path = Field(strict=False, description="the prompts file")
    field: str = Field("prompt", min_length=1, max_length=200, description="the prompt's field in a record")
    eval_fraction: float | None = Field(
        None, gt=0, lt=1, description="share of the prompts held out for evaluation; None: 0.1 (without eval_path)"
    )
    eval_path: Path | None = Field(None, strict=False, description="eval prompts' file; then every prompt trains")
    eval_prompts: int = Field(16, ge=1, le=1000, description="held-out prompts each evaluation samples")

    @field_validator("path", "eval_path")
    @classmethod
    def _a_file(cls, path: Path | None) -> Path | None:
        if path is not None and not _is_file(path):
            raise ValueError(f"no prompts file {path}")
        return path

    @model_validator(mode="after")
    def _one_eval_split(self) -> "PromptsSection":
        if self.eval_path is not None and self.eval_fraction is not None:
            raise ValueError("prompts: give prompts.eval_fraction or prompts.eval_path, not both")
        if self.eval_path is None and self.eval_fraction is None:
            self.eval_fraction = 0.1
        return self


class CheckpointSection(Section):
    every: int = Field(50, ge=1, le=MAX_STEPS, description="save every N steps (and at the end)")


RAY_ADDRESS = re.compile(r"(ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?):(?P<port>[0-9]{1,5})")
"""host:port or ray://host:port, the host a name, an IPv4 address or a bracketed IPv6 address."""


class ClusterSection(Section):
    """Where the Ray runtime (every policy but `reference`) runs."""

    devices: int = Field(2, ge=1, le=MAX_DEVICES, description="devices (DeviceWorker actors): GPUs, or CPU cores here")
    device: str = Field(
        "cpu-core",
        max_length=100,
        description="device type in the cost model's catalogue (H100, H200, cpu-core...)",
    )
    address: str | None = Field(
        None,
        description="Ray cluster address (host:port, ray://host:port, or auto); None starts a local Ray instance",
    )

    @field_validator("device")
    @classmethod
    def known_device(cls, name: str) -> str:
        device(name)
        return name

    @field_validator("address")
    @classmethod
    def _ray_address(cls, address: str | None) -> str | None:
        if address is None or address == "auto":
            return address
        match = RAY_ADDRESS.fullmatch(address)
        if match is None or not 0 < int(match["port"]) < 65536:
            raise ValueError(
                f"{clip(repr(address))} is not a Ray address: give host:port (e.g. 10.0.0.1:6379), "
                "ray://host:port, or auto"
            )
        return address


class RuntimeSection(Section):
    """How the Ray runtime cuts the step, where the policy should not choose."""

    fragments: int | None = Field(
        None, ge=1, le=MAX_PER_STEP, description="GAP fragments M (whole groups); None: the policy's choice"
    )
    tsp_chunk: int | None = Field(
        None, ge=1, le=1000, description="timesteps per train node; None: the policy's choice"
    )
    trainer_devices: int | None = Field(
        None, ge=1, le=MAX_DEVICES, description="trainer pool of disaggregated policies"
    )
    trainer_group: int | None = Field(
        None,
        ge=1,
        le=MAX_DEVICES,
        description="devices of one trainer group (1: each device trains whole train nodes); None: the policy's "
        "choice from the profiled costs. Fixing the cut (with fragments and tsp_chunk) makes runs bitwise repeatable",
    )
    reward_devices: int = Field(
        0, ge=0, le=MAX_DEVICES, description="devices that only score (for a reward model); 0: rollout devices score"
    )
    tag: Literal["auto", "off", "force"] = Field(
        "auto",
        description="digen's trainer-assisted generation: where it predicts a gain, never, or whenever a trainer idles",
    )
    profile_samples: int = Field(
        32, ge=1, le=1024, description="samples in the start-up profile that seeds the cost model"
    )


TRACKERS = ("console", "tensorboard", "wandb", "mlflow")
"""Experiment trackers a run can report to: the progress display, and three tracking services' local stores."""

MULTIPLEXING_POLICIES = ("jigsaw", "jigsaw-greedy")
"""Policies that fit several pipelines' sub-stages together on one pool; either runs a pipeline alone too."""

MAX_PIPELINES = 4
"""Pipelines one run may multiplex. Each has a worker process of its own on every device, so pipelines share a
device the way JigsawRL's share a GPU (on a CPU core, the processes split its time; on a GPU, MPS shares), and
each such worker takes this fraction of the device's Ray resource (`exec.launch`)."""


class RunSection(Section):
    """What every pipeline's run config has: a name, a seed, the optimizer loop, checkpoints, the cluster."""

    name: PipelineName | None = Field(
        None, description="the pipeline's name (node ids, run sub-directory, trace colour); None: the task, or 'digits'"
    )
    priority: float = Field(1.0, gt=0, le=1000, description="weight of this pipeline's step latency when multiplexed")
    reward_timeout_s: float = Field(
        REWARD_TIMEOUT_S,
        gt=0,
        le=86_400,
        description="seconds one reward may take on one batch before the run stops (saved) instead of hanging",
    )
    seed: Seed = 0
    train: TrainSection = TrainSection()
    checkpoint: CheckpointSection = CheckpointSection()
    cluster: ClusterSection = ClusterSection()
    logger: list[Literal[TRACKERS]] = Field(
        default_factory=lambda: ["console"],
        max_length=len(TRACKERS),
        description="where each step's metrics and every evaluation go besides metrics.jsonl (dovetail.trackers)",
    )

    @model_validator(mode="after")
    def _runtime_the_policy_honours(self) -> "RunSection":
        """A runtime field the policy decides itself (`Policy.fixes`: e.g. colocated's trainer devices) is refused
        under its own name here, before the planner would refuse it under the scenario's."""
        policy = getattr(self, "policy", "reference")
        if policy not in POLICIES:
            return self
        for field, why in policy_class(policy).fixes.items():
            value = getattr(self.runtime, field, None)
            if value is not None:
                raise ValueError(f"runtime.{field}={value}: policy {policy} {why}, so it cannot honour it; remove it")
        return self


class FlowTrainConfig(RunSection):
    """A FlowGRPO / DanceGRPO run of a text-to-image flow model."""

    kind: Literal["flow"] = "flow"
    algorithm: Literal["flow_grpo", "dance_grpo"] = "flow_grpo"
    policy: Literal["reference", "colocated", "disaggregated", "digen", "digen+tcss", *MULTIPLEXING_POLICIES] = (
        "reference"
    )
    model: ModelSection = ModelSection()
    prompts: PromptsSection | None = Field(None, description="prompts from a file or dataset; None: 'digit N'")
    sampling: SamplingSection = SamplingSection()
    algo: AlgoSection = AlgoSection()
    train: FlowTrainSection = FlowTrainSection()
    reward: RewardWeights = Field(default_factory=lambda: {"digit_match": 1.0})
    eval: EvalSection = EvalSection()
    runtime: RuntimeSection = RuntimeSection()

    @field_validator("reward")
    @classmethod
    def _known_rewards(cls, weights: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        if _imports_rewards(info):
            check_reward_names(weights)
        if not weights:
            raise ValueError("name at least one reward, e.g. reward.digit_match=1.0")
        return weights

    @model_validator(mode="after")
    def _apply_compat(self) -> "FlowTrainConfig":
        """The `algo.compat` preset's values for every field the config leaves unset; a field it sets otherwise is
        the user's choice, except an algorithm the preset's upstream does not have."""
        preset = self.algo.compat
        for dotted, value in COMPAT[preset].items():
            section, _, field = dotted.rpartition(".")
            holder = getattr(self, section) if section else self
            if field == "cps_log_prob" and self.sde_kind != "cps":
                continue
            if field not in holder.model_fields_set:
                setattr(holder, field, value)
            elif dotted == "algorithm" and self.algorithm != value:
                raise ValueError(
                    f"algorithm={self.algorithm}: algo.compat={preset} is algorithm {value}; leave it unset"
                )
        if preset in ("flow_grpo", "flow_grpo_fast") and self.algorithm != "flow_grpo":
            raise ValueError(f"algorithm={self.algorithm}: algo.compat={preset} is algorithm flow_grpo; leave it unset")
        return self

    @model_validator(mode="after")
    def _digit_judge_needs_digits(self) -> "FlowTrainConfig":
        if self.model.path is not None and "digit_match" in self.reward:
            raise ValueError(
                "reward.digit_match judges the built-in model's 8x8 digits: give a model.path run its own reward, "
                "e.g. reward={mylab.rewards:aesthetic: 1.0} (a function of images and prompts)"
            )
        return self

    @model_validator(mode="after")
    def _dance_grpo_sde(self) -> "FlowTrainConfig":
        if self.algorithm == "dance_grpo" and self.sampling.sde_kind != "flow_grpo":
            raise ValueError(
                f"sampling.sde_kind={self.sampling.sde_kind}: algorithm dance_grpo uses its own constant-eta SDE; "
                "leave sampling.sde_kind unset"
            )
        if self.sampling.cps_log_prob != "gaussian" and self.sde_kind != "cps":
            raise ValueError(
                f"sampling.cps_log_prob={self.sampling.cps_log_prob} applies to the cps SDE only; set "
                "sampling.sde_kind=cps or leave sampling.cps_log_prob unset"
            )
        return self

    @model_validator(mode="after")
    def _streaming_needs_group_statistics(self) -> "FlowTrainConfig":
        algo = self.algo
        whole_batch = {
            "std_scope=global": (algo.std_scope == "global", "algo.std_scope=group (or none)"),
            "adv_baseline=batch": (algo.adv_baseline == "batch", "algo.adv_baseline=group"),
            "adv_group=prompt_text": (algo.adv_group == "prompt_text", "algo.adv_group=prompt"),
        }
        needed = [(field, fix) for field, (needs, fix) in whole_batch.items() if needs]
        if self.policy != "reference" and needed:
            fields = " and ".join(f"algo.{field}" for field, _ in needed)
            preset = f" (algo.compat={algo.compat})" if algo.compat != "dovetail" else ""
            raise ValueError(
                f"{fields}{preset} needs the whole batch scored before any training; policy {self.policy} "
                f"trains fragments as they finish: use {' and '.join(fix for _, fix in needed)}, or policy=reference"
            )
        return self

    @model_validator(mode="after")
    def _timesteps_fit(self) -> "FlowTrainConfig":
        """The trained steps exist: a count between 1 and K - 1, a window inside the trainable steps."""
        algo, trainable = self.algo, self.sampling.num_steps - 1
        if self.timestep_mode == "window":
            low, high = algo.window_range if algo.window_range is not None else (0, trainable)
            if not 0 <= low < high <= trainable:
                raise ValueError(
                    f"algo.window_range=[{low}, {high}] must satisfy 0 <= lo < hi <= num_steps - 1 = {trainable} "
                    "(the last step is never trained)"
                )
            if algo.window_size is None or algo.window_size > high - low:
                raise ValueError(
                    f"algo.window_size={algo.window_size}: algo.timesteps=window needs a window of 1 to {high - low} "
                    "steps (inside algo.window_range)"
                )
        elif not 1 <= self.trained_timesteps <= trainable:
            hint = " (Flow-GRPO's own configs use 0.99)" if algo.timestep_pool == "all" else ""
            raise ValueError(
                f"algo.timestep_fraction={algo.timestep_fraction} trains {self.trained_timesteps} of "
                f"{self.sampling.num_steps} steps with algo.timestep_rounding={algo.timestep_rounding}, "
                f"algo.timestep_pool={algo.timestep_pool}; dovetail trains 1 to num_steps - 1 = {trainable} "
                f"(never the last): change algo.timestep_fraction{hint}"
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
        """algo.timesteps, else the algorithm's: Flow-GRPO trains the first (noisiest) steps, DanceGRPO a random
        subset."""
        if self.algo.timesteps is not None:
            return self.algo.timesteps
        return "random" if self.algorithm == "dance_grpo" else "prefix"

    @property
    def shared_group_noise(self) -> bool:
        """DanceGRPO starts every sample of a group from the same initial noise."""
        return self.algorithm == "dance_grpo"

    @property
    def trained_timesteps(self) -> int:
        """Timesteps a step trains per sample: `algo.select_train_timesteps`'s count, without torch (the planner
        derives its scenario from the config; a test pins the two equal)."""
        algo, trainable = self.algo, self.sampling.num_steps - 1
        if self.timestep_mode == "window":
            return algo.window_size
        size = self.sampling.num_steps if algo.timestep_pool == "all" else trainable
        if algo.timestep_rounding == "floor":
            return int(size * algo.timestep_fraction)
        return max(1, min(trainable, math.ceil(algo.timestep_fraction * size - 1e-9)))

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
            "model": self.model.cost_model,
            "algorithm": self.algorithm,
            "prompts": self.algo.prompts_per_step,
            "group": self.algo.group_size,
            "denoising_steps": self.sampling.num_steps,
            "trained_timesteps": trained,
            "height": self.image_size,
            "width": self.image_size,
            "frames": self.model.frames,
            "reward": "rule",
            # train.chunk_size (sample, timestep) pairs share one forward/backward
            "micro_batch": max(1, self.train.chunk_size // trained),
            "priority": self.priority,
            "lora": self.lora_spec,
        }
        return _scenario(self, [pipeline], steps, self.runtime.trainer_devices, self.runtime.reward_devices)

    @property
    def pipeline_name(self) -> str:
        return self.name or "digits"

    @property
    def image_size(self) -> int:
        """Pixels a side of the images: the built-in model's 8, or model.path's transformer sample size times its
        VAE's scale (read from their config.json, without torch)."""
        if self.model.path is None:
            return 8
        transformer = _json_or_empty(self.model.path / "transformer" / "config.json")
        vae = _json_or_empty(self.model.path / "vae" / "config.json")
        latent = self.model.sample_size or transformer.get("sample_size") or 128  # FluxPipeline's default
        return latent * (vae.get("scale_factor_spatial") or 2 ** (len(vae.get("block_out_channels", [None])) - 1))

    @property
    def lora_spec(self) -> dict | None:
        """model.lora as the planner's LoRA spec: attention (q, k, v, out projections only) or all-linear."""
        lora = self.model.lora
        if lora is None:
            return None
        attention = {"to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"}
        return {"rank": lora.rank, "targets": "attention" if set(lora.target_modules) <= attention else "all-linear"}

    def shape_overrides(self) -> dict:
        """The step's cut where the config fixes it instead of the policy."""
        runtime = self.runtime
        fixed = (
            ("fragments", runtime.fragments),
            ("tsp_chunk", runtime.tsp_chunk),
            ("trainer_group", runtime.trainer_group),
        )
        return {k: v for k, v in fixed if v is not None}

    def policy_options(self) -> dict:
        return {"tag": {"auto": True, "off": False, "force": "force"}[self.runtime.tag]}


class LMModelSection(Section):
    checkpoint: Path | None = Field(
        None,
        strict=False,
        description="directory with model.safetensors, config.json, tokenizer.json; None: the task's base model",
    )


MIN_TEMPERATURE = 1e-30
"""The least sampling temperature: the trainer divides its fp32 logits by it, and below fp32's smallest normal number
(1.2e-38) every quotient is infinite and the log-probs NaN (the next step then samples from NaN weights); 1e-30
keeps logits up to 3e8 finite. So small a temperature samples greedily, as a tiny top_p does."""


class LMSamplingSection(Section):
    temperature: float = Field(1.0, gt=0, le=100, description="beyond 100 every token is as likely")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int | None = Field(
        None, ge=1, le=4096, description="None: the task's longest ideal completion + a margin"
    )

    @field_validator("temperature")
    @classmethod
    def _fp32_safe(cls, temperature: float) -> float:
        if temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"{temperature:g} is below {MIN_TEMPERATURE:g}, where the trainer's fp32 logits / temperature "
                "overflow; for greedy decoding set sampling.top_p=1e-6"
            )
        return temperature


class LMAlgoSection(Section):
    prompts_per_step: int = Field(16, ge=1, le=MAX_PER_STEP, description="B: prompts per step")
    group_size: GroupSize = Field(8, le=MAX_PER_STEP, description="G: responses per prompt")
    micro_batches: int = Field(
        2, ge=1, le=MAX_PER_STEP, description="train micro-batches per step (whole prompt groups each)"
    )
    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO clip below 1")
    clip_high: float = Field(0.28, ge=0, le=10, description="PPO clip above 1 (DAPO's clip-higher)")
    aggregation: Literal["token", "sequence", "drgrpo"] = Field(
        "token", description="token (DAPO), sequence (GRPO), drgrpo (Dr. GRPO: / (B x max_new_tokens))"
    )
    beta: float = Field(0.0, ge=0, le=100, description="weight of the KL to the base model")
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0, le=100)
    std_scope: Literal["group", "none"] = Field("group", description="none: Dr. GRPO's unscaled advantages")
    adv_clip: float = Field(5.0, gt=0, le=1000, description="clip of the advantages")
    stale_max_weight: float = Field(
        2.0, ge=1, le=1000, description="truncation of pi_prox/pi_behaviour for stale samples"
    )


class LMEvalSection(Section):
    every: int = Field(10, ge=1, le=MAX_STEPS, description="evaluate every N steps (and at the start and end)")
    prompts: int = Field(100, ge=1, le=10_000, description="held-out prompts (the task's eval split), one sample each")
    seed: Seed = 10_000


class LMRuntimeSection(Section):
    """How the Ray runtime cuts an LM step, where the policy should not choose."""

    trainer_devices: int | None = Field(
        None, ge=1, le=MAX_DEVICES, description="trainer pool of disaggregated policies"
    )
    length_bands: list[int] = Field(
        default_factory=list,
        max_length=64,
        description="upper edges (tokens) of decode length bands; [] one band to the end",
    )
    profile_samples: int = Field(
        16, ge=1, le=1024, description="responses in the start-up profile that seeds the cost model"
    )


class LMTrainConfig(RunSection):
    """A GRPO run of a causal language model on a verifiable task."""

    kind: Literal["lm"]
    task: str = Field("sort", description="a task of dovetail.tasks: its prompts, answers and base model")
    policy: Literal["reference", "verl-sync", "streamrl", "areal", *MULTIPLEXING_POLICIES] = "reference"
    model: LMModelSection = LMModelSection()
    sampling: LMSamplingSection = LMSamplingSection()
    algo: LMAlgoSection = LMAlgoSection()
    reward: RewardWeights | None = Field(None, description="text rewards and weights; None: the task's own")
    eval: LMEvalSection = LMEvalSection()
    runtime: LMRuntimeSection = LMRuntimeSection()

    @field_validator("task")
    @classmethod
    def _known_task(cls, name: str) -> str:
        task(name)
        return name

    @field_validator("reward")
    @classmethod
    def _known_text_rewards(cls, weights: dict[str, float] | None, info: ValidationInfo) -> dict[str, float] | None:
        if weights is not None:
            if not weights:
                raise ValueError("name at least one reward, e.g. reward.exact_answer=1.0, or leave it unset")
            if _imports_rewards(info):
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
        check_length_bands(runtime.length_bands, self.max_new_tokens, "runtime.length_bands", "max_new_tokens")
        return self

    @model_validator(mode="after")
    def _task_base_model(self) -> "LMTrainConfig":
        """No checkpoint given: the task's shipped base model. A checkpoint whose config.json names another task is
        refused: a model reads only the prompts of the task it learned (`models.lm.LMConfig.task`)."""
        if self.model.checkpoint is None:
            self.model.checkpoint = PACKAGE_ROOT / "assets" / f"{self.task}-lm"
        learned = _json_or_empty(self.model.checkpoint / "config.json").get("task")
        if isinstance(learned, str) and learned != self.task:
            raise ValueError(
                f"model.checkpoint={clip(str(self.model.checkpoint))} is a model of task {clip(repr(learned))}, not "
                f"task={self.task}: set task={clip(learned)}, or give a {self.task} model (`dovetail pretrain "
                f"{self.task} --out NEW_DIR` makes one)"
            )
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


def _kind_of(entry) -> str | None:
    """The entry's tag; None (an error naming the entry) for a kind that is not even a string."""
    kind = entry.get("kind", "flow") if isinstance(entry, dict) else entry.kind
    return kind if isinstance(kind, str) else None


PipelineConfig = Annotated[
    Annotated[FlowTrainConfig, Tag("flow")] | Annotated[LMTrainConfig, Tag("lm")], Discriminator(_kind_of)
]
"""One pipeline's run config: `kind: flow` (the default) or `kind: lm`."""


class MultiplexTrainSection(Section):
    steps: int = Field(50, ge=1, le=MAX_STEPS, description="RL steps of every pipeline")


class MultiplexConfig(Section):
    """Several RL pipelines multiplexed on one pool of devices (JigsawRL). Each entry of `pipelines` is a flow or lm
    run config of its own — model, algorithm, reward, prompts, batch, optimizer, eval, checkpoints, `name`,
    `priority` — and trains its own weights into its own run sub-directory; the cluster, the policy and the number
    of steps are the run's (an entry may repeat them, not change them)."""

    kind: Literal["multiplex"]
    policy: Literal[MULTIPLEXING_POLICIES] = "jigsaw"
    train: MultiplexTrainSection = MultiplexTrainSection()
    cluster: ClusterSection = ClusterSection()
    pipelines: list[PipelineConfig] = Field(
        min_length=1, max_length=MAX_PIPELINES, description="the pipelines; split more over several runs"
    )

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


STAGED_BASELINE = {"flow": "colocated", "llm": "verl-sync"}
"""What the planner simulates for a `reference` run, which schedules nothing: its kind's stage-after-stage policy."""


def _scenario(config: TrainConfig, pipelines: list[dict], steps: int, trainer_devices: int | None, reward_devices: int):
    return parse_scenario(
        {
            "name": f"train-{config.pipeline_name}-{config.policy}",
            "cluster": {"device": config.cluster.device, "devices": config.cluster.devices},
            "pipelines": pipelines,
            "schedule": {
                # what `dovetail simulate` of this scenario would run; a run passes its own steps to `prepare`
                "steps": min(steps, MAX_SIMULATED_STEPS),
                "policies": [config.policy if config.policy in POLICIES else STAGED_BASELINE[pipelines[0]["kind"]]],
                "trainer_devices": trainer_devices,
                "reward_devices": reward_devices,
            },
        },
        "training config",
    )


class ConfigError(ValueError):
    """An invalid config: the message names each bad field, or the file, and what it allows."""


def _invalid(*problems: str) -> ConfigError:
    return ConfigError(problem_report("invalid config", list(problems)))


def apply_override(tree: dict[str, Any], override: str) -> None:
    shown = clip(repr(override))
    dotted, equals, raw = override.partition("=")
    path = dotted.strip().split(".")
    if not equals or not all(path):
        raise ConfigError(f"override {shown} must look like section.field=value, e.g. train.lr=1e-4")
    *parents, leaf = path
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {shown}: {clip(repr(key))} is a value, not a section")
    try:
        node[leaf] = parse_yaml(raw, f"override {shown}")
    except ValueError as error:
        raise ConfigError(str(error)) from None


def load_config(path: Path | str | None = None, overrides: list[str] = (), *, rewards: bool = True) -> TrainConfig:
    """The run config of a YAML file (None, or an empty file: the defaults) with dotted overrides applied; `rewards`
    as `parse_config`'s."""
    tree: Any = {}
    if path is not None:
        try:
            tree = read_yaml(Path(path))
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if tree is None:
            tree = {}
        if not isinstance(tree, dict):
            raise ConfigError(
                f"{path}: a config is a mapping of sections (algo:, train: ...), got {type(tree).__name__}"
            )
    for override in overrides:
        apply_override(tree, override)
    return parse_config(tree, rewards=rewards)


def parse_config(tree: Any, *, rewards: bool = True) -> TrainConfig:
    """A config tree (YAML's, or `model_dump(mode="json")`'s) as the run config of its `kind`. `rewards=False`: its
    rewards are not looked up, so a custom one's module is not imported; for a run directory's config read to replay
    or export what it trained (neither scores anything), which thereby runs none of its writer's code."""
    if not isinstance(tree, dict):
        raise _invalid(f"a config is a mapping of sections, got {type(tree).__name__}")
    kinds = {"flow": FlowTrainConfig, "lm": LMTrainConfig, "multiplex": MultiplexConfig}
    kind = tree.get("kind", "flow")
    if not isinstance(kind, str) or kind not in kinds:
        raise _invalid(f"kind: {clip(repr(kind))} is not a run kind; use one of {sorted(kinds)}")
    if kind == "multiplex":
        tree = _multiplexed(tree)
    try:
        return kinds[kind].model_validate(tree, context={"rewards": rewards})
    except ValidationError as error:
        raise _invalid(*problem_lines(error, hidden=("flow", "lm"))) from None


def _imports_rewards(info: ValidationInfo) -> bool:
    """Whether a config's rewards are looked up (and a custom one's module imported) as it is read: `parse_config`'s
    `rewards`."""
    return (info.context or {}).get("rewards", True)


RUN_WIDE = {"policy": "policy", "cluster": "cluster", "train.steps": "train.steps"}
"""What every pipeline of a multiplexed run shares: the run's (an entry may repeat it, not change it)."""


def _multiplexed(tree: dict) -> dict:
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
        raise _invalid("pipelines: a list of pipeline configs (mappings, each kind flow or lm)")
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
                raise _invalid(
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
        raise _invalid(f"{field}: a mapping of fields, e.g. {key}: {{steps: 50}} (got {clip(repr(section))})")
    return section


def _cluster(section: Any, field: str) -> ClusterSection:
    """A cluster section validated alone (an entry's may only repeat the run's, defaults filled in): what is wrong in
    it is named under `field`, not reported as a mismatch."""
    try:
        return ClusterSection.model_validate(section)
    except ValidationError as error:
        raise _invalid(*problem_lines(error, within=(field,))) from None


def ray_address(cluster: ClusterSection) -> str | None:
    """The Ray cluster a run joins: cluster.address, else $RAY_ADDRESS (as Ray's own tools read it), else None: a
    local instance of the run's own. Ray's current-cluster file (what `auto` reads) counts only where the config
    says `auto`, so a plain local run never joins a Ray head that happens to run on the machine."""
    if cluster.address is not None:
        return cluster.address
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if not address:
        return None
    try:
        return ClusterSection._ray_address(address)
    except ValueError as error:
        raise ConfigError(f"RAY_ADDRESS: {error}; or unset RAY_ADDRESS for a local run") from None


def check_this_machine(config: TrainConfig) -> None:
    """A local run (no cluster.address, no RAY_ADDRESS) of the Ray runtime has this machine's devices: as many CPU
    cores as this process may use (taskset / cgroups narrow them; device i is pinned to the i-th), or its CUDA GPUs.
    Checked when a run starts, never when a config is parsed: a dry run plans a GPU cluster from a laptop. Policy
    reference trains in this process and needs no cluster."""
    cluster = config.cluster
    if config.policy == "reference" or ray_address(cluster) is not None:
        return
    platform = device(cluster.device).platform
    if platform == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if cluster.devices > cores:
            raise ConfigError(
                f"cluster.devices={cluster.devices}: this machine has {cores} CPU cores for a local run; lower "
                "cluster.devices, or give cluster.address of a Ray cluster"
            )
    elif platform == "cuda":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if cluster.devices > gpus:
            raise ConfigError(
                f"cluster.device={cluster.device}: {cluster.devices} GPUs asked for, this machine has {gpus} for "
                "a local run; set cluster.device=cpu-core, lower cluster.devices, or give cluster.address of a Ray "
                "cluster"
            )


def dump_config(config: TrainConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
