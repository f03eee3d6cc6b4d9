"""The config of a FlowGRPO / DanceGRPO run of a text-to-image flow model (`kind: flow`, the default): the built-in
digits model or a user's diffusers directory (`model.path`), its sampler, the algorithm's knobs and `algo.compat`
presets, prompts, evaluation, and how the Ray runtime cuts a step."""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import AliasChoices, Field, StringConstraints, ValidationInfo, field_validator, model_validator

from dovetail.config.common import (
    DEFAULT_CHECKPOINT,
    MAX_PER_STEP,
    MAX_STEPS,
    REFERENCE,
    RewardWeights,
    RunSection,
    Section,
    Seed,
    TrainSection,
    hub_snapshot,
    imports_rewards,
    is_dir,
    is_file,
    json_or_empty,
    model_dir_name,
    planner_scenario,
    refuse_sharded_adapter,
)
from dovetail.cost.catalog import diffusion_model
from dovetail.graph.spec import MAX_DEVICES, MAX_SAMPLES, GroupSize
from dovetail.plan.scenario import Scenario, check_pools
from dovetail.rewards import check_reward_names
from dovetail.sched.policy import PolicyOptions, Tag

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
        "prompt_embeds.safetensors; or a hub id (stabilityai/stable-diffusion-3.5-medium) already in the local "
        "Hugging Face cache",
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
            is_file(checkpoint / "model_index.json") or is_file(checkpoint / "transformer" / "config.json")
        ):
            raise ValueError(f"{checkpoint} is a diffusers directory: give it as model.path")
        if checkpoint is not None and "_class_name" in json_or_empty(checkpoint / "config.json"):
            raise ValueError(
                f"{checkpoint} is a diffusers model directory: give the directory that holds it as transformer/ "
                "as model.path"
            )
        return checkpoint

    @field_validator("path")
    @classmethod
    def _diffusers_layout(cls, path: Path | None) -> Path | None:
        path = None if path is None else hub_snapshot(path)
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
        vae_dir = self.path / "vae" if self.path is not None else None
        vae = json_or_empty(vae_dir / "config.json") if vae_dir is not None else {}
        if vae.get("_class_name") != "AutoencoderKLWan":
            if self.frames not in (None, 1):
                raise ValueError(f"model.frames={self.frames}: model.frames is a video model's (Wan's); remove it")
            self.frames = 1
            return self
        stride, self.frames = vae.get("scale_factor_temporal") or 4, self.frames or 81
        if (self.frames - 1) % stride:
            fit = (self.frames - 1) // stride * stride + 1
            raise ValueError(
                f"model.frames={self.frames}: {vae_dir} makes 1 + a multiple of {stride} frames; set "
                f"model.frames={fit} or {fit + stride}"
            )
        self.sample_size = self.sample_size or 480 // (vae.get("scale_factor_spatial") or 8) // 2 * 2
        return self


def diffusers_layout_problem(path: Path) -> str | None:
    """What a `model.path` directory lacks, in one line naming it; None when the model can load from it."""
    if not is_dir(path):
        return f"{path} is not a directory; give a diffusers pipeline directory (save_pretrained layout)"
    transformer = json_or_empty(path / "transformer" / "config.json")
    if not transformer:
        return f"{path} has no transformer/config.json: not a diffusers pipeline directory (save_pretrained layout)"
    if transformer.get("_class_name") not in DIFFUSERS_TRANSFORMERS:
        return (
            f"{path / 'transformer'} holds a {transformer.get('_class_name')!r}; model.path loads "
            f"{', '.join(DIFFUSERS_TRANSFORMERS)}"
        )
    index = json_or_empty(path / "model_index.json")
    if not index and not is_file(path / "prompt_embeds.safetensors"):
        return f"{path} has neither model_index.json with text encoders nor prompt_embeds.safetensors"
    for name, entry in index.items():
        if isinstance(entry, list) and entry[:1] != [None] and not is_dir(path / name):
            return f"{path / 'model_index.json'} lists {name}, and {path} has no {name}/"
    if not is_dir(path / "vae") and transformer.get("in_channels") not in (1, 3):
        return f"{path} has no vae/ to decode the transformer's {transformer.get('in_channels')}-channel latents"
    if transformer["_class_name"] == "WanTransformer3DModel":
        vae = json_or_empty(path / "vae" / "config.json").get("_class_name")
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
    guidance_scale: float = Field(
        1.0,
        ge=0,
        le=100,
        description="classifier-free guidance s of a model.path run: the velocity v_neg + s (v - v_neg), v_neg on "
        "negative_prompt, in rollouts, training and evaluation alike (Flow-GRPO samples SD3.5 at 4.5); 1.0: none. "
        "Not model.guidance, a guidance-distilled FLUX's embedded guidance",
    )
    negative_prompt: str = Field(
        "", max_length=10_000, description="the unconditional branch's prompt of classifier-free guidance"
    )


