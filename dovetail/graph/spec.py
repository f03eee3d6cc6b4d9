"""What one RL pipeline step is: the typed specs graph builders expand (and scenarios are made of)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from dovetail.cost.catalog import DiffusionModel, LanguageModel, diffusion_model, language_model
from dovetail.graph.latency import NO_LATENCY, Latency
from dovetail.graph.node import Kind, Node, Role

MAX_DEVICES = 4096
"""Devices of one pool: more than any run here needs, few enough that the planner's search over pool splits ends."""

MAX_SAMPLES = 65_536
"""Samples (prompts x group) of one step: the simulator draws and schedules each one."""

MAX_TOKENS = 131_072
"""Tokens of a prompt or a response."""

PipelineName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$", max_length=64)]
"""A pipeline's name, in a scenario and in a run config: node ids, trace lanes and a multiplexed run's
sub-directories carry it, so letters, digits, `_`, `-` and `.` (not first: no hidden or parent directory)."""

GroupSize = Annotated[int, Field(ge=2)]
"""Samples per prompt, in a scenario and in a run config: GRPO's advantages compare the samples of one prompt, so a
group of one has nothing to compare and trains nothing."""


class _Spec(BaseModel):
    """Strict (`true` is not the number 1) and finite, as scenario files are read."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class LoRASpec(_Spec):
    """A LoRA adapter trained instead of the whole model: the base weights stay frozen (`cost.model.lora_params`
    says how many parameters the adapter has)."""

    rank: int = Field(
        gt=0, le=1024, description="Adapter rank r: each adapted d_in x d_out matrix gains r (d_in + d_out)."
    )
    targets: Literal["attention", "all-linear"] = Field(
        "all-linear",
        description="attention: the q, k, v and output projections; all-linear: those and the MLP's matrices.",
    )


class _PipelineSpec(_Spec):
    """What every kind of pipeline has, and what it says of itself where kinds differ (abstract: a new kind's spec
    that does not answer cannot be made), so the planner asks the spec instead of which kind it is."""

    lora: LoRASpec | None = Field(
        None,
        description="Train a LoRA adapter (rank, targets) instead of every weight: trainer memory and optimizer state "
        "of the adapter only, a backward without base-weight gradients, publication of the adapter only.",
    )

    priority: float = Field(
        1.0,
        gt=0,
        le=1000,
        description="Weight of this pipeline's step completion times where a policy that multiplexes pipelines "
        "(jigsaw) chooses whose trainer work goes first: the higher, the sooner.",
    )
    recompute_logprob: bool = Field(
        True,
        description="Recompute old log-probs in the trainer before training, as verl and veRL-Omni do (their rollout "
        "engines' kernels differ from the trainer's); a policy whose shape has no such pass ignores it.",
    )

    @property
    @abstractmethod
    def rollout_engine_devices(self) -> int:
        """Devices one rollout engine spans: the fewest a pipeline's own (sub-)pool may have."""

    @property
    @abstractmethod
    def trains_replicas(self) -> bool:
        """Whether a commit is priced as the trainer devices' whole replicas all-reducing their gradients, as
        dovetail's runtime trains (a start-up profile then times that sync, `DeviceWorker.time_sync`); else as one
        FSDP group sharding the optimizer step."""

    @abstractmethod
    def memory_fix(self, node: Node, engine_too_large: bool) -> str:
        """The scenario fields that lower what `node` needs per device, where it does not fit (`plan.prepare`);
        `engine_too_large`: its role's engine alone is larger than a device."""

    @abstractmethod
    def memory_remedies(self) -> list[tuple[str, int]]:
        """(field, value) changes of this pipeline that lower what a device holds, the least first: what the planner
        tries when nothing fits (`plan.prepare.what_fits`)."""


