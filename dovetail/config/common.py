"""What every run config shares: the strict section base, the bounds, the optimizer loop, checkpoints, the cluster,
the run-wide fields of a pipeline (`RunSection`), the policy checked against the registries, and the translation to
the planner's scenario.

Every number is bounded: floats finite, sizes below maxima that keep a run's allocations (and the planner's
simulation) sane, each bound's reason in its description. Types are strict: `true` is not the number 1, nor "8"
the number 8 (an int is a float). Every way a config can be wrong is a ConfigError: one line per problem, naming the
file or the field and what it allows."""

import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Protocol, Self, get_args

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator, model_validator

from dovetail.cost.catalog import device
from dovetail.files import read_text
from dovetail.graph.spec import MAX_DEVICES, PipelineName
from dovetail.kinds import KINDS, kind
from dovetail.plan.scenario import MAX_SIMULATED_STEPS, Scenario, clip, parse_scenario, problem_report
from dovetail.rewards import (
    MODEL_REWARDS,
    REWARD_TIMEOUT_S,
    SERVED_REWARD,
    RewardModel,
    RewardServer,
    RewardSources,
    model_problem,
)
from dovetail.sched import POLICIES, policy_class
from dovetail.sched.policy import PolicyOptions

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


def model_dir_name(path: Path) -> str:
    """A pipeline named after its model directory (`model.path`), cut to what a pipeline name may hold; a hub
    cache's snapshot (`models--org--name/snapshots/<commit>`, `hub_snapshot`) after its repository's name."""
    name = path.name
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        name = path.parent.parent.name.rpartition("--")[2]
    return re.sub(r"[^A-Za-z0-9_.-]", "-", name).lstrip(".")[:64] or "model"


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")
"""A Hugging Face hub repository id (`name` or `org/name`), as TRL and verl take `Qwen/Qwen2.5-0.5B` for a model."""


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub reads, from the environment now (its own constant is read at its import):
    HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_snapshot(path: Path, repo_type: Literal["model", "dataset"] = "model") -> Path:
    """`path` itself where it exists; else, where it reads as a hub id, that repository's snapshot (its `main`) in
    the local hub cache, never the network: a run reads only what this machine holds. An id the cache lacks is one
    line naming it and how to fetch it. Any other path is returned as it is, for its own check to name."""
    text = str(path)
    if exists(path) or text.startswith(".") or not HUB_ID.fullmatch(text):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(str(snapshot_download(text, repo_type=repo_type, cache_dir=cache, local_files_only=True)))
    except (LocalEntryNotFoundError, HFValidationError, OSError):  # the cache lacks it, or the id is not one
        dataset = repo_type == "dataset"
        option, missing = (" --repo-type dataset", "no dataset file") if dataset else ("", "no directory")
        raise ValueError(
            f"{missing} {text}, nor a hub {repo_type} id the cache {cache} holds: fetch it where there is network "
            f"(hf download{option} {text}, with HF_HUB_CACHE={cache}) or give a local path"
        ) from None


def exists(path: Path) -> bool:
    """Path.exists, a path the system cannot look up (one too long) being none."""
    try:
        return path.exists()
    except OSError:
        return False


def is_file(path: Path) -> bool:
    """Path.is_file, a path the system cannot look up (one too long) being no file."""
    try:
        return path.is_file()
    except OSError:
        return False


def is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def json_or_empty(path: Path) -> dict:
    try:
        loaded = json.loads(read_text(path, "a JSON file"))
    except ValueError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


