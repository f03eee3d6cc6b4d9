"""Expand FlowGRPO / DanceGRPO steps into sub-stage nodes.

One step of B prompts x G samples becomes, per GAP fragment f (whole groups): generate(f) -> score(f)
[-> logprob(f): the old log-prob recompute of colocated trainers and/or the reference forward for a KL
term] -> train(f, timestep chunk) for each
chunk of the trained timesteps; then one commit (optimizer step) per mini-batch and one publish
(weights to the rollout engines). A TSP chunk of c timesteps trains c (sample, timestep) pairs per
micro-batch in one forward/backward; without TSP (chunk 1) every timestep is its own train node.
Step s trains weights version s; its first train node waits for the previous step's last commit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from dovetail.cost.catalog import DiffusionModel, diffusion_model
from dovetail.cost.model import CostModel, lora_params
from dovetail.graph.node import Engines, Kind, Node, Role, SampleId
from dovetail.graph.shape import Shape
from dovetail.graph.spec import FlowSpec, PipelineSpec

GB = 1e9
BF16 = 2
FSDP_PARAM_BYTES = {"bf16": 2, "fp32": 4}
"""Bytes per parameter an FSDP trainer all-gathers, by `FlowSpec.fsdp_precision`."""


@dataclass(frozen=True)
class FlowShape(Shape):
    """How a policy cuts a step: GAP fragments, TSP chunk (1 = per-timestep loop), whether the trainer
    recomputes old log-probs, and the trainer pool size. `trainer_group`: devices of one FSDP group (None: the
    whole trainer pool); a pool of several groups (hybrid sharding) trains whole train nodes per group and
    all-reduces the gradients across groups at the optimizer step. The group sets per-pass FSDP traffic, trainer
    memory and the optimizer step's cost. `staged`: a stage-synchronous trainer (veRL-Omni, GenRL, flow_grpo): rollout
    fragments split the mini-batch's samples evenly (verl's data.chunk, groups may straddle devices)
    and the trainer's log-prob and train nodes cover the whole mini-batch. `shared`: every node may share its devices
    with other shareable nodes (pipeline multiplexing, as `graph.lm.LMShape.shared`)."""

    fragments: int
    tsp_chunk: int
    recompute_logprob: bool
    trainer_devices: int
    staged: bool = False
    trainer_group: int | None = None
    shared: bool = False

    @property
    def group(self) -> int:
        """Devices of one FSDP trainer group."""
        return self.trainer_group or self.trainer_devices

    @property
    def groups(self) -> int:
        return self.trainer_devices // self.group

    # `build` and `engines` take any pipeline's spec, as `graph.shape.Shape` declares (a planner holds a shape and
    # its spec as a pair the checker cannot see): a flow shape refuses another kind's spec.
    def build(self, spec: PipelineSpec, steps: int, cost: CostModel) -> list[Node]:
        return build_flow(_flow_spec(spec), steps, self, cost)

    def engines(self, spec: PipelineSpec, cost: CostModel) -> Engines:
        return engines(_flow_spec(spec), cost, self.group)

    def describe(self) -> str:
        return (
            f"trainer_devices={self.trainer_devices} (FSDP groups of {self.group}), fragments={self.fragments}, "
            f"tsp_chunk={self.tsp_chunk}"
        )

    @property
    def rollout_engines(self) -> None:
        """A generate fragment holds whole groups and runs on any one device holding the model."""
        return None

    @property
    def rollout_kind(self) -> Kind:
        return Kind.GENERATE

    @property
    def tails_migrate(self) -> bool:
        """A fragment denoises its samples in lockstep: no sample runs longer than the others."""
        return False

    @property
    def sizes_rollout_memory(self) -> bool:
        """The rollout engine is the model's weights; what a fragment needs besides comes with its node."""
        return False

    def check(self, spec: FlowSpec) -> None:
        if self.staged and not 1 <= self.fragments <= spec.samples:
            raise ValueError(f"{spec.name}: fragments={self.fragments} must be in 1..samples={spec.samples}")
        if not self.staged and not 1 <= self.fragments <= spec.prompts:
            raise ValueError(
                f"{spec.name}: fragments={self.fragments} must be in 1..prompts={spec.prompts} (whole groups)"
            )
        if self.fragments % spec.mini_batches:
            raise ValueError(
                f"{spec.name}: fragments={self.fragments} must be a multiple of mini_batches={spec.mini_batches}"
            )
        if not 1 <= self.tsp_chunk <= spec.trained_timesteps:
            raise ValueError(
                f"{spec.name}: tsp_chunk={self.tsp_chunk} must be in 1..trained_timesteps={spec.trained_timesteps}"
            )
        if self.trainer_devices < 1:
            raise ValueError(f"{spec.name}: trainer_devices must be >= 1")
        if not 1 <= self.group <= self.trainer_devices or self.trainer_devices % self.group:
            raise ValueError(
                f"{spec.name}: trainer_group={self.group} must divide trainer_devices={self.trainer_devices}"
            )


