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

from dovetail.cost.catalog import diffusion_model
from dovetail.cost.model import CostModel, lora_params
from dovetail.graph.node import Engines, Kind, Node, Role
from dovetail.graph.spec import FlowSpec

GB = 1e9
BF16 = 2


@dataclass(frozen=True)
class FlowShape:
    """How a policy cuts a step: GAP fragments, TSP chunk (1 = per-timestep loop), whether the trainer
    recomputes old log-probs, and the trainer pool size. `trainer_group`: devices of one FSDP group (None: the
    whole trainer pool); a pool of several groups (hybrid sharding) trains whole train nodes per group and
    all-reduces the gradients across groups at the optimizer step. The group sets per-pass FSDP traffic, trainer
    memory and the optimizer step's cost. `staged`: a stage-synchronous trainer (veRL-Omni, GenRL, flow_grpo): rollout
    fragments split the mini-batch's samples evenly (verl's data.chunk, groups may straddle devices)
    and the trainer's log-prob and train nodes cover the whole mini-batch. `shared`: every node may share its devices
    with other shareable nodes (pipeline multiplexing, as `graph.llm.LLMShape.shared`)."""

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

    def build(self, spec: FlowSpec, steps: int, cost: CostModel) -> list[Node]:
        return build_flow(spec, steps, self, cost)

    def engines(self, spec: FlowSpec, cost: CostModel) -> Engines:
        return engines(spec, cost, self.group)

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


def engines(spec: FlowSpec, cost: CostModel, trainer_devices: int) -> Engines:
    """Resident memory of the rollout and trainer engines on one device and their sleep / wake costs. A trainer
    whose parameters and optimizer state are offloaded (veRL-Omni's colocated recipes: param_offload and
    optimizer_offload) holds less while it is up, but its wake brings that state in from host memory and its sleep
    takes it back: a switch moves the whole sharded state either way."""
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

    resident = {Role.ROLLOUT: rollout / GB, Role.TRAINER: state(spec.offload) / GB}
    switch = {Role.ROLLOUT: cost.switch(rollout), Role.TRAINER: cost.switch(state(False))}
    return Engines(resident_gb=resident, wake_s=switch, sleep_s=switch)