class TrainSection(Section):
    steps: int = Field(200, ge=1, le=MAX_STEPS)
    lr: float = Field(1e-4, gt=0, le=1, description="Adam's learning rate: beyond 1 every step diverges")
    weight_decay: float = Field(
        0.0, ge=0, le=1, description="AdamW's decoupled decay: at most 1, so lr x weight_decay only shrinks weights"
    )
    max_grad_norm: float = Field(1.0, gt=0, le=1e4)
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="the lr after warm-up: constant, linear decay to 0 at the last step, or cosine decay to 0 "
        "(TRL's lr_scheduler_type; TRL defaults to linear, dovetail to constant)",
    )
    warmup_steps: int = Field(
        0, ge=0, le=MAX_STEPS, description="optimizer steps whose lr rises linearly from 0 (TRL's warmup_steps)"
    )
    sharding: Literal["replicate", "fsdp"] = Field(
        "replicate",
        description="replicate: every trainer device holds the whole model and its optimizer state; fsdp: they "
        "split it (FSDP2, per transformer block), each holding 1/N of the parameters, gradients and AdamW moments",
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="the trainer's compute: bf16 gathers and computes each block in bf16 and keeps fp32 master "
        "weights, optimizer state and gradient reduction (FSDP's mixed precision: needs sharding: fsdp)",
    )
    activation_checkpointing: bool = Field(
        False,
        description="keep only each transformer block's input through the forward and recompute the rest in the "
        "backward (less memory, ~1/3 more compute; needs sharding: fsdp)",
    )
    cpu_offload: bool = Field(
        False,
        description="keep the trainer's shards, gradients and optimizer state in the host's memory, copying each "
        "block to the GPU for its passes (FSDP's CPU offload: the optimizer steps on the CPU; needs sharding: fsdp "
        "and a GPU)",
    )

    @model_validator(mode="after")
    def _sharded_options(self) -> "TrainSection":
        """bf16 and activation checkpointing are applied where FSDP wraps the trainer's blocks."""
        for name, value, plain in (
            ("precision", self.precision, "fp32"),
            ("activation_checkpointing", self.activation_checkpointing, False),
            ("cpu_offload", self.cpu_offload, False),
        ):
            if value != plain and self.sharding != "fsdp":
                raise ValueError(
                    f"{name}={value}: applied by the sharded trainer; set train.sharding: fsdp (or {name}: {plain})"
                )
        return self

    @model_validator(mode="after")
    def _warmup_within_run(self) -> "TrainSection":
        if self.warmup_steps > self.steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} is more than steps={self.steps}: the lr would never reach "
                "train.lr; lower train.warmup_steps"
            )
        return self


def refuse_sharded_adapter(train: TrainSection, lora: object | None, field: str = "model.lora") -> None:
    """A LoRA adapter trains a few parameters of a frozen base, and the sharded trainer shards whole models so far:
    one line naming both fields (`field`: the adapter's section, the policy's or a PPO critic's)."""
    if train.sharding == "fsdp" and lora is not None:
        raise ValueError(
            "train.sharding=fsdp: a LoRA adapter trains replicated (its frozen base is 4 bytes a parameter); drop "
            f"{field} to shard the whole model, or set train.sharding: replicate"
        )


class CheckpointSection(Section):
    every: int = Field(50, ge=1, le=MAX_STEPS, description="save every N steps (and at the end)")


RAY_ADDRESS = re.compile(r"(ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?):(?P<port>[0-9]{1,5})")
"""host:port or ray://host:port, the host a name, an IPv4 address or a bracketed IPv6 address."""


GB = 1e9
REPLICA_WEIGHT_BYTES = 4
"""A replicated trainer's bytes per parameter for its fp32 weights."""
REPLICA_TRAINED_BYTES = 20
"""And per trained parameter besides: its fp32 gradient (4), the fp64 sum of the step's parts it is rounded from at
the commit (8: `runtime.worker.reduce_parts`) and AdamW's two fp32 moments (8)."""
SHARD_TRAINED_BYTES = 12
"""A sharded trainer's per trained parameter besides its fp32 weights, before dividing by the group: its fp32
gradient (4; FSDP adds the parts in it) and AdamW's two fp32 moments (8)."""
ROLLOUT_WEIGHT_BYTES = 4
"""A rollout engine's own fp32 copy of the weights, per parameter."""