def split(total: int, parts: int) -> list[range]:
    """`total` items in `parts` contiguous ranges whose sizes differ by at most one."""
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def trainable_params(spec: FlowSpec) -> float | None:
    """Parameters the trainer trains: None for the whole model, the adapter's count under LoRA."""
    return lora_params(diffusion_model(spec.model), spec.lora.rank, spec.lora.targets) if spec.lora else None


def old_policy_bytes(spec: FlowSpec, trainer_devices: int) -> float:
    """DiffusionNFT's old policy on each trainer device: a bf16 copy of what trains (the whole model, or the
    adapter), sharded as the trainer is; it samples the rollouts and gives the loss its velocity. 0 for the other
    algorithms."""
    if spec.algorithm != "diffusion_nft":
        return 0.0
    trained = trainable_params(spec) or diffusion_model(spec.model).params
    return trained * BF16 / trainer_devices


def _flow_spec(spec: PipelineSpec) -> FlowSpec:
    if not isinstance(spec, FlowSpec):
        raise TypeError(f"{spec.name}: a flow shape cuts a flow pipeline's steps, not a {type(spec).__name__}'s")
    return spec


def engines(spec: FlowSpec, cost: CostModel, trainer_devices: int) -> Engines:
    """Resident memory of the rollout and trainer engines on one device and their sleep / wake costs. A trainer
    whose parameters and optimizer state are offloaded (veRL-Omni's colocated recipes: param_offload and
    optimizer_offload) holds less while it is up, but its wake brings that state in from host memory and its sleep
    takes it back: a switch moves the whole sharded state either way. Where the trainer samples (`sampler: trainer`)
    there is one engine: the sharded trainer generates as it is, holding what it holds to train, and nothing
    switches. DiffusionNFT's trainer also holds its old policy (`old_policy_bytes`)."""
    model = diffusion_model(spec.model)
    rollout = (model.params + model.text_encoder_params) * BF16

    def state(offload: bool) -> float:
        return cost.training_memory(
            model.params,
            model.layers,
            model.hidden,
            0,
            trainer_devices,
            offload=offload,
            trainable=trainable_params(spec),
        ).total

    trainer = (state(spec.offload) + old_policy_bytes(spec, trainer_devices)) / GB
    if spec.sampler == "trainer":
        still = {Role.ROLLOUT: 0.0, Role.TRAINER: 0.0}
        return Engines(resident_gb={Role.ROLLOUT: trainer, Role.TRAINER: trainer}, wake_s=still, sleep_s=still)
    resident = {Role.ROLLOUT: rollout / GB, Role.TRAINER: trainer}
    switch = {
        Role.ROLLOUT: cost.switch(rollout),
        Role.TRAINER: cost.switch(state(False) + old_policy_bytes(spec, trainer_devices)),
    }
    return Engines(resident_gb=resident, wake_s=switch, sleep_s=switch)