CompatPreset = Literal["dovetail", "flow_grpo", "flow_grpo_fast", "dance_grpo", "verl_omni"]
COMPAT_PRESETS: tuple[str, ...] = get_args(CompatPreset)


class SDEWindowSection(Section):
    """MixGRPO's sliding window (`algo.sliding_window`): the steps sampled by the SDE and trained, ODE elsewhere."""

    size: int = Field(ge=1, le=1000, description="steps of the window (MixGRPO's scripts: 4)")
    shift_every: int = Field(
        ge=1, le=MAX_STEPS, description="RL steps between two moves of the window (MixGRPO's iters_per_group: 25)"
    )
    stride: int = Field(1, ge=1, le=1000, description="steps the window moves by (MixGRPO's prog_overlap_step: 1)")


class NFTSection(Section):
    """DiffusionNFT's knobs (algorithm diffusion_nft; docs/flow_algorithms.md), upstream's defaults."""

    beta: float = Field(
        1.0,
        gt=0,
        le=100,
        description="guidance strength of the implicit policies v+- = v_old +- beta (v_theta - v_old) (upstream's "
        "config.beta: 1.0, its OCR run 0.1)",
    )
    decay_flat: int = Field(
        0, ge=0, le=MAX_STEPS, description="optimizer steps during which the old policy is the weights (decay 0)"
    )
    decay_rate: float = Field(
        0.001, ge=0, le=1, description="the old policy's decay grows by this each optimizer step after decay_flat"
    )
    decay_max: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="the old policy's decay at most: old <- d old + (1 - d) theta after each step (upstream's "
        "decay_type 1: 0, 0.001, 0.5; type 2: 75, 0.0075, 0.999; type 0: rate 0, max 0)",
    )