class FlowSpec(_PipelineSpec):
    """A FlowGRPO / DanceGRPO / DiffusionNFT step of a diffusion or flow-matching model."""

    kind: Literal["flow"] = "flow"
    min_plan_devices: ClassVar[int] = 2
    """Devices `dovetail plan` needs besides reward devices: a rollout and a trainer pool to search over."""
    name: PipelineName = Field(description="Pipeline name, unique in a scenario.")
    model: str = Field(max_length=100, description="Diffusion model from the catalogue, e.g. FLUX.1-12B.")
    algorithm: Literal["flow_grpo", "dance_grpo", "diffusion_nft"] = "flow_grpo"
    prompts: int = Field(gt=0, le=MAX_SAMPLES, description="Prompts per step (B).")
    group: GroupSize = Field(le=1024, description="Samples per prompt (G); a group is never split across fragments.")
    denoising_steps: int = Field(gt=1, le=1000, description="Sampler steps per sample (K).")
    trained_timesteps: int = Field(gt=0, description="Timesteps trained per sample (never the last one).")
    cfg: bool = Field(False, description="Classifier-free guidance in rollout: two DiT passes per denoising step.")
    train_cfg: bool | None = Field(
        None, description="CFG in training too (two passes per trained pair); None: same as cfg."
    )
    reference: bool = Field(False, description="KL to a frozen reference: one reference forward per trained pair.")
    height: int = Field(gt=0, le=16384, description="Pixels.")
    width: int = Field(gt=0, le=16384, description="Pixels.")
    frames: int = Field(1, gt=0, le=1024, description="1 for images.")
    mini_batches: int = Field(1, gt=0, description="Optimizer steps per RL step (the batch is split by prompt).")
    updates: int = Field(
        1,
        gt=0,
        le=64,
        description="Optimizer updates on each mini-batch (a flow run's algo.num_iterations): its commit trains the "
        "mini-batch's pairs again before each update after the first.",
    )
    reward: Literal["vlm", "rule"] = Field(
        "vlm", description="vlm: a model judge (OCR, PickScore-like); rule: a cheap function."
    )
    offload: bool = Field(
        False, description="Trainer parameters and optimizer state live in host memory (FSDP offload)."
    )
    generation_batch: Literal["group", "fragment", "sample"] = Field(
        "group",
        description="What one denoising pass holds at most: a prompt's group, as flow_grpo and veRL-Omni generate; "
        "a whole fragment, as dovetail's engine does; or one sample, as DanceGRPO's sampling loop does. Either way "
        "only as many samples as fit beside the rollout engine.",
    )
    sampler: Literal["engine", "trainer"] = Field(
        "engine",
        description="What generates: replicated rollout engines, each holding the whole model (verl / veRL-Omni, "
        "dovetail); or the FSDP-sharded trainer itself (DanceGRPO, MixGRPO), whose every denoising forward "
        "all-gathers the weights over its FSDP group and which never switches engines.",
    )
    fsdp_precision: Literal["bf16", "fp32"] = Field(
        "bf16",
        description="The FSDP trainer's parameter dtype, what every pass all-gathers: bf16 (verl's mixed precision) "
        "or fp32 (fastvideo's, which DanceGRPO and MixGRPO train with); gradients are reduced in fp32 either way.",
    )
    micro_batch: int = Field(
        1,
        gt=0,
        le=MAX_SAMPLES,
        description="Samples per device in one trainer forward/backward (the recipe's train micro-batch); the "
        "per-timestep loop runs one pass per micro-batch per trained timestep, TSP batches a chunk "
        "of timesteps into it.",
    )
    fragments: int | None = Field(
        None, gt=0, description="GAP fragments M (whole groups); None lets the policy choose."
    )
    tsp_chunk: int | None = Field(
        None, gt=0, le=1000, description="Timesteps per TSP train node; None lets the policy choose."
    )

    @model_validator(mode="after")
    def _check(self) -> FlowSpec:
        if self.trained_timesteps > self.denoising_steps - 1:
            raise ValueError(
                f"trained_timesteps={self.trained_timesteps} must be at most denoising_steps - 1 = "
                f"{self.denoising_steps - 1} (the last step is never trained)"
            )
        if self.prompts % self.mini_batches:
            raise ValueError(f"mini_batches={self.mini_batches} must divide prompts={self.prompts}")
        _check_samples(self.prompts, self.group, "prompts")
        if self.fragments is not None and self.fragments > self.prompts:
            raise ValueError(
                f"fragments={self.fragments} cannot exceed prompts={self.prompts} (a fragment holds whole groups)"
            )
        return self

    def catalogue_model(self) -> DiffusionModel:
        """The cost catalogue's entry of `model` (a ValueError naming the known ones if there is none)."""
        return diffusion_model(self.model)

    @property
    def rollout_engine_devices(self) -> int:
        """A rollout engine holds the whole model on each device."""
        return 1

    @property
    def trains_replicas(self) -> bool:
        """The cost model prices a flow trainer pool as FSDP groups (`FlowShape.trainer_group`)."""
        return False

    def memory_fix(self, node: Node, engine_too_large: bool) -> str:
        """A flow trainer's state shrinks with more devices and offload; a rollout generates in chunks that fit
        beside its engine (`graph.flow.generation_batch`), so only the engine itself (the whole model on every
        device: `engine_too_large`) or one sample's activations can be too large."""
        if node.kind == Kind.GENERATE and engine_too_large:
            return (
                "use a device with more memory (every rollout device holds the whole model, whatever the device count)"
            )
        if node.kind == Kind.GENERATE:
            return "lower height / width / frames (one sample's activations do not fit beside the rollout engine)"
        offload = "" if self.offload else " or set offload: true"
        return f"use more devices (a smaller shard of the trainer state){offload}"

    def memory_remedies(self) -> list[tuple[str, int]]:
        """The trainer's parameters and optimizer state in host memory."""
        return [] if self.offload else [("offload", True)]

    @property
    def samples(self) -> int:
        return self.prompts * self.group


