"""The config of a GRPO run of a causal language model on a verifiable task (`kind: lm`): the task and its model,
sampling, the algorithm's knobs, evaluation, and how the Ray runtime cuts a step."""

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from dovetail.config.common import (
    MAX_PER_STEP,
    MAX_STEPS,
    PACKAGE_ROOT,
    REFERENCE,
    RewardWeights,
    RunSection,
    Section,
    Seed,
    imports_rewards,
    json_or_empty,
    planner_scenario,
)
from dovetail.cost.catalog import language_model
from dovetail.graph.spec import MAX_DEVICES, GroupSize, check_length_bands
from dovetail.rewards.text import text_reward_fn
from dovetail.scenario import Scenario, check_pools, clip
from dovetail.sched import POLICIES, policy_class
from dovetail.sched.policy import PolicyOptions
from dovetail.tasks import task


class LMModelSection(Section):
    checkpoint: Path | None = Field(
        None,
        strict=False,
        description="directory with model.safetensors, config.json, tokenizer.json; None: the task's base model",
    )
    cost_model: str = Field(
        "tiny-lm",
        max_length=100,
        description="the cost catalogue's language model the planner prices this one as before the run profiles it "
        "(e.g. Qwen3-8B): what a dry run on GPUs plans with",
    )

    @field_validator("cost_model")
    @classmethod
    def _known_cost_model(cls, name: str) -> str:
        language_model(name)
        return name


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
    policy: str = Field(REFERENCE, description="who schedules the step: `dovetail train --help` lists them")
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
            if imports_rewards(info):
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
        learned = json_or_empty(self.model.checkpoint / "config.json").get("task")
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

    def policy_options(self) -> PolicyOptions:
        return PolicyOptions()

    def scenario(self, steps: int) -> Scenario:
        """This run as the planner's scenario, without torch: response lengths are the task's ideal completions
        on a step's worth of training prompts (the base model's are near them; the run's profile corrects)."""
        problems = task(self.task).prompts("train", self.seed, 0, self.algo.prompts_per_step * self.algo.group_size)
        lengths = [min(self.max_new_tokens, len(task(self.task).solution(p)) + 1) for p in problems]
        pipeline = {
            "kind": "lm",
            "name": self.pipeline_name,
            "model": self.model.cost_model,
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
        if self.policy not in POLICIES or "recompute_logprob" not in policy_class(self.policy).fixes:
            # One optimizer step per batch: the trainer's own log-probs, detached, are the old ones (ratio 1), so
            # no separate pass recomputes them (TRL skips it; so does verl with one PPO epoch and mini-batch). A
            # policy whose recipe decides it (areal) keeps its own.
            pipeline["recompute_logprob"] = False
        return planner_scenario(self, [pipeline], steps, self.runtime.trainer_devices, 0)