def build_flow(spec: FlowSpec, steps: int, shape: FlowShape, cost: CostModel) -> list[Node]:
    """All nodes of `steps` consecutive steps of one flow pipeline."""

    shape.check(spec)
    model = diffusion_model(spec.model)
    tokens = model.latent_tokens(spec.height, spec.width, spec.frames)
    train_cfg = spec.cfg if spec.train_cfg is None else spec.train_cfg
    passes = 2 if train_cfg else 1
    fragments = split(spec.prompts, shape.fragments)
    per_mini_batch = shape.fragments // spec.mini_batches
    chunks = [(c.start, c.stop) for c in split(spec.trained_timesteps, -(-spec.trained_timesteps // shape.tsp_chunk))]
    generate_gb = (
        cost.training_memory(0, 1, model.hidden, tokens * passes * spec.group, checkpointing=False).activations / GB
    )
    trainable = trainable_params(spec)
    trained = model.params if trainable is None else trainable
    optimizer_s = cost.optimizer_step(trained, shape.group, offloaded=spec.offload)
    optimizer_s += cost.replica_allreduce_seconds(trained, shape.group, shape.groups)
    publish_s = cost.publish(trained)
    name = spec.name
    nodes: list[Node] = []
    previous_commit: str | None = None
    trainer = shape.group
    micro = spec.micro_batch

    def trainer_nodes(
        prefix: str, step: int, label: str, samples: tuple, data: list[str], weights: tuple, generated: list[str]
    ) -> list[Node]:
        """Old / reference log-prob forward (if any; it needs the `generated` samples and the step's `weights`, not
        their rewards: verl awaits an async reward only after it) and one train node per timestep chunk for
        `samples` (it needs the scored `data` and the previous optimizer step)."""
        n = len(samples)
        out: list[Node] = []
        train_deps = data + ([previous_commit] if previous_commit else [])
        if shape.recompute_logprob or spec.reference:
            logprob_s = 0.0
            if shape.recompute_logprob:
                logprob_s += cost.dit_logprob(model, n, spec.trained_timesteps, tokens, train_cfg, trainer, micro)
            if spec.reference:  # verl's reference model runs under FSDP CPUOffload: parameters stream in per pass
                logprob_s += cost.dit_logprob(
                    model, n, spec.trained_timesteps, tokens, train_cfg, trainer, micro, host_streaming=True
                )
            logprob = Node(
                f"{prefix}/logprob{label}",
                name,
                step,
                Kind.LOGPROB,
                Role.TRAINER,
                (*generated, *weights),
                step,
                samples,
                cost_s=logprob_s,
                memory_gb=cost.training_memory(
                    0, 1, model.hidden, tokens * passes * micro, checkpointing=False
                ).activations
                / GB,
            )
            out.append(logprob)
            train_deps.append(logprob.id)
        for start, stop in chunks:
            out.append(
                Node(
                    f"{prefix}/train{label}.t{start}-{stop}",
                    name,
                    step,
                    Kind.TRAIN,
                    Role.TRAINER,
                    tuple(train_deps),
                    step,
                    samples,
                    chunk=(start, stop),
                    cost_s=cost.dit_train(
                        model, n, stop - start, tokens, train_cfg, trainer, micro, trainable=trainable
                    ),
                    memory_gb=cost.training_memory(
                        0, model.layers, model.hidden, tokens * passes * micro * (stop - start)
                    ).activations
                    / GB,
                )
            )
        return out

    for step in range(steps):
        prefix = f"{name}/s{step}"
        weights_of_step = (previous_commit,) if previous_commit else ()
        for mini_batch in range(spec.mini_batches):
            train_ids: list[str] = []
            if shape.staged:
                batch_samples = [
                    (step, p, i) for p in split(spec.prompts, spec.mini_batches)[mini_batch] for i in range(spec.group)
                ]
                pieces = [tuple(batch_samples[r.start : r.stop]) for r in split(len(batch_samples), per_mini_batch)]
            else:
                pieces = [
                    tuple((step, p, i) for p in fragments[f] for i in range(spec.group))
                    for f in range(mini_batch * per_mini_batch, (mini_batch + 1) * per_mini_batch)
                ]
            scores: list[str] = []
            generates: list[str] = []
            for f, samples in zip(range(mini_batch * per_mini_batch, (mini_batch + 1) * per_mini_batch), pieces):
                n = len(samples)
                generate = Node(
                    f"{prefix}/gen{f}",
                    name,
                    step,
                    Kind.GENERATE,
                    Role.ROLLOUT,
                    (),
                    step,
                    samples,
                    cost_s=cost.generate(
                        model, n, spec.height, spec.width, spec.denoising_steps, spec.frames, spec.cfg
                    ),
                    memory_gb=generate_gb,
                    tokens=n * tokens,
                )
                score_s = cost.vlm_score(n) if spec.reward == "vlm" else cost.rule_score(n)
                score = Node(
                    f"{prefix}/score{f}",
                    name,
                    step,
                    Kind.SCORE,
                    Role.REWARD,
                    (generate.id,),
                    step,
                    samples,
                    cost_s=score_s,
                )
                nodes += [generate, score]
                scores.append(score.id)
                generates.append(generate.id)
                if not shape.staged:
                    made = trainer_nodes(prefix, step, str(f), samples, [score.id], weights_of_step, [score.id])
                    nodes += made
                    train_ids += [m.id for m in made if m.kind == Kind.TRAIN]
            if shape.staged:
                made = trainer_nodes(
                    prefix, step, f"-mb{mini_batch}", tuple(batch_samples), scores, weights_of_step, generates
                )
                nodes += made
                train_ids += [m.id for m in made if m.kind == Kind.TRAIN]
            commit = Node(
                f"{prefix}/commit{mini_batch}",
                name,
                step,
                Kind.COMMIT,
                Role.TRAINER,
                tuple(train_ids),
                step,
                cost_s=optimizer_s,
                collective=True,
            )
            nodes.append(commit)
            previous_commit = commit.id
        nodes.append(
            Node(
                f"{prefix}/publish",
                name,
                step,
                Kind.PUBLISH,
                Role.ANY,
                (previous_commit,),
                step,
                cost_s=publish_s,
                collective=True,
            )
        )
    return [replace(node, exclusive=False) for node in nodes] if shape.shared else nodes