class AlgoSection(Section):
    prompts_per_step: int = Field(8, ge=1, le=MAX_PER_STEP, description="B: prompts per step")
    group_size: GroupSize = Field(8, le=MAX_PER_STEP, description="G: samples per prompt")
    timestep_fraction: float = Field(0.5, gt=0, le=1, description="share of the K-1 trainable steps trained")
    clip_range: float = Field(1e-4, gt=0, le=1, description="PPO clip of the ratio: 1 +- clip_range")
    num_iterations: int = Field(
        1,
        ge=1,
        le=64,
        description="optimizer updates on each generated batch (Flow-GRPO's train.num_inner_epochs, TRL's "
        "num_iterations): each over the whole batch, the old log-probs the rollout's, so from the second the clip acts",
    )
    beta: float = Field(0.0, ge=0, le=100, description="weight of the KL to the base model")
    std_scope: Literal["group", "global", "none"] = "group"
    adv_clip: float = Field(5.0, gt=0, le=1000, description="clip of the (standardised) advantages")
    stale_max_weight: float = Field(
        2.0, ge=1, le=1000, description="truncation of pi_prox/pi_behaviour for TCSS's stale samples"
    )
    compat: CompatPreset = Field(
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
    sde_window: SDEWindowSection | None = Field(
        None,
        description="MixGRPO: the SDE window slides from window_range's start, moving every shift_every steps (ODE "
        "outside it); sets timesteps=window and window_size=size. None: a window, if any, is drawn at random",
    )
    nft: NFTSection = Field(NFTSection(), description="DiffusionNFT's knobs (algorithm diffusion_nft)")
    ratio_normalization: bool = Field(
        False,
        description="GRPO-Guard: the ratio of each step normalised to an unbiased log-ratio on one scale at every "
        "timestep (algo.flow_grpo_loss); the Flow-GRPO SDE only",
    )

    @model_validator(mode="after")
    def _window_slides(self) -> "AlgoSection":
        """algo.sde_window is a window of algo.timesteps=window whose start is a function of the step."""
        window = self.sde_window
        if window is None:
            return self
        if self.timesteps not in (None, "window"):
            raise ValueError(f"algo.sde_window trains its window: leave algo.timesteps (now {self.timesteps}) unset")
        if self.window_size not in (None, window.size):
            raise ValueError(
                f"algo.window_size={self.window_size}: algo.sde_window.size={window.size} is the window's; leave "
                "algo.window_size unset"
            )
        self.timesteps, self.window_size = "window", window.size
        return self


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


class FlowTrainSection(TrainSection):
    chunk_size: int = Field(
        128, ge=1, le=MAX_SAMPLES, description="(sample, timestep) pairs per batched forward/backward"
    )


class EMASection(Section):
    """Flow-GRPO's EMA (`algo.WeightEMA`): its train_sd3.py uses decay 0.9, an update every 8 optimizer steps."""

    decay: float = Field(0.9, gt=0, lt=1, description="the EMA's decay (warmed up as min(decay, (1+n)/(10+n)))")
    every: int = Field(8, ge=1, le=MAX_STEPS, description="update after optimizer step n where (n + 1) % every == 0")


class EvalSection(Section):
    every: int = Field(25, ge=1, le=MAX_STEPS, description="evaluate every N steps (and at the start and end)")
    per_prompt: int = Field(
        8,
        ge=1,
        le=1000,
        validation_alias=AliasChoices("per_prompt", "per_digit"),
        description="held-out ODE samples per eval prompt: each digit's, or each of prompts.eval_prompts (at most "
        "1000: every eval generates them all); `per_digit`, its name before prompts files, still reads",
    )
    seed: Seed = 10_000
    ema: EMASection | None = Field(
        None,
        description="evaluate an exponential moving average of the trained weights (Flow-GRPO's train.ema), saved "
        "as ema.safetensors beside each checkpoint's weights; None: the weights themselves",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_name(cls, data):
        """`per_digit` is per_prompt's former name (kept so older configs and checkpoints load): not both at once."""
        if isinstance(data, dict) and {"per_prompt", "per_digit"} <= data.keys():
            raise ValueError("per_digit is per_prompt's former name: give per_prompt alone")
        return data


class PromptsSection(Section):
    """The run's prompts from a file or dataset (dovetail.prompts): one per line (.txt), a field of JSON lines
    (.jsonl), of a JSON list (.json), of a table `datasets` reads (.parquet, .csv, .arrow), of a dataset directory or
    a hub dataset id the local cache holds (docs/datasets.md; `split` one of its splits); split into train and eval
    by a hash of each prompt's text (eval_fraction), or the eval prompts from a file of their own (eval_path)."""

    path: Path = Field(
        strict=False, description="the prompts file, a dataset directory, or a hub dataset id in the local cache"
    )
    split: str | None = Field(
        None, min_length=1, max_length=200, description="the split of a dataset of several (e.g. train)"
    )
    field: str = Field("prompt", min_length=1, max_length=200, description="the prompt's field in a record")
    eval_fraction: float | None = Field(
        None, gt=0, lt=1, description="share of the prompts held out for evaluation; None: 0.1 (without eval_path)"
    )
    eval_path: Path | None = Field(None, strict=False, description="eval prompts' file; then every prompt trains")
    eval_split: str | None = Field(
        None, min_length=1, max_length=200, description="eval_path's split (e.g. test); None: its only split"
    )
    eval_prompts: int = Field(16, ge=1, le=1000, description="held-out prompts each evaluation samples")

    @field_validator("path", "eval_path")
    @classmethod
    def _a_file(cls, path: Path | None) -> Path | None:
        if path is not None:
            path = hub_snapshot(path, "dataset")
        if path is not None and not (is_file(path) or is_dir(path)):
            raise ValueError(f"no prompts file {path}")
        return path

    @model_validator(mode="after")
    def _one_eval_split(self) -> "PromptsSection":
        if self.eval_path is not None and self.eval_fraction is not None:
            raise ValueError("prompts: give prompts.eval_fraction or prompts.eval_path, not both")
        if self.eval_path is None and self.eval_fraction is None:
            self.eval_fraction = 0.1
        if self.eval_split is not None and self.eval_path is None:
            raise ValueError("prompts.eval_split is eval_path's split: give prompts.eval_path too")
        return self


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


class FlowTrainConfig(RunSection):
    """A FlowGRPO / DanceGRPO / DiffusionNFT run of a text-to-image flow model."""

    kind: Literal["flow"] = "flow"
    algorithm: Literal["flow_grpo", "dance_grpo", "diffusion_nft"] = "flow_grpo"
    policy: str = Field(REFERENCE, description="who schedules the step: `dovetail train --help` lists them")
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
        if imports_rewards(info):
            check_reward_names(weights)
        if not weights:
            raise ValueError("name at least one reward, e.g. reward.digit_match=1.0")
        return weights

    @model_validator(mode="after")
    def _shards_whole_models(self) -> "FlowTrainConfig":
        refuse_sharded_adapter(self.train, self.model.lora)
        return self

    @model_validator(mode="after")
    def _apply_compat(self) -> "FlowTrainConfig":
        """The `algo.compat` preset's values for every field the config leaves unset; a field it sets otherwise is
        the user's choice, except an algorithm the preset's upstream does not have."""
        preset = self.algo.compat
        for dotted, value in COMPAT[preset].items():
            section, _, field = dotted.rpartition(".")
            holder = getattr(self, section) if section else self
            if field == "cps_log_prob" and flow_rules(self).sde_kind != "cps":
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
        if self.sampling.cps_log_prob != "gaussian" and flow_rules(self).sde_kind != "cps":
            raise ValueError(
                f"sampling.cps_log_prob={self.sampling.cps_log_prob} applies to the cps SDE only; set "
                "sampling.sde_kind=cps or leave sampling.cps_log_prob unset"
            )
        return self

    @model_validator(mode="after")
    def _guidance_needs_a_model_path(self) -> "FlowTrainConfig":
        """The built-in digits model learned no unconditional prompt (no prompt dropout): guidance would extrapolate
        from an encoding it never saw."""
        sampling = self.sampling
        if sampling.guidance_scale != 1.0 and self.model.path is None:
            raise ValueError(
                f"sampling.guidance_scale={sampling.guidance_scale}: the built-in digits model has no unconditional "
                "prompt to guide with; leave it 1.0, or give a diffusers pipeline as model.path"
            )
        if sampling.negative_prompt and sampling.guidance_scale == 1.0:
            raise ValueError(
                "sampling.negative_prompt applies to classifier-free guidance only; set sampling.guidance_scale "
                "(e.g. 4.5) or leave sampling.negative_prompt unset"
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
    def _new_algorithms_fit(self) -> "FlowTrainConfig":
        """The sliding window is one per step, and GRPO-Guard's normalisation is of the Flow-GRPO SDE's steps."""
        algo = self.algo
        if algo.sde_window is not None and algo.per_sample_timesteps:
            raise ValueError(
                "algo.sde_window slides one window a step for every sample; algo.per_sample_timesteps (set by "
                "algo.compat=dance_grpo) draws each sample's own: set algo.per_sample_timesteps=false"
            )
        if algo.ratio_normalization and flow_rules(self).sde_kind != "flow_grpo":
            raise ValueError(
                "algo.ratio_normalization (GRPO-Guard) normalises the Flow-GRPO SDE's steps; use algorithm flow_grpo "
                "with sampling.sde_kind=flow_grpo"
            )
        if algo.num_iterations > 1 and (algo.ratio_normalization or self.train.sharding == "fsdp"):
            raise ValueError(
                f"algo.num_iterations={algo.num_iterations}: one update a batch yet with "
                f"{'algo.ratio_normalization' if algo.ratio_normalization else 'train.sharding: fsdp'} (its old "
                "policy is the weights being trained); set algo.num_iterations=1"
            )
        if algo.num_iterations > 1 and self.policy == "digen+tcss":
            raise ValueError(
                f"algo.num_iterations={algo.num_iterations}: digen+tcss trains stale samples against the weights being "
                "trained; use digen, or algo.num_iterations=1"
            )
        return self

    @model_validator(mode="after")
    def _diffusion_nft_fits(self) -> "FlowTrainConfig":
        """DiffusionNFT trains each sample at its own random subset of the schedule's timesteps, int(K * 0.99) of
        all K by default (upstream's timestep_fraction 0.99), on one update a batch after which the old policy
        moves; its old policy is a whole copy of the weights, as the EMA is."""
        if self.algorithm != "diffusion_nft":
            return self
        algo = self.algo
        for field, value in (("timestep_fraction", 0.99), ("timestep_rounding", "floor"), ("timestep_pool", "all")):
            if field not in algo.model_fields_set:
                setattr(algo, field, value)
        refused = {
            "algo.timesteps": algo.timesteps is not None,
            "algo.sde_window": algo.sde_window is not None,
            "algo.ratio_normalization": algo.ratio_normalization,
            "algo.num_iterations": algo.num_iterations > 1,
            "train.sharding=fsdp": self.train.sharding == "fsdp",
        }
        for field, set_ in refused.items():
            if set_:
                raise ValueError(
                    f"{field}: algorithm diffusion_nft trains its own random timesteps per sample, one update a "
                    "step, beside a whole copy of the weights (its old policy); leave it unset"
                )
        return self

    @model_validator(mode="after")
    def _timesteps_fit(self) -> "FlowTrainConfig":
        """The trained steps exist: a count between 1 and K - 1, a window inside the trainable steps."""
        algo, trainable = self.algo, self.sampling.num_steps - 1
        if _timestep_mode(self) == "window":
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
        elif not 1 <= (trained := flow_rules(self).trained_timesteps) <= trainable:
            hint = " (Flow-GRPO's own configs use 0.99)" if algo.timestep_pool == "all" else ""
            raise ValueError(
                f"algo.timestep_fraction={algo.timestep_fraction} trains {trained} of "
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

    def scenario(self, steps: int) -> Scenario:
        """This run as the planner's scenario: the graph the simulator would schedule, built without torch."""
        trained = flow_rules(self).trained_timesteps
        pipeline = {
            "kind": "flow",
            "name": self.pipeline_name,
            "model": self.model.cost_model,
            "algorithm": self.algorithm,
            "prompts": self.algo.prompts_per_step,
            "updates": self.algo.num_iterations,
            "group": self.algo.group_size,
            "denoising_steps": self.sampling.num_steps,
            "trained_timesteps": trained,
            "height": self.image_size,
            "width": self.image_size,
            "frames": self.model.frames,
            "cfg": self.sampling.guidance_scale != 1.0,  # two transformer passes a step, rollout and training alike
            "reward": "rule",
            "generation_batch": "fragment",  # the engine denoises a whole rollout piece in one batch
            # train.chunk_size (sample, timestep) pairs share one forward/backward
            "micro_batch": max(1, self.train.chunk_size // trained),
            "fsdp_precision": self.train.precision,  # the dtype a sharded trainer's passes gather, as the run trains
            "priority": self.priority,
            "lora": self.lora_spec,
        }
        return planner_scenario(self, [pipeline], steps, self.runtime.trainer_devices, self.runtime.reward_devices)

    @property
    def pipeline_name(self) -> str:
        """The name, else the model directory's, else the built-in model's `digits`."""
        if self.name is not None:
            return self.name
        return "digits" if self.model.path is None else model_dir_name(self.model.path)

    @property
    def image_size(self) -> int:
        """Pixels a side of the images: the built-in model's 8, or model.path's transformer sample size times its
        VAE's scale (read from their config.json, without torch)."""
        if self.model.path is None:
            return 8
        transformer = json_or_empty(self.model.path / "transformer" / "config.json")
        vae = json_or_empty(self.model.path / "vae" / "config.json")
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

    def policy_options(self) -> PolicyOptions:
        return PolicyOptions(tag=Tag(self.runtime.tag))


@dataclass(frozen=True)
class FlowRules:
    """What the algorithm makes of a flow run's sampling and algo sections: the SDE, which timesteps train, how
    groups start, the loss normaliser. One place derives them, torch-free (the planner's scenario needs
    `trained_timesteps`); the schema keeps only the fields a user sets, and each user builds the rules once."""

    noise_level: float
    """sampling.noise_level, else the algorithm's: DanceGRPO's eta 0.5, Flow-GRPO's a = 1.0."""
    sde_kind: str
    """DanceGRPO's own constant-eta SDE, else sampling.sde_kind."""
    timestep_mode: str
    """algo.timesteps, else the algorithm's: Flow-GRPO trains the first (noisiest) steps, DanceGRPO a random
    subset."""
    shared_group_noise: bool
    """DanceGRPO starts every sample of a group from the same initial noise."""
    trained_timesteps: int
    """Timesteps a step trains per sample: `algo.select_train_timesteps`'s count, without torch (a test pins the two
    equal)."""
    pairs_per_step: int
    """(sample, timestep) pairs a step trains: the loss normaliser, whoever splits the step."""


def flow_rules(config: FlowTrainConfig) -> FlowRules:
    """The config's rules, computed afresh (a few comparisons: the validators ask while a preset is still being
    applied, so nothing is cached on the mutable config); a long-lived user keeps the result."""
    algorithm, sampling, algo = config.algorithm, config.sampling, config.algo
    dance = algorithm == "dance_grpo"
    noise_level = sampling.noise_level if sampling.noise_level is not None else 0.5 if dance else 1.0
    timestep_mode = _timestep_mode(config)
    trainable = sampling.num_steps - 1
    if timestep_mode == "window":
        assert algo.window_size is not None  # the window validator requires it under timesteps=window
        trained = algo.window_size
    else:
        size = sampling.num_steps if algo.timestep_pool == "all" else trainable
        if algo.timestep_rounding == "floor":
            trained = int(size * algo.timestep_fraction)
        else:
            trained = max(1, min(trainable, math.ceil(algo.timestep_fraction * size - 1e-9)))
    return FlowRules(
        noise_level=noise_level,
        sde_kind="dance_grpo" if dance else sampling.sde_kind,
        timestep_mode=timestep_mode,
        shared_group_noise=dance,
        trained_timesteps=trained,
        pairs_per_step=algo.prompts_per_step * algo.group_size * trained,
    )


def _timestep_mode(config: FlowTrainConfig) -> str:
    """`FlowRules.timestep_mode`, alone: the window validator asks it before the window's size is known good."""
    if config.algo.timesteps is not None:
        return config.algo.timesteps
    return "random" if config.algorithm in ("dance_grpo", "diffusion_nft") else "prefix"