class LoraRank(Protocol):
    """What the memory check reads of either kind's `model.lora` section."""

    rank: int


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
    lost_after_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="seconds a device may have no node (its node gone, no spare node to restart its worker on) "
        "before the run goes on from its last committed step on the devices that remain",
    )
    publication: Literal["auto", "object_store", "collective"] = Field(
        "auto",
        description="how published weights reach the rollout devices: object_store (Ray's object store), collective "
        "(a broadcast from the trainer), or auto (both timed at start-up where devices are on several nodes, the "
        "faster kept for publications across nodes; docs/cluster.md)",
    )

    device_memory_gb: float | None = Field(
        None,
        gt=0,
        le=100_000,
        description="memory of one device in GB, the budget a run must fit (CPU devices too); None: the catalogue "
        "device's memory",
    )

    def check_trainer_fits(
        self, params: int, trainable: int, lora: LoraRank | None, train: TrainSection, trainer_devices: int
    ) -> None:
        """Refuse, before any work, a run whose trainer and rollout engine would not fit one device's memory
        (`device_memory_gb`), in one line naming what makes it fit. A replicated trainer holds fp32 weights of all
        `params` parameters and, of the `trainable` ones, a gradient, the fp64 sum of the step's parts and AdamW's two
        moments (24 bytes a trained parameter); a trainer sharded over the `trainer_devices` (`train.sharding: fsdp`)
        holds 1/N of its weights, gradient and moments (16 bytes a trained parameter), and the whole model's fp32
        weights while it starts (it is built whole, then cut); the rollout engine its own fp32 copy. Activations and
        the KV cache come on top."""
        budget = self.device_memory_gb * GB if self.device_memory_gb is not None else device(self.device).memory_bytes
        weights = REPLICA_WEIGHT_BYTES * params
        rollout = ROLLOUT_WEIGHT_BYTES * params
        sharded = rollout + max(weights, (weights + SHARD_TRAINED_BYTES * trainable) / trainer_devices)
        needed = sharded if train.sharding == "fsdp" else rollout + weights + REPLICA_TRAINED_BYTES * trainable
        if needed <= budget:
            return
        if lora is None:
            lighter = "train a LoRA adapter of a model.path model (model.lora)"
        else:
            lighter = f"train a smaller adapter (model.lora.rank, now {lora.rank}; fewer model.lora.target_modules)"
        given = (
            f" (unset: the {self.device}'s {budget / GB:g} GB)"
            if self.device_memory_gb is None
            else f"={self.device_memory_gb:g}"
        )
        if train.sharding == "fsdp":
            counted = f"({trainable:,} trained: 16 bytes each for fp32 weights, gradient and AdamW moments)"
            raise ValueError(
                f"cluster.device_memory_gb{given}: each of {trainer_devices} devices holds its shard of a trainer of "
                f"{params:,} parameters {counted}, the whole model's fp32 weights while it starts, and its rollout "
                f"engine's weights (4 bytes a parameter), {needed / GB:.3g} GB; shard over more devices "
                f"(cluster.devices), raise cluster.device_memory_gb to {needed / GB:.3g} or more, or {lighter}"
            )
        counted = (
            f"({trainable:,} trained: 24 bytes each for fp32 weights and gradient, the fp64 sum of the step's parts "
            "and AdamW moments, 4 each frozen)"
        )
        shard = (
            f"set train.sharding: fsdp (each of the {trainer_devices} trainer devices then holds {sharded / GB:.3g} "
            "GB), "
            if sharded <= budget and lora is None
            else ""
        )
        raise ValueError(
            f"cluster.device_memory_gb{given}: each device holds a replicated trainer of {params:,} parameters "
            f"{counted} and its rollout engine's weights (4 bytes a parameter), {needed / GB:.3g} GB; {shard}raise "
            f"cluster.device_memory_gb to {needed / GB:.3g} or more, or {lighter}"
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


Tracker = Literal["console", "tensorboard", "wandb", "mlflow"]
TRACKERS: tuple[str, ...] = get_args(Tracker)
"""Experiment trackers a run can report to: the progress display, and three tracking services' local stores."""

MAX_PIPELINES = 4
"""Pipelines one run may multiplex. Each has a worker process of its own on every device, so pipelines share a
device the way JigsawRL's share a GPU (on a CPU core, the processes split its time; on a GPU, MPS shares), and
each such worker takes this fraction of the device's Ray resource (`runtime.launch`)."""


class RewardModelSection(Section):
    """A model reward's model: `reward_models.clip_score.path: /models/clip`."""

    path: Path = Field(
        strict=False,
        description="the directory the model and its processor or tokenizer were saved to (save_pretrained)",
    )
    batch_size: int = Field(32, ge=1, le=4096, description="samples per forward pass")


class RewardServerSection(Section):
    """The `http` reward's server (dovetail.rewards.http gives the request and the answer)."""

    url: str = Field(max_length=2000, description="where batches are POSTed as JSON: http(s)://host:port/path")
    # the defaults are the client's own (`rewards.RewardServer`): one place for them
    concurrency: int = Field(RewardServer.concurrency, ge=1, le=256, description="batches in flight at once")
    timeout_s: float = Field(
        RewardServer.timeout_s, gt=0, le=3600, description="seconds one request may take before it is tried again"
    )
    retries: int = Field(
        RewardServer.retries, ge=0, le=20, description="tries after the first, of a batch that timed out or failed"
    )
    backoff_s: float = Field(
        RewardServer.backoff_s, ge=0, le=600, description="wait before the first retry, doubled before each next"
    )
    batch_size: int = Field(RewardServer.batch_size, ge=1, le=4096, description="samples per request")

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if re.fullmatch(r"https?://[^\s/]+(/\S*)?", url) is None:
            raise ValueError(f"{url!r} is no http(s) URL; write it whole, e.g. http://localhost:8000/score")
        return url


def _console_only() -> list[Tracker]:
    return ["console"]


class RuntimeFields(Protocol):
    """What every kind's runtime section (`runtime:`) has."""

    @property
    def trainer_devices(self) -> int | None: ...

    @property
    def profile_samples(self) -> int: ...


class EvalFields(Protocol):
    """What every kind's evaluation section (`eval:`) has."""

    @property
    def every(self) -> int: ...


class RunSection(Section):
    """What every pipeline's run config has: a name, a seed, the optimizer loop, checkpoints, the cluster; and the
    interface each kind's schema completes (`kind`, `policy`, `runtime`, `pipeline_name`, `compute_devices`,
    `scenario`, `shape_overrides`, `policy_options`)."""

    if TYPE_CHECKING:
        # Fields every kind's schema declares itself, with its own type and default. Declared here for the checker
        # only: a field declared on this base would come first in each schema's field order, which is the order
        # of a dumped config (`dump_config`) and of the schema's documentation.
        kind: str
        policy: str
        runtime: RuntimeFields
        eval: EvalFields

    name: PipelineName | None = Field(
        None,
        description="the pipeline's name (node ids, run sub-directory, trace colour); None: the task, or the model "
        "directory's (model.path), or 'digits'",
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
    logger: list[Tracker] = Field(
        default_factory=_console_only,
        max_length=len(TRACKERS),
        description="where each step's metrics and every evaluation go besides metrics.jsonl (dovetail.trackers)",
    )
    import_dirs: list[Annotated[Path, Field(strict=False)]] = Field(
        default_factory=list,
        max_length=16,
        description="where a custom reward's module is found besides sys.path; a config read from a file adds its "
        "own directory and the working directory",
    )

    reward_models: dict[str, RewardModelSection] = Field(
        default_factory=dict,
        max_length=len(MODEL_REWARDS),
        description="each model reward's directory: reward_models.clip_score.path (docs/rewards.md)",
    )
    reward_server: RewardServerSection | None = Field(None, description="the `http` reward's server (docs/rewards.md)")

    reward_samples: ClassVar[str] = "images"
    """What this kind's rewards score: "images" (and videos) or "texts"."""

    @field_validator("import_dirs")
    @classmethod
    def _importable(cls, directories: list[Path]) -> list[Path]:
        """Every process that reads the config (the driver, each Ray worker, and through them the reward process)
        imports reward modules from these directories too, after everything installed (they shadow nothing)."""
        for directory in directories:
            if str(directory) not in sys.path:
                sys.path.append(str(directory))
        return directories

    @model_validator(mode="after")
    def _offload_to_a_host(self) -> "RunSection":
        """CPU offload moves the trainer from a GPU to its host: on a CPU device there is nothing to move."""
        if self.train.cpu_offload and device(self.cluster.device).platform == "cpu":
            raise ValueError(
                f"train.cpu_offload=true: cluster.device={self.cluster.device} is the host's memory already; "
                "set train.cpu_offload: false, or a GPU cluster.device"
            )
        return self

    @model_validator(mode="after")
    def _reward_sections_match_the_rewards(self) -> "RunSection":
        """A model reward has its reward_models section (a directory holding the right model) and the `http` reward
        its reward_server, and neither section is there without its reward."""
        named = set(getattr(self, "reward", None) or {})
        fitting = sorted(n for n, s in MODEL_REWARDS.items() if s.scores == self.reward_samples)
        unfitting = sorted(named & MODEL_REWARDS.keys() - set(fitting))
        if unfitting:
            name = unfitting[0]
            raise ValueError(
                f"reward.{name} scores {MODEL_REWARDS[name].scores}; the model rewards of {self.reward_samples} are "
                f"{fitting}"
            )
        for name, section in self.reward_models.items():
            if name not in fitting:
                raise ValueError(
                    f"reward_models.{name}: no model reward of {self.reward_samples} by that name; those are {fitting}"
                )
            if name not in named:
                raise ValueError(
                    f"reward_models.{name}: reward.{name} is not named; add reward.{name}=1.0 or remove the section"
                )
            problem = model_problem(name, section.path)
            if problem is not None:
                raise ValueError(f"reward_models.{name}.path: {problem}")
        unplaced = sorted(named & MODEL_REWARDS.keys() - self.reward_models.keys())
        if unplaced:
            name = unplaced[0]
            raise ValueError(
                f"reward.{name} loads a model: give reward_models.{name}.path, the directory of "
                f"{MODEL_REWARDS[name].saved}"
            )
        if SERVED_REWARD in named and self.reward_server is None:
            raise ValueError(f"reward.{SERVED_REWARD} asks a reward server: give reward_server.url")
        if self.reward_server is not None and SERVED_REWARD not in named:
            raise ValueError(
                f"reward_server: reward.{SERVED_REWARD} is not named; add reward.{SERVED_REWARD}=1.0 or "
                "remove the section"
            )
        return self

    def reward_sources(self, device: str = "cpu") -> RewardSources:
        """What this run's model rewards and `http` reward need, their models on `device` (the scoring engine's)."""
        models = {name: RewardModel(str(s.path), s.batch_size) for name, s in self.reward_models.items()}
        server = None if self.reward_server is None else RewardServer(**self.reward_server.model_dump())
        return RewardSources(models, server, device)

    @property
    def pipeline_name(self) -> str:
        """The pipeline's name: node ids, run sub-directory, trace colour."""
        raise NotImplementedError

    @property
    def compute_devices(self) -> int:
        """Devices that hold the policy's engines (the cluster's, less a reward pool)."""
        raise NotImplementedError

    def scenario(self, steps: int) -> Scenario:
        """This run as the planner's scenario, built without torch."""
        raise NotImplementedError

    def profiled(self, measured: dict) -> Self:
        """This config, its scenario refined by what its start-up profile measured on the devices (`measured`, the
        kind's profile): what the config alone cannot know, as a user's model's response lengths. A kind whose
        scenario the config fixes returns itself."""
        return self

    def shape_overrides(self) -> dict:
        """The step's cut where the config fixes it instead of the policy (shape field -> value)."""
        raise NotImplementedError

    def policy_options(self) -> PolicyOptions:
        """The run's own choices the policy honours (`sched.policy.PolicyOptions`)."""
        raise NotImplementedError

    @classmethod
    def pipeline_kind(cls) -> str:
        """The kind this schema is the config of (its `kind` field's one value)."""
        return get_args(cls.model_fields["kind"].annotation)[0]

    @field_validator("policy", check_fields=False)
    @classmethod
    def _policy_of_this_kind(cls, policy: str) -> str:
        allowed = policies_for(cls.pipeline_kind())
        if policy not in allowed:
            raise ValueError(
                f"{clip(repr(policy))} is not a policy of a {cls.pipeline_kind()} run; use one of {allowed}"
            )
        return policy

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


REFERENCE = "reference"
"""The policy that schedules nothing: the reference loop, one stage after another in one process."""

AUTO = "auto"
"""The run picks its policy: the one of its kind the simulator predicts fastest on the run's profiled devices
(`runtime.launch.chosen_policy`)."""


def policies_for(pipeline_kind: str) -> list[str]:
    """The policies a run of one pipeline of `pipeline_kind` takes: the reference loop, `auto`, and every registered
    policy that schedules that kind (`Policy.pipeline_kinds`)."""
    return [REFERENCE, AUTO, *scheduling_policies(pipeline_kind)]


def scheduling_policies(pipeline_kind: str) -> list[str]:
    """The registered policies that schedule `pipeline_kind` (`Policy.pipeline_kinds`): what `auto` chooses from."""
    return [name for name in POLICIES if pipeline_kind in policy_class(name).pipeline_kinds]


def multiplexing_policies() -> list[str]:
    """The policies a `kind: multiplex` run takes: those that fit several pipelines together on one pool."""
    return [name for name in POLICIES if policy_class(name).multiplexes]


def auto_candidates(run_kind: str) -> list[str]:
    """What `policy=auto` chooses from for a run of `run_kind`: a pipeline kind's scheduling policies, or for a
    multiplexed run the multiplexing ones."""
    return multiplexing_policies() if run_kind == "multiplex" else scheduling_policies(run_kind)


def policies_by_kind() -> str:
    """Every run kind's policies, one clause per kind: what `dovetail train --policy` takes."""
    kinds = {name: policies_for(name) for name in KINDS} | {"multiplex": [AUTO, *multiplexing_policies()]}
    return "; ".join(f"{name}: {', '.join(policies)}" for name, policies in kinds.items())


def planner_scenario(
    config, pipelines: list[dict], steps: int, trainer_devices: int | None, reward_devices: int
) -> Scenario:
    """The planner's scenario of a run of `pipelines` (scenario pipeline specs) on the config's cluster. A
    `reference` run schedules nothing itself: the planner simulates its first pipeline's kind's stage-after-stage
    policy (`PipelineKind.staged_baseline`), as it does for an `auto` run until the run has chosen."""
    policy = config.policy if config.policy in POLICIES else kind(pipelines[0]["kind"]).staged_baseline
    if "recompute_logprob" not in policy_class(policy).fixes:
        # One optimizer step per batch on the weights that sampled: the trainer's own log-probs, detached, are the
        # old ones (ratio 1), so no separate pass recomputes them (TRL and flow_grpo skip it; so does verl with one
        # PPO epoch and mini-batch). A policy whose recipe decides it (areal) keeps its own, and so does a pipeline
        # that asks for it (an LM one whose rollout engine is not the trainer's: sampling.engine=vllm).
        pipelines = [
            pipeline | {"recompute_logprob": pipeline.get("recompute_logprob", False)} for pipeline in pipelines
        ]
    return parse_scenario(
        {
            "name": f"train-{config.pipeline_name}-{config.policy}",
            "cluster": {"device": config.cluster.device, "devices": config.cluster.devices},
            "pipelines": pipelines,
            "schedule": {
                # what `dovetail simulate` of this scenario would run; a run passes its own steps to `prepare`
                "steps": min(steps, MAX_SIMULATED_STEPS),
                "policies": [policy],
                "trainer_devices": trainer_devices,
                "reward_devices": reward_devices,
            },
        },
        "training config",
    )


class ConfigError(ValueError):
    """An invalid config: the message names each bad field, or the file, and what it allows."""


def invalid(*problems: str) -> ConfigError:
    return ConfigError(problem_report("invalid config", list(problems)))


def imports_rewards(info: ValidationInfo) -> bool:
    """Whether a config's rewards are looked up (and a custom one's module imported) as it is read: `parse_config`'s
    `rewards`."""
    return (info.context or {}).get("rewards", True)


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
