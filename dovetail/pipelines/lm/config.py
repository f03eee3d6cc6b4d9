"""The config of a GRPO run of a causal language model (`kind: lm`): a built-in verifiable task and its model, or a
user's transformers model (`model.path`) on their dataset (`prompts.path`) with their rewards; sampling, the
algorithm's knobs, evaluation, and how the Ray runtime cuts a step."""

import re
from importlib.util import find_spec
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from dovetail.config.common import (
    AUTO,
    MAX_PER_STEP,
    MAX_STEPS,
    PACKAGE_ROOT,
    REFERENCE,
    RewardWeights,
    RunSection,
    Section,
    Seed,
    hub_snapshot,
    imports_rewards,
    is_dir,
    is_file,
    json_or_empty,
    model_dir_name,
    planner_scenario,
    refuse_sharded_adapter,
)
from dovetail.cost.catalog import device, language_model, language_model_of_config
from dovetail.envs import check_options, environment_class
from dovetail.envs.contract import Latency
from dovetail.envs.toolcalls import convention
from dovetail.graph.spec import MAX_DEVICES, GroupSize, check_length_bands
from dovetail.plan.scenario import Scenario, check_pools, clip
from dovetail.rewards import MODEL_REWARDS, SERVED_REWARD
from dovetail.rewards.text import DEFAULT_FORMAT, text_reward_fn
from dovetail.sched.policy import PolicyOptions
from dovetail.tasks import task

FROM_CONFIG = "config.json"
"""`model.cost_model` of a `model.path` run that names no catalogue entry: the planner prices the model from its
directory's config.json (parameters, layers, widths, vocabulary)."""

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""What holds a transformers directory's weights (`save_pretrained`'s files, whole or sharded)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""What a transformers directory's tokenizer leaves (any one: the fast tokenizer's, its config, sentencepiece's)."""


class LMLoraSection(Section):
    """A peft LoRA adapter on the language model's linear layers: only the adapter trains, is published and
    checkpointed."""

    rank: int = Field(8, ge=1, le=1024, description="r: the adapter's rank")
    alpha: float | None = Field(None, gt=0, le=10_000, description="lora_alpha (scale alpha / rank); None: rank")
    target_modules: Literal["all-linear"] | list[Annotated[str, StringConstraints(min_length=1, max_length=200)]] = (
        Field(
            "all-linear",
            min_length=1,
            max_length=64,
            description="all-linear (every linear layer but the output head), or the names (suffixes) of the layers "
            "that get an adapter, e.g. [q_proj, v_proj]",
        )
    )


class LMModelSection(Section):
    checkpoint: Path | None = Field(
        None,
        strict=False,
        description="a built-in task model's directory (model.safetensors, config.json, tokenizer.json); None: the "
        "task's base model",
    )
    path: Path | None = Field(
        None,
        strict=False,
        description="your own transformers causal LM: a directory in save_pretrained layout (config.json, weights, "
        "tokenizer), or a hub id (Qwen/Qwen2.5-0.5B) already in the local Hugging Face cache; it trains on "
        "prompts.path",
    )
    lora: LMLoraSection | None = Field(None, description="train a LoRA adapter of model.path instead of every weight")
    cost_model: str = Field(
        "tiny-lm",
        max_length=100,
        description="the cost catalogue's language model the planner prices this one as before the run profiles it "
        f"(e.g. Qwen3-8B): what a dry run on GPUs plans with; a model.path run's default, {FROM_CONFIG}, reads the "
        "model's own shape from its config.json",
    )

    @field_validator("cost_model")
    @classmethod
    def _known_cost_model(cls, name: str) -> str:
        if name != FROM_CONFIG:
            language_model(name)
        return name

    @field_validator("path")
    @classmethod
    def _transformers_layout(cls, path: Path | None) -> Path | None:
        if path is None:
            return None
        path = hub_snapshot(path)
        problem = transformers_layout_problem(path)
        if problem:
            raise ValueError(problem)
        return path.resolve()

    @field_validator("checkpoint")
    @classmethod
    def _builtin_format(cls, checkpoint: Path | None) -> Path | None:
        if checkpoint is not None and "model_type" in json_or_empty(checkpoint / "config.json"):
            raise ValueError(f"{checkpoint} is a transformers model directory: give it as model.path")
        return checkpoint

    @model_validator(mode="after")
    def _one_model(self) -> "LMModelSection":
        if self.path is not None and self.checkpoint is not None:
            raise ValueError("model: give model.path (a transformers directory) or model.checkpoint, not both")
        if self.lora is not None and self.path is None:
            raise ValueError("model.lora: LoRA trains your own model; give its directory as model.path")
        if self.path is not None and "cost_model" not in self.model_fields_set:
            self.cost_model = FROM_CONFIG
        if self.cost_model == FROM_CONFIG and self.path is None:
            raise ValueError(f"model.cost_model={FROM_CONFIG} prices a model.path run's model; name a catalogue model")
        return self