class LengthDistribution(_Spec):
    """Response lengths: lognormal (median, sigma) or an empirical list sampled with replacement."""

    kind: Literal["lognormal", "empirical"] = "lognormal"
    median: float | None = Field(None, gt=0, le=MAX_TOKENS)
    sigma: float | None = Field(None, ge=0, le=5)
    values: list[Annotated[int, Field(gt=0, le=MAX_TOKENS)]] | None = Field(None, min_length=1, max_length=MAX_SAMPLES)

    @model_validator(mode="after")
    def _check(self) -> LengthDistribution:
        if self.kind == "lognormal" and (self.median is None or self.sigma is None):
            raise ValueError("a lognormal length distribution needs median and sigma")
        if self.kind == "empirical" and not self.values:
            raise ValueError("an empirical length distribution needs values: [lengths...]")
        return self


MAX_TURNS = 256
"""Model turns of one trajectory, as a run's `env.max_turns` allows."""


class TurnsSpec(_Spec):
    """A multi-turn pipeline's trajectories as the planner prices them: how many model turns each takes, what the
    environment appends after each, and how long each environment step makes the trajectory wait. A trajectory's
    drawn length (`LMSpec.lengths`) is its model's tokens over all its turns, shared out evenly among them."""

    counts: list[Annotated[int, Field(ge=1, le=MAX_TURNS)]] = Field(
        min_length=1,
        max_length=MAX_SAMPLES,
        description="Model turns per trajectory, each trajectory's drawn from these with replacement (seeded): [3] "
        "for always three, a run's measured counts for its spread.",
    )
    observation_tokens: int = Field(
        0,
        ge=0,
        le=MAX_TOKENS,
        description="Tokens the environment appends after each turn that the trajectory goes on from.",
    )
    latency: Latency = Field(
        NO_LATENCY,
        description="Each environment step's wait ({kind: constant, seconds: S} or {kind: lognormal, median_s: M, "
        "sigma: S}, as a run's env.latency), drawn per trajectory and turn from the seed.",
    )
    max_turns: int | None = Field(
        None,
        ge=1,
        le=MAX_TURNS,
        description="Turns every shard's chain of turn nodes covers, where `waits_hold_device` is false; None: the "
        "most of `counts`. A run learns its trajectories' turns by decoding, so its graph covers its env.max_turns: "
        "a turn node whose trajectories all ended earlier decodes nothing, after an env node that waits none.",
    )
    waits_hold_device: bool = Field(
        False,
        description="False: an environment step is a node of its own that holds no device (its shard's engine is "
        "another node's to fill while every trajectory on it waits). True: each shard rolls its trajectories out "
        "whole in one decode node that holds its engine through their waits, as dovetail's Ray runtime rolls them "
        "out today (a run's own scenario).",
    )