def generation_batch(spec: FlowSpec, cost: CostModel, per_sample_gb: float, trainer_group: int = 1) -> int:
    """Samples one batched denoising pass holds at most: a prompt's group (flow_grpo and veRL-Omni generate a group
    per request), with `generation_batch: fragment` every sample of the piece (dovetail's engine), with `sample` one
    (DanceGRPO's sampling loop) — where their activations (`per_sample_gb` each) fit beside the rollout engine (the
    trainer's shard over its `trainer_group` where the trainer samples), else the largest chunk that does, at least
    one: engines take a large group in batches (diffusers' `num_images_per_prompt`), so a 1024-image group generates
    in chunks where one pass of all of it would not fit."""
    if spec.generation_batch == "sample":
        return 1
    free = cost.device.memory_bytes / GB - engines(spec, cost, trainer_group).resident_gb[Role.ROLLOUT]
    fitting = max(1, int(free // per_sample_gb))
    return fitting if spec.generation_batch == "fragment" else min(spec.group, fitting)


def build_flow(spec: FlowSpec, steps: int, shape: FlowShape, cost: CostModel) -> list[Node]:
    """All nodes of `steps` consecutive steps of one flow pipeline: per step, each mini-batch's rollout pieces, their
    trainer nodes and its optimizer step (`_mini_batch`), then the publication (`_publish`)."""

    shape.check(spec)
    cut = _Cut.of(spec, shape, cost)
    nodes: list[Node] = []
    previous_commit: str | None = None
    for step in range(steps):
        weights = (previous_commit,) if previous_commit else ()
        last_commit = ""
        for mini_batch in range(spec.mini_batches):  # at least one (FlowSpec: mini_batches > 0)
            made = _mini_batch(cut, step, mini_batch, weights, previous_commit)
            nodes += made
            previous_commit = last_commit = made[-1].id
        nodes.append(_publish(cut, step, last_commit))
    return [replace(node, exclusive=False) for node in nodes] if shape.shared else nodes


@dataclass(frozen=True)
class _Cut:
    """A flow pipeline cut by a shape, and what every one of its steps shares: the model's latent tokens and DiT
    passes per trained pair, the TSP chunks of the trained timesteps, the rollout's working memory, and the seconds of
    the optimizer step (on the shape's trainer groups) and of the publication (of the parameters that train), and the
    bytes per parameter the FSDP trainer all-gathers."""

    spec: FlowSpec
    shape: FlowShape
    cost: CostModel
    model: DiffusionModel
    tokens: int
    train_cfg: bool
    passes: int
    trainable: float | None
    timestep_chunks: tuple[tuple[int, int], ...]
    generate_gb: float
    """Working memory of one sample in a denoising pass (its activations, with CFG's second pass)."""
    generation_batch: int
    optimizer_s: float
    publish_s: float
    param_bytes: int

    @classmethod
    def of(cls, spec: FlowSpec, shape: FlowShape, cost: CostModel) -> _Cut:
        model = diffusion_model(spec.model)
        tokens = model.latent_tokens(spec.height, spec.width, spec.frames)
        train_cfg = spec.cfg if spec.train_cfg is None else spec.train_cfg
        passes = 2 if train_cfg else 1
        trainable = trainable_params(spec)
        trained = model.params if trainable is None else trainable
        chunks = split(spec.trained_timesteps, -(-spec.trained_timesteps // shape.tsp_chunk))
        per_sample = cost.training_memory(0, 1, model.hidden, tokens * passes, checkpointing=False).activations / GB
        optimizer_s = cost.optimizer_step(trained, shape.group, offloaded=spec.offload)
        optimizer_s += cost.replica_allreduce_seconds(trained, shape.group, shape.groups)
        return cls(
            spec,
            shape,
            cost,
            model,
            tokens,
            train_cfg,
            passes,
            trainable,
            tuple((c.start, c.stop) for c in chunks),
            per_sample,
            generation_batch(spec, cost, per_sample, shape.group),
            optimizer_s,
            0.0 if spec.sampler == "trainer" else cost.publish(trained),  # the trainer that samples holds its weights
            FSDP_PARAM_BYTES[spec.fsdp_precision],
        )

    def node_id(self, step: int, what: str) -> str:
        return f"{self.spec.name}/s{step}/{what}"

    @cached_property
    def _pieces_costed(self) -> dict[int, _PieceCosts]:
        return {}

    def piece(self, samples: int) -> _PieceCosts:
        """What a rollout piece of `samples` samples costs and holds, from its generate node to its trainer nodes:
        priced once per size (a step's pieces have one or two sizes), for every step the cut builds and for the
        totals a search ranks on (`step_totals`)."""
        if samples not in self._pieces_costed:
            self._pieces_costed[samples] = _PieceCosts.of(self, samples)
        return self._pieces_costed[samples]


@dataclass(frozen=True)
class _PieceCosts:
    """The seconds and working memory of the nodes of one rollout piece of `samples` samples under a cut: its
    generate and score nodes and its trainer nodes (the log-prob forward, None where there is none, and a train node
    per TSP chunk), as `_rollout` and `_trainer` give them to their nodes."""

    generate_s: float
    generate_gb: float
    score_s: float
    logprob_s: float | None
    logprob_gb: float
    train_s: tuple[float, ...]
    train_gb: tuple[float, ...]

    @classmethod
    def of(cls, cut: _Cut, n: int) -> _PieceCosts:
        spec, shape, cost, model = cut.spec, cut.shape, cut.cost, cut.model
        batch = min(n, cut.generation_batch)
        generate_s = cost.generate(
            model,
            n,
            spec.height,
            spec.width,
            spec.denoising_steps,
            spec.frames,
            spec.cfg,
            batch=batch,
            sharded_over=shape.group if spec.sampler == "trainer" else 1,
            param_bytes=cut.param_bytes,
        )
        score_s = cost.vlm_score(n) if spec.reward == "vlm" else cost.rule_score(n)
        tokens, micro, group = cut.tokens, spec.micro_batch, shape.group
        logprob_s: float | None = None
        logprob_gb = 0.0
        if shape.recompute_logprob or spec.reference:
            logprob_s = 0.0
            if shape.recompute_logprob:
                logprob_s += cost.dit_logprob(
                    model, n, spec.trained_timesteps, tokens, cut.train_cfg, group, micro, param_bytes=cut.param_bytes
                )
            if spec.reference:  # verl's reference model runs under FSDP CPUOffload: parameters stream in per pass
                logprob_s += cost.dit_logprob(
                    model, n, spec.trained_timesteps, tokens, cut.train_cfg, group, micro, host_streaming=True
                )
            activations = cost.training_memory(0, 1, model.hidden, tokens * cut.passes * micro, checkpointing=False)
            logprob_gb = activations.activations / GB
        train_s, train_gb = [], []
        for start, stop in cut.timestep_chunks:
            activations = cost.training_memory(
                0, model.layers, model.hidden, tokens * cut.passes * micro * (stop - start)
            )
            train_gb.append(activations.activations / GB)
            train_s.append(
                cost.dit_train(
                    model,
                    n,
                    stop - start,
                    tokens,
                    cut.train_cfg,
                    group,
                    micro,
                    trainable=cut.trainable,
                    param_bytes=cut.param_bytes,
                    old_policy=spec.algorithm == "diffusion_nft",
                )
            )
        return cls(generate_s, cut.generate_gb * batch, score_s, logprob_s, logprob_gb, tuple(train_s), tuple(train_gb))


@dataclass(frozen=True)
class StepTotals:
    """One step of a flow pipeline under a shape, summed per node kind without its nodes: what a search ranks a cut
    by (`sched.digen_search`). `seconds[kind]` is the sum of the kind's `cost_s` over the step's nodes in the order
    `build_flow` makes them (so equal to summing the built nodes', to the last bit); the memories are the largest a
    generate and a train node of the step holds."""

    seconds: dict[Kind, float]
    generate_gb: float
    train_gb: float


def step_totals(spec: FlowSpec, shape: FlowShape, cost: CostModel) -> StepTotals:
    """The per-kind totals of one step of `spec` cut by `shape` (see `StepTotals`), each piece priced once per size
    (`_Cut.piece`): the step's nodes are not made. A search weighs hundreds of cuts a plan; building each one's
    graph to add up its costs was most of a plan's time on 64 devices and more."""
    shape.check(spec)
    cut = _Cut.of(spec, shape, cost)
    seconds: dict[Kind, float] = dict.fromkeys(Kind, 0)
    generate_gb = train_gb = float("-inf")
    for mini_batch in range(spec.mini_batches):
        pieces = _piece_sizes(cut, mini_batch)
        for n in pieces:
            piece = cut.piece(n)
            seconds[Kind.GENERATE] += piece.generate_s
            seconds[Kind.SCORE] += piece.score_s
            generate_gb = max(generate_gb, piece.generate_gb)
            if not shape.staged:
                train_gb = _add_trainer(seconds, piece, train_gb)
        if shape.staged:
            train_gb = _add_trainer(seconds, cut.piece(sum(pieces)), train_gb)
        seconds[Kind.COMMIT] += cut.optimizer_s
    seconds[Kind.PUBLISH] += cut.publish_s
    return StepTotals(seconds, generate_gb, train_gb)


def _add_trainer(seconds: dict[Kind, float], piece: _PieceCosts, train_gb: float) -> float:
    """Add a piece's trainer nodes to `seconds`, in `_trainer`'s order; the largest train memory so far."""
    if piece.logprob_s is not None:
        seconds[Kind.LOGPROB] += piece.logprob_s
    for train_s, gb in zip(piece.train_s, piece.train_gb):
        seconds[Kind.TRAIN] += train_s
        train_gb = max(train_gb, gb)
    return train_gb


def _pieces(cut: _Cut, step: int, mini_batch: int) -> list[tuple[SampleId, ...]]:
    """The samples of each rollout piece of one mini-batch: GAP fragments of whole groups, or a staged trainer's even
    split of the mini-batch's samples (verl's data.chunk: a group may straddle two pieces)."""
    spec, shape = cut.spec, cut.shape
    per_mini_batch = shape.fragments // spec.mini_batches
    if shape.staged:
        prompts = split(spec.prompts, spec.mini_batches)[mini_batch]
        samples = [SampleId(step, p, i) for p in prompts for i in range(spec.group)]
        return [tuple(samples[r.start : r.stop]) for r in split(len(samples), per_mini_batch)]
    fragments = split(spec.prompts, shape.fragments)[mini_batch * per_mini_batch : (mini_batch + 1) * per_mini_batch]
    return [tuple(SampleId(step, p, i) for p in fragment for i in range(spec.group)) for fragment in fragments]


def _piece_sizes(cut: _Cut, mini_batch: int) -> list[int]:
    """The number of samples in each rollout piece of one mini-batch, as `_pieces` cuts them (without the samples)."""
    spec, shape = cut.spec, cut.shape
    per_mini_batch = shape.fragments // spec.mini_batches
    if shape.staged:
        samples = len(split(spec.prompts, spec.mini_batches)[mini_batch]) * spec.group
        return [len(r) for r in split(samples, per_mini_batch)]
    fragments = split(spec.prompts, shape.fragments)[mini_batch * per_mini_batch : (mini_batch + 1) * per_mini_batch]
    return [len(fragment) * spec.group for fragment in fragments]


def _mini_batch(
    cut: _Cut, step: int, mini_batch: int, weights: tuple[str, ...], previous_commit: str | None
) -> list[Node]:
    """One mini-batch: generate -> score for each rollout piece; the trainer nodes of each piece once it is scored
    (GAP) or of the whole mini-batch once every piece is (staged); last, its optimizer step. The log-prob forwards
    need the step's `weights`, the train nodes the `previous_commit` too (the mini-batch before)."""
    pieces = _pieces(cut, step, mini_batch)
    first = mini_batch * len(pieces)
    nodes: list[Node] = []
    generated: list[str] = []
    scored: list[str] = []
    for fragment, samples in enumerate(pieces, start=first):
        generate, score = _rollout(cut, step, fragment, samples)
        nodes += [generate, score]
        generated.append(generate.id)
        scored.append(score.id)
        if not cut.shape.staged:
            nodes += _trainer(cut, step, str(fragment), samples, [score.id], [score.id], weights, previous_commit)
    if cut.shape.staged:
        samples = tuple(sample for piece in pieces for sample in piece)
        nodes += _trainer(cut, step, f"-mb{mini_batch}", samples, scored, generated, weights, previous_commit)
    # each update after the first trains the mini-batch's pairs again on the trainer devices, inside the commit
    retrain_s = sum(n.cost_s for n in nodes if n.kind == Kind.TRAIN) / cut.shape.trainer_devices
    commit = Node(
        cut.node_id(step, f"commit{mini_batch}"),
        cut.spec.name,
        step,
        Kind.COMMIT,
        Role.TRAINER,
        tuple(n.id for n in nodes if n.kind == Kind.TRAIN),
        step,
        cost_s=cut.optimizer_s + (cut.spec.updates - 1) * (retrain_s + cut.optimizer_s),
        fixed_s=cut.cost.fixed("optimizer"),
        collective=True,
    )
    return nodes + [commit]


def _rollout(cut: _Cut, step: int, fragment: int, samples: tuple[SampleId, ...]) -> tuple[Node, Node]:
    """A rollout piece's generate node and the score node of its samples."""
    spec, n = cut.spec, len(samples)
    piece = cut.piece(n)
    generate = Node(
        cut.node_id(step, f"gen{fragment}"),
        spec.name,
        step,
        Kind.GENERATE,
        Role.ROLLOUT,
        (),
        step,
        samples,
        cost_s=piece.generate_s,
        fixed_s=cut.cost.fixed("generate"),
        memory_gb=piece.generate_gb,
        tokens=n * cut.tokens,
    )
    score = Node(
        cut.node_id(step, f"score{fragment}"),
        spec.name,
        step,
        Kind.SCORE,
        Role.REWARD,
        (generate.id,),
        step,
        samples,
        cost_s=piece.score_s,
        fixed_s=cut.cost.fixed("score"),
    )
    return generate, score


def _trainer(
    cut: _Cut,
    step: int,
    label: str,
    samples: tuple[SampleId, ...],
    data: list[str],
    generated: list[str],
    weights: tuple[str, ...],
    previous_commit: str | None,
) -> list[Node]:
    """Old / reference log-prob forward (if any; it needs the `generated` samples and the step's `weights`, not
    their rewards: verl awaits an async reward only after it) and one train node per timestep chunk for
    `samples` (it needs the scored `data` and the previous optimizer step)."""
    spec, piece = cut.spec, cut.piece(len(samples))
    out: list[Node] = []
    train_deps = data + ([previous_commit] if previous_commit else [])
    if piece.logprob_s is not None:
        logprob = Node(
            cut.node_id(step, f"logprob{label}"),
            spec.name,
            step,
            Kind.LOGPROB,
            Role.TRAINER,
            (*generated, *weights),
            step,
            samples,
            cost_s=piece.logprob_s,
            fixed_s=cut.cost.fixed("logprob"),
            memory_gb=piece.logprob_gb,
        )
        out.append(logprob)
        train_deps.append(logprob.id)
    for (start, stop), train_s, train_gb in zip(cut.timestep_chunks, piece.train_s, piece.train_gb):
        out.append(
            Node(
                cut.node_id(step, f"train{label}.t{start}-{stop}"),
                spec.name,
                step,
                Kind.TRAIN,
                Role.TRAINER,
                tuple(train_deps),
                step,
                samples,
                timesteps=(start, stop),
                cost_s=train_s,
                fixed_s=cut.cost.fixed("train"),
                memory_gb=train_gb,
            )
        )
    return out


def _publish(cut: _Cut, step: int, last_commit: str) -> Node:
    """The step's weights to the rollout engines, after its last optimizer step."""
    return Node(
        cut.node_id(step, "publish"),
        cut.spec.name,
        step,
        Kind.PUBLISH,
        Role.ANY,
        (last_commit,),
        step,
        cost_s=cut.publish_s,
        fixed_s=cut.cost.fixed("publish"),
        collective=True,
    )