def transformers_layout_problem(path: Path) -> str | None:
    """What a `model.path` directory lacks, in one line naming it; None when a causal LM can load from it."""
    if not is_dir(path):
        return f"{path} is not a directory; give a transformers model directory (save_pretrained layout)"
    config = json_or_empty(path / "config.json")
    if "model_type" not in config:
        if is_file(path / "model_index.json"):
            return f"{path} is a diffusers pipeline: a kind: flow run's model.path"
        return f"{path} has no config.json with a model_type: not a transformers model directory (save_pretrained)"
    if not any(is_file(path / name) for name in WEIGHT_FILES):
        return f"{path} has no weights ({' or '.join(WEIGHT_FILES[::2])}): save the model there with save_pretrained"
    if not any(is_file(path / name) for name in TOKENIZER_FILES):
        return f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)}): save it there with tokenizer.save_pretrained"
    return None


class LMPromptsSection(Section):
    """A dataset's rows (dovetail.prompts.read_records): JSON lines (.jsonl), a JSON list (.json), a table
    (.parquet, .csv, .arrow), a directory `datasets` `save_to_disk` wrote or of data files named by split, or a hub
    dataset id the local cache holds; `split` picks one of several splits (docs/datasets.md). `prompt_field` holds
    the prompt (text, or a list of chat messages the tokenizer's chat template renders); every other column goes to
    the rewards by name. Split into train and eval by a hash of each prompt (eval_fraction), or the eval rows from a
    file of their own (eval_path)."""

    path: Path = Field(
        strict=False,
        description="the dataset file, a directory (save_to_disk's, or data files by split), or a hub dataset id "
        "already in the local Hugging Face cache",
    )
    split: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="the split a dataset of several splits trains on (e.g. train); None: its only split",
    )
    eval_split: str | None = Field(
        None, min_length=1, max_length=200, description="eval_path's split (e.g. test); None: its only split"
    )
    prompt_field: str = Field("prompt", min_length=1, max_length=200, description="the column holding the prompt")
    eval_fraction: float | None = Field(
        None, gt=0, lt=1, description="share of the rows held out for evaluation; None: 0.1 (without eval_path)"
    )
    eval_path: Path | None = Field(None, strict=False, description="the eval rows' file; then every row trains")
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=131_072,
        description="longest prompt in tokens: a longer one keeps its last max_tokens (left truncation, as TRL); "
        "None: every prompt must fit the model's context with sampling.max_new_tokens",
    )

    @field_validator("path", "eval_path")
    @classmethod
    def _exists(cls, path: Path | None) -> Path | None:
        if path is not None:
            path = hub_snapshot(path, "dataset")
        if path is not None and not (is_file(path) or is_dir(path)):
            raise ValueError(f"no dataset file {path}")
        return None if path is None else path.resolve()

    @model_validator(mode="after")
    def _one_eval_split(self) -> "LMPromptsSection":
        if self.eval_path is not None and self.eval_fraction is not None:
            raise ValueError("prompts: give prompts.eval_fraction or prompts.eval_path, not both")
        if self.eval_path is None and self.eval_fraction is None:
            self.eval_fraction = 0.1
        if self.eval_split is not None and self.eval_path is None:
            raise ValueError("prompts.eval_split is eval_path's split: give prompts.eval_path too")
        return self


MIN_TEMPERATURE = 1e-30
"""The least sampling temperature: the trainer divides its fp32 logits by it, and below fp32's smallest normal number
(1.2e-38) every quotient is infinite and the log-probs NaN (the next step then samples from NaN weights); 1e-30
keeps logits up to 3e8 finite. So small a temperature samples greedily, as a tiny top_p does."""


WHOLE_BATCH_ADVANTAGES = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")
"""`algo.advantage`s whose statistics span the whole step (`algo.advantages.AdvantageEstimator.whole_batch`)."""


USER_MAX_NEW_TOKENS = 256
"""A `model.path` run's default response budget (TRL's max_completion_length)."""


def engine_matches_trainer(engine: str) -> bool:
    """Whether a rollout engine (`sampling.engine`; `models.causal_lm.ROLLOUT_ENGINES` builds each) records the
    trainer's log-probs (up to fp32 rounding, tested): ours and transformers' forward compute what the trainer
    computes; vLLM's kernels do not, so its pipelines recompute the old log-probs in the trainer (verl's
    recompute_logprob) and report the engine / trainer gap (`logprob_gap`)."""
    return engine != "vllm"