class ModelShape(_Spec):
    """A language model outside the catalogue (a user's `model.path`), as its config.json gives it
    (`cost.catalog.language_model_of_config`)."""

    params: float = Field(gt=0, le=1e13)
    layers: int = Field(gt=0, le=10_000)
    hidden: int = Field(gt=0, le=1_000_000)
    heads: int = Field(gt=0, le=10_000)
    kv_heads: int = Field(gt=0, le=10_000)
    head_dim: int = Field(gt=0, le=100_000)
    vocab: int = Field(gt=0, le=10_000_000)


class LMSpec(_PipelineSpec):
    """A GRPO step of a causal language model."""

    kind: Literal["lm"] = "lm"
    min_plan_devices: ClassVar[int] = 1
    """One device can hold both engines of a language model's plan (verl's hybrid engine)."""
    name: PipelineName = Field(description="Pipeline name, unique in a scenario.")
    model: str = Field(
        max_length=100, description="Language model from the catalogue, e.g. Qwen3-4B; or the name of `architecture`."
    )
    architecture: ModelShape | None = Field(
        None, description="The model's shape where it is not in the catalogue (a user's model, from its config.json)."
    )
    batch: int = Field(gt=0, le=MAX_SAMPLES, description="Prompts per step.")
    group: GroupSize = Field(le=1024, description="Responses per prompt (n).")
    prompt_length: int = Field(256, gt=0, le=MAX_TOKENS)
    lengths: LengthDistribution
    max_length: int = Field(gt=0, le=MAX_TOKENS, description="Responses are cut at this many tokens.")
    length_bands: list[int] = Field(
        default_factory=list,
        max_length=64,
        description="Upper bounds of decode length bands: ascending token counts below max_length.",
    )
    lengths_known: bool = Field(
        True,
        description="Whether a step's response lengths are known when its graph is built (the simulator draws them); "
        "false for a real run, which learns them by decoding: every shard then decodes every band, whichever "
        "responses still run, and the drawn lengths only predict the costs.",
    )
    micro_batches: int = Field(1, gt=0, le=MAX_SAMPLES, description="Train micro-steps per step.")
    updates: int = Field(
        1,
        gt=0,
        le=64,
        description="Optimizer updates on each step's batch (an LM run's algo.num_iterations): the commit trains "
        "the step's responses again before each update after the first.",
    )
    draws: int = Field(
        1,
        gt=0,
        le=100,
        description="Batches of `batch` prompts a step may draw (DAPO's dynamic sampling, an LM run's "
        "algo.dynamic_sampling_max_draws): each draw is generated and scored after the one before, and trains "
        "`batch` groups of them. A run skips the draws it does not need; the simulator, which knows no rewards, "
        "prices every one (an upper bound).",
    )
    dynamic_sampling: bool = Field(
        False,
        description="Whether a step drops the groups whose rewards are all equal (DAPO's dynamic sampling, an LM "
        "run's algo.dynamic_sampling): its training waits on every draw's score, even of one draw, and trains the "
        "groups kept in its micro-batches. More than one draw implies it.",
    )
    tensor_parallel: int = Field(1, gt=0, le=64, description="Devices per rollout engine.")
    multi_turn: bool = Field(
        False,
        description="Whether a step's responses are multi-turn trajectories (an env run's): each shard decodes its "
        "trajectories whole, turn by turn between environment steps, in one band with no migration.",
    )
    turns: TurnsSpec | None = Field(
        None,
        description="A multi-turn step's turns, observations and environment waits (`multi_turn: true`); None: its "
        "trajectories priced as one turn each with no wait.",
    )
    reference: bool = Field(True, description="Compute reference log-probs for a KL term.")
    critic: bool = Field(
        False,
        description="PPO with a critic (GAE): a value pass after each micro-batch's score and a critic train beside "
        "the actor's, a value model as large as the policy on the trainer devices.",
    )
    replicated_trainer: bool = Field(
        False,
        description="Every trainer device holds a whole replica of the trainer, as dovetail's runtime does: a commit "
        "all-reduces the gradients across them and each takes the whole optimizer step. False: one FSDP group over "
        "the trainer devices shards the optimizer step (verl).",
    )

    def catalogue_model(self) -> LanguageModel:
        """The model the cost model prices: `architecture` under the name `model`, else the cost catalogue's entry of
        `model` (a ValueError naming the known ones if there is none)."""
        if self.architecture is not None:
            return LanguageModel(self.model, **self.architecture.model_dump())
        return language_model(self.model)

    @property
    def rollout_engine_devices(self) -> int:
        return self.tensor_parallel

    @property
    def trains_replicas(self) -> bool:
        return self.replicated_trainer

    def memory_fix(self, node: Node, engine_too_large: bool) -> str:
        """Trainer passes hold `batch / micro_batches` sequences' activations beside a shard of the trainer state;
        the rollout engine holds the weights and KV cache over `tensor_parallel` devices."""
        if node.role == Role.ROLLOUT:
            return f"raise tensor_parallel (now {self.tensor_parallel}) or use a device with more memory"
        if self.replicated_trainer:
            return (
                "set replicated_trainer: false (a replica holds the whole trainer state on every trainer device, "
                f"whatever their count) or raise micro_batches (now {self.micro_batches})"
            )
        return (
            f"raise micro_batches (now {self.micro_batches}; fewer tokens per trainer pass) or use more devices "
            "(a smaller shard of the trainer state)"
        )

    def memory_remedies(self) -> list[tuple[str, int]]:
        """A sharded trainer in place of replicas (each replica holds the whole trainer state), more micro-batches
        (each a divisor of the batch: fewer tokens per trainer pass), then wider rollout engines (the weights and KV
        cache over more devices, up to a node of 8)."""
        sharded = [("replicated_trainer", False)] if self.replicated_trainer else []
        more_micro_batches = [m for m in range(self.micro_batches + 1, self.batch + 1) if self.batch % m == 0]
        wider = [tp for tp in (2, 4, 8) if tp > self.tensor_parallel]
        return sharded + [("micro_batches", m) for m in more_micro_batches] + [("tensor_parallel", tp) for tp in wider]

    @model_validator(mode="after")
    def _check(self) -> LMSpec:
        check_length_bands(self.length_bands, self.max_length, "length_bands", "max_length")
        if self.turns is not None and not self.multi_turn:
            raise ValueError("turns: a pipeline's turns are a multi-turn one's; set multi_turn: true")
        _check_samples(self.batch * self.draws, self.group, "batch x draws" if self.draws > 1 else "batch")
        if self.draws > 1 and self.multi_turn:
            raise ValueError(
                f"draws={self.draws}: a step that draws more prompts rolls out single-turn responses (an env run's "
                "episodes are not redrawn); set multi_turn: false, or draws: 1"
            )
        if self.dynamic_sampling and self.multi_turn:
            raise ValueError(
                "dynamic_sampling: a step that drops groups rolls out single-turn responses (an env run's episodes "
                "are not redrawn); set multi_turn: false, or dynamic_sampling: false"
            )
        return self


def check_length_bands(bands: list[int], max_length: int, field: str, budget: str) -> None:
    """Decode length bands are the edges where a response may pause: strictly ascending token counts from 1 to the
    response budget less one (an edge at 0 or at the budget pauses nothing). One check for scenarios and run configs;
    `field` and `budget` name the two fields as the file calls them."""
    if bands != sorted(set(bands)) or (bands and not 0 < bands[0] <= bands[-1] < max_length):
        raise ValueError(
            f"{field}={bands} must be strictly ascending token counts between 1 and {budget} - 1 = {max_length - 1}"
        )


def _check_samples(prompts: int, group: int, field: str) -> None:
    if prompts * group > MAX_SAMPLES:
        raise ValueError(
            f"{field} x group = {prompts} x {group} samples per step: at most {MAX_SAMPLES}; lower {field} or group"
        )


PipelineSpec = FlowSpec | LMSpec