class LMSamplingSection(Section):
    engine: Literal["auto", "dovetail", "vllm", "hf"] = Field(
        "auto",
        description="who generates rollouts: auto (vllm on GPUs where vLLM is installed, else dovetail), dovetail "
        "(our engine; CPU or GPU), vllm (vLLM's engine: a GPU, or its CPU build via make test-vllm), hf (transformers' "
        "forward)",
    )
    temperature: float = Field(1.0, gt=0, le=100, description="beyond 100 every token is as likely")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        le=4096,
        description=f"None: the task's longest ideal completion + a margin; {USER_MAX_NEW_TOKENS} for a model.path run",
    )
    stop: list[Annotated[str, StringConstraints(min_length=1, max_length=100)]] = Field(
        default_factory=list,
        max_length=16,
        description="strings that end a response (a model.path run's): it ends with the token that completes one, "
        "whose text the reward sees",
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


GSPO_CLIPS = (3e-4, 4e-4)
"""GSPO's (clip_low, clip_high) on its sequence-level ratio (arXiv 2507.18071, section 5.1; verl's GSPO recipe): a
geometric mean of token ratios moves far less than one token's, so its clip is two orders tighter."""


class LMAlgoSection(Section):
    prompts_per_step: int = Field(16, ge=1, le=MAX_PER_STEP, description="B: prompts per step")
    group_size: GroupSize = Field(8, le=MAX_PER_STEP, description="G: responses per prompt")
    micro_batches: int = Field(
        2, ge=1, le=MAX_PER_STEP, description="train micro-batches per step (whole prompt groups each)"
    )
    advantage: Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"] = Field(
        "grpo",
        description="the advantage estimator (docs/algorithms.md): grpo (group-normalised), rloo (leave-one-out "
        "baseline), reinforce_plus_plus (batch-whitened rewards), reinforce_plus_plus_baseline (group mean "
        "subtracted, then batch-whitened), gae (PPO with a critic: per-token GAE from the critic's values; needs the "
        "critic section)",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="gae's discount per token (verl's algorithm.gamma)")
    lam: float = Field(1.0, ge=0, le=1, description="gae's lambda (verl's algorithm.lam)")
    loss: Literal["ppo_clip", "gspo"] = Field(
        "ppo_clip",
        description="the clipped ratio: ppo_clip (per token) or gspo (per sequence; its clips default to "
        f"{GSPO_CLIPS[0]:g} / {GSPO_CLIPS[1]:g})",
    )
    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO clip below 1")
    clip_high: float = Field(0.28, ge=0, le=10, description="PPO clip above 1 (DAPO's clip-higher)")
    aggregation: Literal["token", "sequence", "drgrpo"] = Field(
        "token", description="token (DAPO), sequence (GRPO), drgrpo (Dr. GRPO: / (B x max_new_tokens))"
    )
    beta: float = Field(0.0, ge=0, le=100, description="weight of the KL to the base model")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="k1 (log ratio), k2 (its square / 2), k3")
    kl_in: Literal["loss", "reward"] = Field(
        "loss",
        description="where beta x KL goes: the loss (GRPO), or each response's reward, less beta x its tokens' summed "
        "KL estimate, before advantages (verl's use_kl_in_reward)",
    )
    entropy_coef: float = Field(0.0, ge=0, le=100)
    std_scope: Literal["group", "none"] = Field("group", description="none: Dr. GRPO's unscaled advantages (grpo)")
    adv_clip: float = Field(5.0, gt=0, le=1000, description="clip of the advantages")
    stale_max_weight: float = Field(
        2.0, ge=1, le=1000, description="truncation of pi_prox/pi_behaviour for stale samples"
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        le=4096,
        description="DAPO's overlong penalty: the last N tokens of max_new_tokens where the reward falls linearly to "
        "-overlong_penalty; 0: off",
    )
    overlong_penalty: float = Field(1.0, ge=0, le=100, description="the overlong penalty at max_new_tokens")
    rollout_correction: Literal["none", "tis", "mis"] | None = Field(
        None,
        description="weight for the rollout engine's log-prob mismatch, pi_trainer / pi_engine per token: tis "
        "(truncated at the cap), mis (tokens above the cap masked), none; None: tis on vLLM, none otherwise",
    )
    rollout_correction_cap: float = Field(2.0, ge=1, le=1000, description="C of tis / mis")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling: groups whose rewards are all equal are dropped and more prompts drawn "
        "until the step holds prompts_per_step informative groups (every policy; not an env run)",
    )
    dynamic_sampling_max_draws: int = Field(
        4, ge=1, le=100, description="with dynamic_sampling, batches of prompts a step draws at most"
    )
    num_iterations: int = Field(
        1,
        ge=1,
        le=64,
        description="optimizer updates on each generated batch (TRL's num_iterations, verl's ppo_epochs): each over "
        "the whole batch, the old log-probs the first update's, so from the second on the clipped ratio acts",
    )

    @model_validator(mode="after")
    def _gspo_clips(self) -> "LMAlgoSection":
        """GSPO's ratio is clipped with its own ranges unless the config names them."""
        if self.loss == "gspo":
            if "clip_low" not in self.model_fields_set:
                self.clip_low = GSPO_CLIPS[0]
            if "clip_high" not in self.model_fields_set:
                self.clip_high = GSPO_CLIPS[1]
        if self.std_scope != "group" and self.advantage != "grpo":
            raise ValueError(f"algo.std_scope={self.std_scope} scales grpo's advantages; set algo.advantage: grpo")
        return self


class LMCriticSection(Section):
    """PPO's critic (`algo.advantage: gae`): a value model of the policy's architecture with a scalar head, started
    from the policy's checkpoint with a fresh head (verl's critic), trained by its own AdamW beside the actor."""

    lr: float = Field(1e-5, gt=0, le=1, description="the critic's Adam learning rate (verl's critic.optim.lr)")
    cliprange_value: float = Field(
        0.5, gt=0, le=1000, description="how far a value may move from the rollout's before its loss stops pulling it"
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="steps over which the critic's own lr rises linearly from 0 (as the policy's lr, per RL step)",
    )
    steps_before_actor: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="first steps that train the critic alone, the policy's weights held (verl's trainer.critic_warmup)",
    )
    lora: LMLoraSection | None = Field(
        None,
        description="train a LoRA adapter of the critic's body and its value head instead of every weight (verl's "
        "critic lora_rank; needs model.path)",
    )


class LMEvalSection(Section):
    every: int = Field(10, ge=1, le=MAX_STEPS, description="evaluate every N steps (and at the start and end)")
    prompts: int = Field(100, ge=1, le=10_000, description="held-out prompts (the task's eval split), one sample each")
    seed: Seed = 10_000


class EnvSection(Section):
    """The environment of a multi-turn run (docs/environments.md): which one, made how, how the model's tool calls
    are read, how long a step may take and how long it waits. Checked as a config is read: the environment imported
    (a user's module, as a reward's: unless `imports_rewards` says not to) and its options bound to its constructor."""

    name: str = Field(
        min_length=1,
        max_length=200,
        description="a built-in environment (arithmetic, lookup) or your own as package.module:Class",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, max_length=64, description="the environment's constructor's keyword arguments"
    )
    parser: str = Field(
        "hermes",
        max_length=40,
        description="how tool calls are written: hermes (<tool_call>{json}</tool_call>, as Qwen's and Hermes' chat "
        "templates teach) or plain (<calc>12*34</calc>, for the tiny models)",
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="seconds one reset or step may take in the environment's process before it is stopped",
    )
    latency: Latency = Field(
        default_factory=Latency,
        description="each step's wait besides its tools' own: {kind: constant, seconds: S} or {kind: lognormal, "
        "median_s: M, sigma: S}",
    )
    max_turns: int = Field(
        8,
        ge=1,
        le=256,
        description="model turns at most per trajectory: one the environment has not ended by then is cut",
    )
    max_turn_tokens: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="tokens at most of one model turn; None: what is left of sampling.max_new_tokens, the whole "
        "trajectory's budget (its turns and the observations between them)",
    )
    free_waits: bool = Field(
        False,
        description="false: a rollout device rolls its shard's trajectories out whole, holding its device through "
        "their waits; true: each turn is a node of its own, and the environment's steps and waits run off the "
        "devices, which the policy fills with other work meanwhile (docs/environments.md)",
    )

    @field_validator("name")
    @classmethod
    def _known_environment(cls, name: str, info: ValidationInfo) -> str:
        if imports_rewards(info):
            environment_class(name)
        return name

    @field_validator("options")
    @classmethod
    def _options_it_takes(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if imports_rewards(info) and "name" in info.data:  # else the name was refused: nothing to bind to
            check_options(info.data["name"], options)
        return options

    @field_validator("parser")
    @classmethod
    def _known_parser(cls, parser: str) -> str:
        convention(parser)
        return parser


ENV_POLICIES = (REFERENCE, AUTO, "verl-sync", "streamrl", "areal", "jigsaw", "jigsaw-greedy")
"""The policies that run an env config (multi-turn rollouts); `auto` chooses among the others by the planner's
forecast, which prices each step's turns and environment waits (`scenario`: `graph.spec.TurnsSpec`)."""


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


STEP_PASS = "_step_pass"
"""The suffix of a start-up profile figure measured at the step's train pass (`train_pass_responses`)."""
ROLLOUT_PASS = "_rollout_pass"
"""The suffix of a start-up profile's rollout figures (prefill, decode, score) measured at what a device decodes in
one call of a step, where that is more than its train pass (`rollout_pass_responses`)."""


class LMTrainConfig(RunSection):
    """A GRPO run of a causal language model: a built-in verifiable task, or your own model on your dataset."""

    kind: Literal["lm"]
    reward_samples: ClassVar[str] = "texts"
    task: str = Field(
        "sort", description="a task of dovetail.tasks: its prompts, answers and base model (a model.path run has none)"
    )
    _measured_lengths: tuple[list[int], list[int]] | None = PrivateAttr(None)
    """A model.path run's prompt and response token counts as its start-up profile measured them (`profiled`)."""
    _measured_turns: tuple[list[int], list[int]] | None = PrivateAttr(None)
    """An env run's model turns and observation tokens per trajectory, as its start-up profile measured them."""
    policy: str = Field(REFERENCE, description="who schedules the step: `dovetail train --help` lists them")
    model: LMModelSection = LMModelSection()
    prompts: LMPromptsSection | None = Field(
        None, description="your dataset (a model.path run's prompts and the columns its rewards read); None: the task's"
    )
    sampling: LMSamplingSection = LMSamplingSection()
    algo: LMAlgoSection = LMAlgoSection()
    critic: LMCriticSection | None = Field(
        None, description="PPO's critic, which algo.advantage: gae trains (its lr, value clip, warm-up)"
    )
    reward: RewardWeights | None = Field(
        None, description="text rewards and weights; None: the task's own (a prompts.path run names its own)"
    )
    format_pattern: str = Field(
        DEFAULT_FORMAT,
        min_length=1,
        max_length=1000,
        description="the regular expression a prompts.path run's `format` reward full-matches a completion against",
    )
    eval: LMEvalSection = LMEvalSection()
    runtime: LMRuntimeSection = LMRuntimeSection()
    env: EnvSection | None = Field(
        None,
        description="the environment of a multi-turn run (docs/environments.md): its rows are prompts.path's (a "
        "task's prompts without one)",
    )

    @field_validator("task")
    @classmethod
    def _known_task(cls, name: str) -> str:
        task(name)
        return name

    @field_validator("format_pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"{clip(repr(pattern))} is not a regular expression: {error}") from None
        return pattern

    @model_validator(mode="after")
    def _shards_whole_models(self) -> "LMTrainConfig":
        refuse_sharded_adapter(self.train, self.model.lora)
        if self.critic is not None:
            refuse_sharded_adapter(self.train, self.critic.lora, "critic.lora")
        return self

    @model_validator(mode="after")
    def _user_model_and_dataset(self) -> "LMTrainConfig":
        """model.path and prompts.path go together: a built-in task's model reads only its task's prompts, and a
        user's model trains on the user's dataset, not on a task."""
        if self.model.path is not None and self.prompts is None:
            raise ValueError(
                "prompts: a model.path run trains on your dataset; give it as prompts.path (a .jsonl / .json / "
                ".parquet / .csv with a prompt column)"
            )
        if self.prompts is not None and self.model.path is None and self.env is None:
            raise ValueError(
                "prompts.path: the built-in task models read only their task's prompts; give your own model as "
                "model.path"
            )
        if self.sampling.stop and self.model.path is None:
            raise ValueError("sampling.stop: a built-in task's responses end at its model's end of sequence")
        return self

    @model_validator(mode="after")
    def _known_text_rewards(self, info: ValidationInfo) -> "LMTrainConfig":
        """Each reward exists (a task's, or with prompts.path a dataset run's: `rewards.text`); a custom one's module
        is imported (unless `imports_rewards` says not to) and can be called by keyword, as TRL calls it."""
        if self.reward is None:
            if self.prompts is not None and self.env is None:
                raise ValueError(
                    "reward: a prompts.path run names its rewards, e.g. reward={answer_match: 1.0, format: 0.2} or "
                    "reward={mymodule:correct: 1.0} (def correct(prompts, completions, answer, **kwargs), as for TRL)"
                )
            return self
        if not self.reward:
            raise ValueError("name at least one reward, e.g. reward.exact_answer=1.0, or leave it unset")
        if imports_rewards(info):
            for name in [n for n in self.reward if n not in MODEL_REWARDS and n != SERVED_REWARD]:  # those: sections
                try:
                    text_reward_fn(name, dataset=self.prompts is not None)
                except ValueError as error:
                    raise ValueError(f"reward: {error}") from None
        return self

    @model_validator(mode="after")
    def _environments_in_the_reference_loop(self) -> "LMTrainConfig":
        """A config naming an environment trains multi-turn (`pipelines.lm.multiturn`) on our engine or
        transformers', in the reference loop or under a policy of `ENV_POLICIES`, whose rollout engines decode each
        trajectory whole in one band (`graph.lm`: an env step's graph has no later bands and no migration). A user's
        model names the longest prompt: its first observations are unknown until the run, and size the rollout's
        cache. An agentic task (`Task.environment`) runs in an environment: without one its model would answer alone
        what it learned to answer with a tool."""
        if self.env is None:
            agentic = None if self.user_model else task(self.task).environment
            if agentic is not None:
                raise ValueError(
                    f"env: task {self.task}'s problems are episodes of an environment; add env: {{name: {agentic}, "
                    f"parser: plain}} (as configs/{self.task}.yaml does)"
                )
            return self
        if self.policy not in ENV_POLICIES:
            raise ValueError(
                f"env: policy {self.policy} does not choose for environments yet; set policy: verl-sync (or another of "
                f"{', '.join(ENV_POLICIES)})"
            )
        if self.runtime.length_bands:
            raise ValueError(
                "runtime.length_bands: an env run decodes each trajectory whole, turn by turn, in one band; remove it"
            )
        if self.prompts is not None and self.user_model and self.prompts.max_tokens is None:
            raise ValueError(
                "prompts.max_tokens: an env run's prompts are its environment's first observations, unknown until it "
                "runs; give the longest, in tokens (it sizes the rollout engine's cache)"
            )
        return self

    @model_validator(mode="after")
    def _algorithm_fits_the_run(self) -> "LMTrainConfig":
        """The rollout correction defaults to TIS where the engine's log-probs are not the trainer's (vLLM), to none
        elsewhere (the weight would be exactly 1). A whole-batch advantage estimator reads every response of the step:
        a Ray policy trains a micro-batch at a time, with only its own scores. Dynamic sampling draws more prompts in
        the step it fills, under every policy: a Ray policy's step scores each draw before it rolls out the next, and
        trains the groups it keeps in its micro-batches once every draw is scored."""
        algo = self.algo
        if algo.rollout_correction is None:
            algo.rollout_correction = "none" if engine_matches_trainer(self.rollout_engine) else "tis"
        self._critic_fits_the_run()
        if self.policy != REFERENCE and algo.advantage in WHOLE_BATCH_ADVANTAGES and algo.micro_batches > 1:
            raise ValueError(
                f"algo.advantage={algo.advantage} whitens over the whole step: set algo.micro_batches=1 or policy: "
                f"reference (policy is {self.policy})"
            )
        if algo.dynamic_sampling and self.env is not None:
            raise ValueError("algo.dynamic_sampling: an env run's episodes are not redrawn yet; set it to false")
        if algo.num_iterations > 1 and self.train.sharding == "fsdp":
            raise ValueError(
                f"algo.num_iterations={algo.num_iterations}: a sharded trainer takes one update a batch yet; set "
                "algo.num_iterations=1 or train.sharding: replicate"
            )
        if algo.overlong_buffer > self.max_new_tokens:
            raise ValueError(
                f"algo.overlong_buffer={algo.overlong_buffer} exceeds max_new_tokens={self.max_new_tokens}: lower it"
            )
        return self

    def _critic_fits_the_run(self) -> None:
        """GAE reads a critic's values, and only a critic section trains one; it runs under every policy, a whole
        model on each trainer replica, or sharded with the policy (`train.sharding: fsdp`)."""
        if self.algo.advantage != "gae":
            if self.critic is not None:
                raise ValueError(
                    f"critic: only algo.advantage=gae trains a critic (it is {self.algo.advantage}); remove the section"
                )
            return
        if self.critic is None:
            raise ValueError("critic: algo.advantage=gae trains a critic; add the section, e.g. critic: {lr: 1e-5}")
        if self.critic.lora is not None and self.model.path is None:
            raise ValueError("critic.lora: LoRA trains your own model's critic; give its directory as model.path")

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
        if self.model.path is not None:
            return self
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

    @model_serializer(mode="wrap")
    def _no_task_of_a_user_model(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A `model.path` run trains the user's dataset, not a task: its dump (config.yaml, the checkpoints' and
        the caches' configs) records no `task`, which would otherwise say the default task it never trained."""
        tree = handler(self)
        if self.model.path is not None:
            tree.pop("task", None)
        return tree

    @property
    def rewards(self) -> dict[str, float]:
        """The text rewards and their weights: the config's, else a task run's own; an env run's environment gives
        its reward, to which these add (none unless named)."""
        if self.reward is not None:
            return self.reward
        return {} if self.env is not None else task(self.task).reward_names

    @property
    def rollout_engine(self) -> str:
        """`sampling.engine` with `auto` resolved: vLLM where the run's devices are GPUs and vLLM is installed (what
        verl, TRL and the other LM RL frameworks generate with there), else our engine (as fast or faster on CPU,
        and bitwise the trainer's)."""
        if self.sampling.engine != "auto":
            return self.sampling.engine
        on_gpus = device(self.cluster.device).platform == "cuda"
        return "vllm" if on_gpus and find_spec("vllm") is not None else "dovetail"

    @property
    def recomputes_old_log_probs(self) -> bool:
        """Whether every step recomputes the old log-probs in the trainer (verl's recompute_logprob): where the
        engine's are not the trainer's (vLLM: they are never the old ones, and the pass measures how far they are),
        and for the KL in the reward (`algo.kl_in: reward`), which reads them for every response of the step before
        any trains: an engine's own, even where they are the trainer's up to rounding, depend on how the rollouts were
        batched, and the step's gradient would then depend on the policy's split."""
        kl_in_reward = self.algo.kl_in == "reward" and self.algo.beta > 0
        return kl_in_reward or not engine_matches_trainer(self.rollout_engine)

    @property
    def critic_train(self):
        """The `train` section the critic's optimizer steps by (`models.training.commit`): the policy's clip and
        decay, the critic's lr and warm-up, a constant lr after it (verl's critic optimizer)."""
        assert self.critic is not None, "only a run with a critic steps one"
        return self.train.model_copy(
            update={"lr": self.critic.lr, "warmup_steps": self.critic.warmup_steps, "lr_schedule": "constant"}
        )

    @property
    def user_model(self) -> bool:
        """A `model.path` run: a user's transformers model on their dataset (`prompts.path`)."""
        return self.model.path is not None

    @property
    def builtin_checkpoint(self) -> Path:
        """The built-in task model's directory, of a run without model.path: model.checkpoint, which validation sets
        to the task's base model where none was given (`_task_base_model`)."""
        checkpoint = self.model.checkpoint
        assert checkpoint is not None, "a model.path run has no built-in checkpoint: read its model.path"
        return checkpoint

    @property
    def max_new_tokens(self) -> int:
        if self.sampling.max_new_tokens is not None:
            return self.sampling.max_new_tokens
        return USER_MAX_NEW_TOKENS if self.user_model else task(self.task).max_new_tokens

    @property
    def clipping_budget(self) -> int | None:
        """The tokens a response that was cut off holds (`lm_step_metrics`' clipped share): `max_new_tokens`; None
        for an env run, whose budget holds its observations too."""
        return self.max_new_tokens if self.env is None else None

    @property
    def compute_devices(self) -> int:
        return self.cluster.devices

    @property
    def train_pass_responses(self) -> int:
        """The responses a device trains in one pass over a step's micro-batch where every trainer device shares it:
        whole groups, a micro-batch's groups spread evenly (the driver shares them out by tokens,
        `pipelines.lm.adapter.balanced`). The start-up profile times its larger size at this (`engines.profile_work`):
        a line fitted through two small passes missed a step's 128-response passes by a quarter of its time."""
        trainer_devices = self.runtime.trainer_devices or self.compute_devices
        groups = -(-self.algo.prompts_per_step // self.algo.micro_batches // trainer_devices)
        return groups * self.algo.group_size

    @property
    def rollout_pass_responses(self) -> int:
        """The responses a device decodes in one call of a step where every device rolls out (whole groups, the
        step's prompts dealt to the devices). The start-up profile times the rollout's kinds at it too where it is
        more than the train pass (`engines.rollout_pass_size`): on a CPU core a decode's cost per response keeps its
        slope with the batch where the analytic model's (a GPU's, one read of the weights per iteration) flattens, so
        a line fitted at 16 and 128 responses priced a 256-response decode at two thirds of its time."""
        return -(-self.algo.prompts_per_step // self.compute_devices) * self.algo.group_size

    @property
    def pipeline_name(self) -> str:
        """The name, else the task's, else the model directory's (cut to what a pipeline name may hold)."""
        if self.name is not None:
            return self.name
        if self.model.path is None:
            return self.task
        return model_dir_name(self.model.path)

    def shape_overrides(self) -> dict:
        return {}

    def policy_options(self) -> PolicyOptions:
        return PolicyOptions()

    def profiled(self, measured: dict) -> "LMTrainConfig":
        """A model.path run's scenario with the prompt and response token counts its profile measured (the base
        model's responses on a step's prompts): a user's model may stop after a few tokens of a 256-token budget, and
        priced at half the budget its step was predicted 13x too slow. A task run's lengths are its task's. An env
        run's (either) with the model turns and observation tokens its profile's episodes took (`turns`,
        `observation_tokens`: `pipelines.lm.engines.profile_work`)."""
        if self.model.path is None and (self.env is None or "turns" not in measured):
            return self
        copy = self.model_copy()
        if self.model.path is not None:
            # the largest size's responses: more prompts' worth than the smaller sizes'
            suffix = next((s for s in (ROLLOUT_PASS, STEP_PASS) if f"lengths{s}" in measured), "")
            copy._measured_lengths = (list(measured[f"prompt_tokens{suffix}"]), list(measured[f"lengths{suffix}"]))
        if self.env is not None and "turns" in measured:
            copy._measured_turns = (list(measured["turns"]), list(measured["observation_tokens"]))
        return copy

    def scenario(self, steps: int) -> Scenario:
        """This run as the planner's scenario, without torch: response lengths are the task's ideal completions
        on a step's worth of training prompts (the base model's are near them; the run's profile corrects). A
        model.path run's model is priced from its config.json (`model.cost_model` left at config.json); its lengths
        are unknown before it decodes: once its start-up profile has decoded (`profiled`), the prompts' mean token
        count and the responses' lengths it measured; before, prompts of prompts.max_tokens (else the planner's
        default) and responses around half the budget."""
        draws = self.algo.dynamic_sampling_max_draws if self.algo.dynamic_sampling else 1
        pipeline = {
            "kind": "lm",
            "name": self.pipeline_name,
            "model": self.model.cost_model,
            "batch": self.algo.prompts_per_step,
            "group": self.algo.group_size,
            "max_length": self.max_new_tokens,
            "length_bands": self.runtime.length_bands,
            "micro_batches": self.algo.micro_batches,
            "updates": self.algo.num_iterations,
            "draws": draws,
            "dynamic_sampling": self.algo.dynamic_sampling,
            "reference": self.algo.beta > 0,
            "critic": self.critic is not None,
            "lengths_known": False,  # a run learns them by decoding
            "multi_turn": self.env is not None,
            "replicated_trainer": self.train.sharding
            == "replicate",  # the runtime's trainer, as the simulator prices it
            "priority": self.priority,
        }
        if self.model.path is None:
            problems = task(self.task).prompts("train", self.seed, 0, self.algo.prompts_per_step * self.algo.group_size)
            lengths = [min(self.max_new_tokens, len(self._model_text(p)) + 1) for p in problems]
            pipeline["prompt_length"] = round(sum(len(p) + 1 for p in problems) / len(problems))
            pipeline["lengths"] = {"kind": "empirical", "values": lengths}
        elif self._measured_lengths is not None:
            prompt_tokens, lengths = self._measured_lengths
            pipeline["prompt_length"] = max(1, round(sum(prompt_tokens) / len(prompt_tokens)))
            pipeline["lengths"] = {"kind": "empirical", "values": [max(1, n) for n in lengths]}
        else:
            if self.prompts is not None and self.prompts.max_tokens is not None:
                pipeline["prompt_length"] = self.prompts.max_tokens
            pipeline["lengths"] = {"kind": "lognormal", "median": max(1, self.max_new_tokens // 2), "sigma": 0.5}
        if self.model.path is not None and self.model.lora is not None:
            targets = self.model.lora.target_modules
            attention = targets != "all-linear" and set(targets) <= {"q_proj", "k_proj", "v_proj", "o_proj"}
            pipeline["lora"] = {"rank": self.model.lora.rank, "targets": "attention" if attention else "all-linear"}
        if self.model.path is not None and self.model.cost_model == FROM_CONFIG:
            config = json_or_empty(self.model.path / "config.json")
            pipeline["model"] = self.pipeline_name
            pipeline["architecture"] = language_model_of_config(self.pipeline_name, config).shape()
        if self.recomputes_old_log_probs:
            # The recompute pass whatever the policy (`recomputes_old_log_probs`; `planner_scenario` keeps it).
            pipeline["recompute_logprob"] = True
        if self.env is not None:
            pipeline["turns"] = self._turns()
        return planner_scenario(self, [pipeline], steps, self.runtime.trainer_devices, 0)

    def _model_text(self, problem: str) -> str:
        """What the model writes of a task problem's ideal completion: an env run's without what its environment
        writes (`Task.observation_pattern`), which the planner prices as observations."""
        solution = task(self.task).solution(problem)
        pattern = task(self.task).observation_pattern
        return solution if self.env is None or pattern is None else pattern.sub("", solution)

    def _turns(self) -> dict:
        """An env run's turns as the planner prices them (`graph.spec.TurnsSpec`): the model turns and observation
        tokens of its start-up profile's episodes where it has profiled (`profiled`); before, a task's ideal
        completions' (a call and its result per observation, at most env.max_turns turns), or env.max_turns turns
        for a user's environment, whose observations are unknown until it runs. Each waits `env.latency` (a tool's
        own latency is its environment's, which the config does not know: give a tool's waits as env.latency to
        price them). Unless `env.free_waits`, the runtime's engine holds its device through its trajectories' waits
        (`waits_hold_device`): one decode call per shard rolls them out whole (`pipelines.lm.multiturn`); with it,
        each shard's chain of turn nodes covers env.max_turns (`TurnsSpec.max_turns`), as the runtime learns the
        turns by decoding."""
        env = self.env
        assert env is not None, "an env run's turns"
        if self._measured_turns is not None:
            counts, observed = self._measured_turns
        elif not self.user_model and (pattern := task(self.task).observation_pattern) is not None:
            problems = task(self.task).prompts("train", self.seed, 0, self.algo.prompts_per_step)
            observations = [pattern.findall(task(self.task).solution(p)) for p in problems]
            counts = [len(found) + 1 for found in observations]
            observed = [sum(len(text) for text in found) for found in observations]
        else:
            counts, observed = [env.max_turns], [0]
        counts = [min(max(1, count), env.max_turns) for count in counts]
        waits = sum(count - 1 for count in counts)
        return {
            "counts": counts,
            "observation_tokens": round(sum(observed) / waits) if waits else 0,
            "latency": env.latency.model_dump(),
            "waits_hold_device": not env.free_waits,
            "max_turns": env.max_turns if env.free_waits else None,
        }
