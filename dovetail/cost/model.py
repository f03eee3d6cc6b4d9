"""CostModel: how long a piece of work takes on a device, and how much memory it holds.

Durations are analytic — FLOPs / (peak x efficiency) for compute-bound work, bytes / (bandwidth x
efficiency) for memory-bound work, collectives on the link their group crosses (NVLink or PCIe inside a node,
the NIC once the group spans nodes: bandwidth plus one hop latency per ring step) — with every efficiency taken
from `calibration.py`. LoRA (`lora_params`): the trainer keeps the frozen base weights, all-gathers them for
forward and backward as before, but trains, reduces, optimizes and publishes only the adapter.
`from_measurements` replays a profiled run (a per-op-kind correction, and where the profile timed a kind at two
sizes a fixed cost per pass: `fixed`); the online correction during a run is the policies' `sched.policy.CostTracker`,
fed by both executors.
"""

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from dovetail.cost.calibration import DEFAULT, Calibration
from dovetail.cost.catalog import Device, DiffusionModel, LanguageModel
from dovetail.cost.catalog import device as lookup_device

BF16 = 2
FP32 = 4
FP64 = 8

OP_KINDS = (
    "prefill",  # LM prompt processing
    "decode",  # LM token generation
    "migrate",  # moving a running LM sequence: re-prefill on the destination
    "generate",  # diffusion denoising (text encode + DiT steps + VAE decode)
    "score",  # reward
    "logprob",  # old / reference log-probabilities (forward only)
    "train",  # forward + backward
    "optimizer",  # optimizer step (commit)
    "sync",  # gradients added across trainer replicas at the commit
    "publish",  # weight publication trainer -> rollout
    "switch",  # sleep / wake / offload of an engine
)


@dataclass(frozen=True)
class MemoryUse:
    """Bytes held on one device."""

    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.kv_cache


DECODES_KEPT = 200_000
"""Decode figures a cost model keeps (`CostModel.decode`); past it they are dropped and priced again as asked: a plan
on 256 devices prices some tens of thousands."""


class CostModel:
    """Predicts seconds and bytes for one kind of device.

    `devices` arguments are the number of devices that cooperate on one piece of work (tensor
    parallel for rollout engines, the FSDP group for training); the work is split evenly.
    """

    def __init__(self, device: Device | str, calibration: Calibration = DEFAULT):
        self.device = lookup_device(device) if isinstance(device, str) else device
        self.calibration = calibration
        self._scale: dict[str, float] = {}
        self._fixed: dict[str, float] = {}
        self._with_rollout_memory: dict[float, CostModel] = {}
        self._decodes: dict[tuple, float] = {}
        """`decode`'s seconds by its model, devices and sequences (`DECODES_KEPT` at most)."""
        # Device-specific kernel efficiency relative to the Hopper-fitted factors.
        self._vendor = calibration.device_efficiency.get(self.device.name, 1.0)

    # --- correction from a profiled run ----------------------------------------------------------------------

    @classmethod
    def from_measurements(
        cls,
        device: Device | str,
        records: Iterable[tuple[str, float, float]],
        calibration: Calibration = DEFAULT,
        per_pass: bool = False,
    ) -> "CostModel":
        """A cost model whose predictions match a profiled run exactly per op kind.

        `records` are (op_kind, predicted_s, measured_s) for each node of the run, `predicted_s` being
        what an uncorrected model of the same device and calibration predicted. Each kind's correction
        becomes sum(measured) / sum(predicted), the ratio that reproduces the run's total time of it.

        `per_pass`: the records are one pass each, and a kind timed at two sizes or more gets the least-squares
        line measured = fixed + scale x predicted, its intercept the seconds every pass pays whatever its size
        (`fixed`: a CPU core's launches and hand-offs, which make a pass of 128 responses cost 0.75 of eight
        passes of 16 here). A line with a negative intercept or slope keeps the ratio.
        """
        model = cls(device, calibration)
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for kind, predicted_s, measured_s in records:
            model._check(kind, predicted_s, measured_s)
            by_kind.setdefault(kind, []).append((predicted_s, measured_s))
        for kind, points in by_kind.items():
            predicted, measured = sum(p for p, _ in points), sum(m for _, m in points)
            fixed, scale = pass_line(points) if per_pass else (0.0, 0.0)
            if fixed > 0 and scale > 0:
                model._fixed[kind], model._scale[kind] = fixed, scale
            else:
                model._scale[kind] = measured / predicted
        return model

    def on_busy_cores(self) -> "CostModel":
        """This model, fitted to a CPU core's start-up profile, as a run on those cores pays it: every kind's seconds
        `Calibration.cpu_run_slowdown` longer (the driver and Ray share the cores the profile had to itself) and
        every node `cpu_node_call_s` more (its Ray call, paid on each device it runs on: `fixed`). A GPU's driver and
        Ray have host cores of their own: a GPU's model is returned as it is."""
        if self.device.platform != "cpu":
            return self
        slowdown = self.calibration.cpu_run_slowdown
        model = CostModel(self.device, self.calibration)
        model._scale = {kind: self.scale(kind) * slowdown for kind in OP_KINDS}
        model._fixed = {kind: self.fixed(kind) * slowdown + self.calibration.cpu_node_call_s for kind in OP_KINDS}
        return model

    def fixed(self, kind: str) -> float:
        """Seconds a pass of this kind pays on each device it runs on, whatever its size (0 unless fitted): a graph
        node carries it beside its spreadable work (`Node.fixed_s`)."""
        return self._fixed.get(kind, 0.0)

    def scale(self, kind: str) -> float:
        """Current measured/analytic correction for an op kind (1.0 until observed)."""
        return self._scale.get(kind, 1.0)

    def corrections(self) -> dict[str, float]:
        return dict(self._scale)

    def fixed_costs(self) -> dict[str, float]:
        return dict(self._fixed)

    @staticmethod
    def _check(kind: str, predicted_s: float, measured_s: float) -> None:
        if kind not in OP_KINDS:
            raise ValueError(f"unknown op kind {kind!r}; use one of {', '.join(OP_KINDS)}")
        if predicted_s <= 0 or measured_s <= 0:
            raise ValueError(f"{kind}: predicted_s={predicted_s} and measured_s={measured_s} must both be > 0")

    def _corrected(self, kind: str, seconds: float) -> float:
        return seconds * self.scale(kind)

    def with_rollout_memory(self, fraction: float) -> "CostModel":
        """The same model with rollout engines limited to `fraction` of device memory (weights + KV cache). One per
        fraction, kept: a model never changes once made, and the graph builders memoize a step's rollout by its cost
        model's identity (`graph.lm._step_rollout`), so the many cuts of a search (jigsaw's: each pipeline's rollout
        memory sized alike) price their decoding once, not once per cut."""
        if fraction not in self._with_rollout_memory:
            self._with_rollout_memory[fraction] = self._recalibrated(rollout_memory_fraction=fraction)
        return self._with_rollout_memory[fraction]

    def with_interference(self, table: dict[tuple[str, str], float]) -> "CostModel":
        """The same model with `table`'s slowdowns (measured on the run's devices) over its interference table."""
        return self._recalibrated(interference=self.calibration.interference | table)

    def ranked_on(self, other: Device) -> "CostModel":
        """The same model (calibration, corrections) on `other` with this device's node size: a search ranks its cuts
        on it, so that which it considers does not depend on the device's speed or memory (the search filters by the
        device's memory itself: `sched.digen_search.candidates`)."""
        model = CostModel(replace(other, node_size=self.device.node_size), self.calibration)
        model._scale, model._fixed = dict(self._scale), dict(self._fixed)
        return model

    def _recalibrated(self, **changes) -> "CostModel":
        """The same model, corrections included, with `changes` to its calibration."""
        model = CostModel(self.device, replace(self.calibration, **changes))
        model._scale, model._fixed = dict(self._scale), dict(self._fixed)
        return model

    # --- primitives -----------------------------------------------------------------------------

    def compute_seconds(self, flops: float, efficiency: float, devices: int = 1) -> float:
        return flops / (self.device.peak_flops * efficiency * self._vendor * devices)

    def memory_seconds(self, nbytes: float, efficiency: float, devices: int = 1) -> float:
        return nbytes / (self.device.memory_bandwidth * efficiency * devices)

    def host_seconds(self, nbytes: float) -> float:
        """Copying `nbytes` between one device and host memory (offload, sleep / wake, publication)."""
        return nbytes / (self.device.host_bandwidth * self.calibration.host_link_efficiency)

    def link(self, devices: int, per_node: int | None = None) -> tuple[float, float]:
        """(bus bandwidth in bytes/s, seconds per ring step) of a ring collective over `devices` contiguous devices.

        Inside a node: the intra-node link. Across nodes NCCL runs one ring per NIC rail, each entering and leaving a
        node through the NIC of one of the group's devices there, so the node's share of the ring's traffic crosses
        the network on `per_node` NICs side by side (the fewest devices the group has on any node: for a contiguous
        group, devices % node_size or a whole node): the ring moves at the smaller of the intra-node link and those
        NICs together, each at the efficiency nccl-tests reaches on it, and every ring step pays the network's hop
        latency. FULL_SHARD over whole nodes is thus nearly as fast as inside one (8 x 400 Gb/s NICs per 8 H100s:
        320 GB/s against NVLink's 360); a hybrid-sharded replica all-reduce has one device per node in each ring
        (`per_node=1`: one NIC)."""
        d, cal = self.device, self.calibration
        intra = d.interconnect_bandwidth * cal.collective_bandwidth_efficiency
        if devices <= d.node_size:
            return intra, d.interconnect_latency_s
        if per_node is None:
            per_node = devices % d.node_size or d.node_size
        return min(intra, per_node * d.network_bandwidth * cal.network_collective_efficiency), d.network_latency_s

    def collective_seconds(self, nbytes: float, devices: int, messages: int = 1, per_node: int | None = None) -> float:
        """A ring all-gather or reduce-scatter of an (unsharded) tensor of `nbytes` over `devices`, issued as
        `messages` separate collectives (FSDP: one per wrapped layer): devices - 1 ring steps each, every step
        paying the link's hop latency and moving nbytes / devices at the ring's bus bandwidth (`link`)."""
        if devices <= 1:
            return 0.0
        bandwidth, latency = self.link(devices, per_node)
        return (devices - 1) * (messages * latency + nbytes / devices / bandwidth)

    def allreduce_seconds(self, nbytes: float, devices: int) -> float:
        """A ring all-reduce (reduce-scatter + all-gather) of `nbytes` over `devices`: 2 (devices - 1) steps.
        What a tensor-parallel layer pays twice per forward (after attention and after the MLP)."""
        return 2 * self.collective_seconds(nbytes, devices)

    # --- language models: FLOPs -------------------------------------------------------------------

    @staticmethod
    def lm_forward_flops(model: LanguageModel, lengths: Sequence[int]) -> float:
        """Causal forward over whole sequences: 2 FLOPs per parameter per token + attention."""
        linear = 2 * model.params * sum(lengths)
        attention = 2 * model.layers * model.attention_width * sum(n * n for n in lengths)
        return linear + attention

    # --- language models: durations -------------------------------------------------------------

    def _forward_seconds(self, model: LanguageModel, lengths: Sequence[int], devices: int) -> float:
        """A tensor-parallel forward over whole sequences: compute split over the engine, plus two all-reduces of
        the tokens' hidden states per layer on the engine's link."""
        flops = self.lm_forward_flops(model, lengths)
        allreduces = 2 * model.layers * self.allreduce_seconds(sum(lengths) * model.hidden * BF16, devices)
        return self.compute_seconds(flops, self.calibration.prefill_mfu, devices) + allreduces

    def prefill(self, model: LanguageModel, prompt_lengths: Sequence[int], devices: int = 1) -> float:
        return self._corrected("prefill", self._forward_seconds(model, prompt_lengths, devices))

    def migrate(self, model: LanguageModel, context_lengths: Sequence[int], devices: int = 1) -> float:
        """Moving running sequences to other devices costs a prefill of their context there."""
        return self._corrected("migrate", self._forward_seconds(model, context_lengths, devices))

    def reprefill(self, model: LanguageModel, context_lengths: Sequence[int], devices: int = 1) -> float:
        """A multi-turn trajectory's next turn prefilling what it holds (its turns and observations so far), inside
        its engine's decode call: corrected as the decode is, which is what a profile or a run times it in."""
        return self._corrected("decode", self._forward_seconds(model, context_lengths, devices))

    def kv_cache_bytes(self, model: LanguageModel, devices: int = 1) -> float:
        """KV-cache room of a rollout engine: its memory share minus the weights."""
        budget = self.device.memory_bytes * self.calibration.rollout_memory_fraction * devices
        room = budget - model.params * BF16
        if room <= 0:
            raise ValueError(
                f"{model.name} weights ({model.params * BF16 / 1e9:.0f} GB) do not fit in "
                f"{devices}x {self.device.name} rollout memory; raise the tensor-parallel degree"
            )
        return room

    def decode(
        self,
        model: LanguageModel,
        context_start: Sequence[int],
        new_tokens: Sequence[int],
        devices: int = 1,
    ) -> float:
        """Sequences decoding together (continuous batching) until the last of them is done.

        Sequence i starts at context length `context_start[i]` and generates `new_tokens[i]` tokens.
        Each iteration reads the weights once and every active sequence's KV cache, costs 2 FLOPs per
        parameter per active sequence, and pays per layer a fixed overhead plus two all-reduces of the active
        sequences' hidden states on the engine's link; an iteration is bound by whichever of compute and
        bandwidth is slower. However many devices the engine has, an iteration never takes less than its
        all-reduces and launches: one response's per-token latency has a floor. Iterations are grouped into
        segments of constant active count, so the sum is exact and O(n log n). More sequences than the KV cache
        holds run in waves (paged KV: what counts is the tokens held, not the maximum length).
        """
        if len(context_start) != len(new_tokens):
            raise ValueError("decode: context_start and new_tokens must have one entry per sequence")
        work = sorted(zip(new_tokens, context_start))
        work = [(t, c) for t, c in work if t > 0]
        if not work:
            return 0.0
        # Kept: a search's cuts that differ only where the tail goes or how wide its engine is decode the same
        # sequences on the same home engines (every band below the migration edge), and its one-step screen and its
        # finalists' runs the same first step. The sum below depends on nothing else (the corrections are fixed once
        # the model is made), so a kept figure is the one it would compute again.
        key = (model, devices, tuple(work))
        if key in self._decodes:
            return self._decodes[key]
        if len(self._decodes) >= DECODES_KEPT:
            self._decodes.clear()
        seconds = self._decodes[key] = self._decode_seconds(model, work, devices)
        return seconds

    def _decode_seconds(self, model: LanguageModel, work: list[tuple[int, int]], devices: int) -> float:
        """`decode` of `work`: (new tokens, start context) of each sequence, fewest new tokens first, none empty."""
        cal = self.calibration
        kv_room = self.kv_cache_bytes(model, devices)
        weight_bytes = model.params * BF16
        kv = model.kv_bytes_per_token
        total = 0.0
        done_at = 0  # iterations already accounted for
        context_sum = sum(c for _, c in work)  # sum of start contexts of still-active sequences
        active = len(work)
        # `compute_seconds`, `memory_seconds` and `allreduce_seconds` written out with their divisors and the engine's
        # link taken once (the same figures, operation for operation): a search prices tens of thousands of these.
        compute_per_flop = self.device.peak_flops * cal.decode_mfu * self._vendor * devices
        memory_per_byte = self.device.memory_bandwidth * cal.decode_bandwidth_efficiency * devices
        bandwidth, latency = self.link(devices) if devices > 1 else (1.0, 0.0)
        for finished_at, start in work:
            span = finished_at - done_at
            if span > 0:
                # Over iterations j in [done_at, finished_at) each active sequence has context c + j.
                kv_tokens = context_sum * span + active * (done_at + finished_at - 1) * span / 2
                flops = 2 * model.params * active * span + 4 * model.layers * model.attention_width * kv_tokens
                waves = max(1, math.ceil(kv * kv_tokens / span / kv_room))
                compute = flops / compute_per_flop
                memory = (waves * span * weight_bytes + kv * kv_tokens) / memory_per_byte
                hidden_bytes = active / waves * model.hidden * BF16
                allreduce = 2 * ((devices - 1) * (latency + hidden_bytes / devices / bandwidth) if devices > 1 else 0.0)
                overhead = model.layers * (cal.decode_layer_overhead_s + 2 * allreduce)
                total += max(compute, memory) + waves * span * overhead
                done_at = finished_at
            active -= 1
            context_sum -= start
        return self._corrected("decode", total)

    def logprob(self, model: LanguageModel, lengths: Sequence[int], devices: int = 1, reference: bool = False) -> float:
        """Old (actor) or reference log-probabilities: one forward over prompt + response."""
        seconds = self.compute_seconds(self.lm_forward_flops(model, lengths), self.calibration.logprob_mfu, devices)
        if reference:
            seconds *= self.calibration.reference_offload_factor
        return self._corrected("logprob", seconds)

    def train(
        self,
        model: LanguageModel,
        lengths: Sequence[int],
        devices: int = 1,
        checkpointing: bool = True,
        lora: bool = False,
    ) -> float:
        """Forward + backward, plus one more forward when activations are recomputed (`backward_forwards`)."""
        forwards = 1 + backward_forwards(lora) + (1 if checkpointing else 0)
        flops = forwards * self.lm_forward_flops(model, lengths)
        return self._corrected("train", self.compute_seconds(flops, self.calibration.train_mfu, devices))

    def rule_score(self, samples: int) -> float:
        return self._corrected("score", samples * self.calibration.rule_reward_s_per_sample)

    # --- diffusion transformers -----------------------------------------------------------------

    @staticmethod
    def dit_forward_flops(model: DiffusionModel, latent_tokens: int) -> float:
        """One DiT forward for one sample: linear layers over image (+ text) tokens + attention."""
        if model.cross_attention:
            linear = 2 * model.params * latent_tokens
            attention = 4 * model.layers * model.hidden * latent_tokens * (latent_tokens + model.text_tokens)
        else:
            tokens = latent_tokens + model.text_tokens
            linear = 2 * model.params * tokens
            attention = 4 * model.layers * model.hidden * tokens * tokens
        return linear + attention

    def text_encode_seconds(self, model: DiffusionModel, prompts: int, devices: int = 1) -> float:
        flops = 2 * model.text_encoder_params * model.text_tokens * prompts
        return self.compute_seconds(flops, self.calibration.encoder_mfu, devices)

    def vae_decode_seconds(
        self, model: DiffusionModel, samples: int, height: int, width: int, frames: int = 1, devices: int = 1
    ) -> float:
        flops = model.vae_decoder_flops_per_pixel * height * width * frames * samples
        return self.compute_seconds(flops, self.calibration.encoder_mfu, devices)

    def generate(
        self,
        model: DiffusionModel,
        samples: int,
        height: int,
        width: int,
        steps: int,
        frames: int = 1,
        cfg: bool = False,
        devices: int = 1,
        batch: int | None = None,
        sharded_over: int = 1,
        param_bytes: int = BF16,
    ) -> float:
        """Text encoding (once per sample), `steps` DiT forwards (two with CFG) at the efficiency of a pass
        holding `batch` samples (None: all `samples`, one batched forward per denoising step), VAE decode.

        A replicated rollout engine holds the whole model (`sharded_over` 1). Where the FSDP-sharded trainer samples
        (DanceGRPO: the training module generates, its shard on each of `sharded_over` devices), every denoising
        forward all-gathers the `param_bytes`-per-parameter weights, one collective per layer, prefetched under the
        layer before: a forward takes the longer of its compute and its all-gather."""
        tokens = model.latent_tokens(height, width, frames)
        passes = samples * steps * (2 if cfg else 1)
        held = (batch or samples) * (2 if cfg else 1) * tokens
        mfu = self.pass_mfu(self.calibration.dit_inference_mfu, held)
        dit = self.compute_seconds(passes * self.dit_forward_flops(model, tokens), mfu, devices)
        if sharded_over > 1:
            forwards = math.ceil(samples / (batch or samples)) * steps
            gather = self.collective_seconds(model.params * param_bytes, sharded_over, model.layers)
            dit = self.fsdp_pass_seconds(model, dit, forwards * gather, param_bytes, casts=forwards)
        seconds = (
            dit
            + self.text_encode_seconds(model, samples, devices)
            + self.vae_decode_seconds(model, samples, height, width, frames, devices)
        )
        return self._corrected("generate", seconds)

    def replica_allreduce_seconds(self, params: float, group: int, replicas: int) -> float:
        """Hybrid sharding (HSDP): `replicas` FSDP groups of `group` devices each hold a full copy of the model;
        at the optimizer step every device all-reduces its 1/group shard of the accumulated gradients (of the
        `params` trained) with the same shard of the other replicas — a ring over the replicas, on the intra-node
        interconnect while all of them fit in one node and otherwise across the network, each ring through its
        devices' own NICs (one per node: the only traffic of HSDP that crosses nodes)."""
        if replicas <= 1:
            return 0.0
        nbytes = params * self.calibration.grad_reduce_bytes / group
        bandwidth, latency = self.link(group * replicas, per_node=1)
        return self._corrected("sync", 2 * (replicas - 1) * (latency + nbytes / replicas / bandwidth))

    def pass_mfu(self, mfu: float, tokens: float) -> float:
        """Efficiency of one forward/backward holding `tokens` tokens: the large-pass `mfu` scaled down by
        small-batch under-utilisation, tokens / (tokens + dit_half_mfu_tokens)."""
        return mfu * tokens / (tokens + self.calibration.dit_half_mfu_tokens)

    def fsdp_pass_seconds(
        self, model: DiffusionModel, compute: float, transfer: float, param_bytes: int, casts: int
    ) -> float:
        """Wall seconds of FSDP passes whose compute takes `compute` and whose parameter / gradient collectives take
        `transfer`, prefetched under the compute. Parameters gathered in bf16 (verl): the longer of the two. In fp32
        under bf16 autocast (fastvideo, DanceGRPO's and MixGRPO's trainer: `Calibration.fastvideo_exposed_fraction`
        names the sources), each of the `casts` forwards first casts every gathered fp32 weight to bf16 (4 bytes
        read, 2 written per parameter, at the optimizer's streaming efficiency) on the compute stream, and
        `fastvideo_exposed_fraction` of the shorter of compute and transfer is not hidden: one image per pass leaves
        each layer's compute too short to cover its gather, limit_all_gathers keeps at most two in flight, and
        without forward_prefetch a block's gather is issued only when the host reaches the block."""
        if param_bytes != FP32:
            return max(compute, transfer)
        cast = self.memory_seconds(
            casts * model.params * (FP32 + BF16), self.calibration.optimizer_bandwidth_efficiency
        )
        compute += cast
        return max(compute, transfer) + self.calibration.fastvideo_exposed_fraction * min(compute, transfer)

    def fsdp_pass_transfer_seconds(
        self,
        model: DiffusionModel,
        devices: int,
        backward: bool,
        host_streaming: bool = False,
        trainable: float | None = None,
        param_bytes: int = BF16,
    ) -> float:
        """Per-pass traffic of an FSDP (ZeRO-3) group, one collective per layer: the parameters all-gathered for
        the forward in the group's parameter dtype (`param_bytes`: verl's bf16, fastvideo's fp32) and, with a
        backward, all-gathered again and the gradients of the `trainable` parameters (None: all; LoRA: the adapter)
        reduce-scattered; with parameter CPU offload (verl's reference model) each forward also copies the
        device's shard in from host."""
        weights = model.params * param_bytes
        seconds = self.collective_seconds(weights, devices, model.layers)
        if backward:
            grads = (model.params if trainable is None else trainable) * self.calibration.grad_reduce_bytes
            seconds += self.collective_seconds(weights, devices, model.layers)
            seconds += self.collective_seconds(grads, devices, model.layers)
        if host_streaming:
            seconds += self.host_seconds(weights / devices)
        return seconds

    def dit_passes(
        self,
        model: DiffusionModel,
        pairs: int,
        latent_tokens: int,
        *,
        forwards: int,
        mfu: float,
        backward: bool,
        cfg: bool = False,
        devices: int = 1,
        pairs_per_pass: int | None = None,
        host_streaming: bool = False,
        trainable: float | None = None,
        param_bytes: int = BF16,
        casts: int = 1,
    ) -> float:
        """Device-seconds (`devices` x wall) of an FSDP group of `devices` running `pairs` (sample, timestep)
        transitions, spread evenly over the devices, each device its share in passes of at most
        `pairs_per_pass` pairs (None: one pass). A pass costs `forwards` DiT forwards per pair at the
        pass's efficiency, or its parameter / gradient traffic if that is longer (prefetch overlaps the
        two; `fsdp_pass_seconds`, where `casts` of the forwards run the model's forward under autocast); the
        busiest device sets the wall time."""
        per_device = math.ceil(pairs / devices)
        passes = math.ceil(per_device / (pairs_per_pass or per_device))
        held = per_device / passes * (2 if cfg else 1)
        compute = self.compute_seconds(
            forwards * held * self.dit_forward_flops(model, latent_tokens), self.pass_mfu(mfu, held * latent_tokens)
        )
        transfer = self.fsdp_pass_transfer_seconds(model, devices, backward, host_streaming, trainable, param_bytes)
        return devices * passes * self.fsdp_pass_seconds(model, compute, transfer, param_bytes, casts)

    def dit_logprob(
        self,
        model: DiffusionModel,
        samples: int,
        timesteps: int,
        latent_tokens: int,
        cfg: bool = False,
        devices: int = 1,
        micro_batch: int | None = None,
        host_streaming: bool = False,
        param_bytes: int = BF16,
    ) -> float:
        """Forward-only log-probs of `samples` samples at `timesteps` timesteps each in the trainers' loop: one
        forward pass per micro-batch of samples per timestep. Device-seconds over the group."""
        seconds = timesteps * self.dit_passes(
            model,
            samples,
            latent_tokens,
            forwards=1,
            mfu=self.calibration.dit_logprob_mfu,
            backward=False,
            cfg=cfg,
            devices=devices,
            pairs_per_pass=micro_batch,
            host_streaming=host_streaming,
            param_bytes=param_bytes,
        )
        return self._corrected("logprob", seconds)

    def dit_train(
        self,
        model: DiffusionModel,
        samples: int,
        timesteps: int,
        latent_tokens: int,
        cfg: bool = False,
        devices: int = 1,
        micro_batch: int | None = None,
        checkpointing: bool = True,
        trainable: float | None = None,
        param_bytes: int = BF16,
        old_policy: bool = False,
    ) -> float:
        """Forward + backward of `samples` samples at `timesteps` timesteps each. The samples x timesteps pairs
        spread over the group (TSP: devices may hold different timesteps of one sample) in passes of up to
        micro_batch x timesteps pairs; the per-timestep loop is one call per timestep (timesteps=1). With
        `trainable` adapter parameters (LoRA) the backward skips the base weights' gradients. `old_policy`:
        DiffusionNFT's loss also reads the old policy's velocity at each pair, one more forward without gradient.
        Device-seconds over the group."""
        lora = trainable is not None
        extra = 1 if old_policy else 0
        seconds = self.dit_passes(
            model,
            samples * timesteps,
            latent_tokens,
            forwards=1 + extra + backward_forwards(lora) + (1 if checkpointing else 0),
            mfu=self.calibration.dit_train_mfu,
            backward=True,
            cfg=cfg,
            devices=devices,
            pairs_per_pass=micro_batch and micro_batch * timesteps,
            trainable=trainable,
            param_bytes=param_bytes,
            casts=1 + extra + (1 if checkpointing else 0),  # the forwards, and the recompute in the backward
        )
        return self._corrected("train", seconds)

    def vlm_score(self, samples: int, devices: int = 1) -> float:
        """Model-based reward (a VLM judge) for generated images."""
        return self._corrected("score", samples * self.calibration.vlm_reward_s_per_image_device / devices)

    # --- optimizer, switches, publication --------------------------------------------------------

    def optimizer_step(self, params: float, devices: int = 1, offloaded: bool = False) -> float:
        """AdamW over FSDP-sharded state: read/write fp32 master + 2 moments, read bf16 grads.

        With the optimizer offloaded, the grads go to host and the new bf16 weights come back.
        """
        state_bytes = params * (3 * FP32 * 2 + BF16)
        seconds = self.memory_seconds(state_bytes, self.calibration.optimizer_bandwidth_efficiency, devices)
        if offloaded:
            seconds += self.host_seconds(2 * params * BF16 / devices)
        return self._corrected("optimizer", seconds)

    def switch(self, resident_bytes: float) -> float:
        """Sleep or wake an engine: move its resident bytes over the host link, plus a fixed cost."""
        seconds = self.calibration.switch_fixed_s + self.host_seconds(resident_bytes)
        return self._corrected("switch", seconds)

    def publish(self, params: float) -> float:
        """The `params` trained (the whole model, or a LoRA adapter) in bf16 to every rollout engine (each holds a
        whole replica); engines receive in parallel, each through its host link (verl's default "naive" checkpoint
        engine)."""
        nbytes = params * BF16
        seconds = (
            self.calibration.publish_fixed_s + self.host_seconds(nbytes) / self.calibration.publish_bandwidth_efficiency
        )
        return self._corrected("publish", seconds)

    # --- memory ---------------------------------------------------------------------------------

    def training_memory(
        self,
        params: float,
        layers: int,
        hidden: int,
        tokens_per_device: int,
        devices: int = 1,
        checkpointing: bool = True,
        offload: bool = False,
        trainable: float | None = None,
    ) -> MemoryUse:
        """FSDP (ZeRO-3) trainer on one device: bf16 weights and grads, fp32 master + Adam moments.

        Activations: with checkpointing one bf16 hidden state per layer per token plus one layer's
        full activations (~34 x hidden bytes per token, Korthikanti et al. 2022); without, all layers'.
        Offloading moves the optimizer state (and weights between uses) to host memory. With `trainable`
        adapter parameters (LoRA) the base weights are frozen: bf16 only, no grads or optimizer state; the adapter
        has its bf16 weights and grads and fp32 master + moments.
        """
        per_layer = 34 * hidden * tokens_per_device
        if checkpointing:
            activations = layers * hidden * tokens_per_device * BF16 + per_layer
        else:
            activations = layers * per_layer
        trained = params if trainable is None else trainable
        weights = (params + (0.0 if trainable is None else trainable)) * BF16 / devices
        return MemoryUse(
            weights=0.0 if offload else weights,
            grads=trained * BF16 / devices,
            optimizer=0.0 if offload else trained * 3 * FP32 / devices,
            activations=activations,
        )

    def replicated_training_memory(self, params: float, trainable: float | None = None) -> MemoryUse:
        """dovetail's replicated trainer on one device (`replicated_trainer` specs): fp32 weights of every parameter,
        and of the trained ones an fp32 gradient beside the fp64 sum of the step's parts it is rounded from
        (`runtime.worker.reduce_parts`: what makes every policy end at the same bits) and AdamW's two fp32 moments:
        24 bytes a trained parameter, 4 a frozen one. Activations are the train nodes' (`training_memory`)."""
        trained = params if trainable is None else trainable
        weights = (params + (0.0 if trainable is None else trainable)) * FP32
        return MemoryUse(weights=weights, grads=trained * (FP32 + FP64), optimizer=trained * 2 * FP32)

    def rollout_memory(self, model: LanguageModel, kv_tokens: int, devices: int = 1) -> MemoryUse:
        """An LM rollout engine: bf16 weights and the KV cache of `kv_tokens` tokens, TP-sharded."""
        return MemoryUse(weights=model.params * BF16 / devices, kv_cache=model.kv_bytes_per_token * kv_tokens / devices)


def pass_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (predicted, measured) points; (0, 0) where the points
    have a single predicted value (no line)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread <= 1e-12 * max(mean_x * mean_x, 1e-300):
        return 0.0, 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return mean_y - slope * mean_x, slope


def backward_forwards(lora: bool) -> int:
    """A backward pass in forwards' worth of FLOPs. Full fine-tuning: 2 (the activation gradients, x^T-sized, and
    the weight gradients, each one forward's matmuls). LoRA: 1 — activation gradients still flow back through every
    frozen base matmul, but no base weight gradient is formed; the adapter's own gradients (2 x rank x (d_in + d_out)
    FLOPs per token per adapted matrix) are < 2 % of a forward at the ranks used (<= 128) and left out."""
    return 1 if lora else 2


LORA_TARGETS = ("attention", "all-linear")
"""Which linear layers carry adapters: the attention projections (q, k, v, out) or every linear layer of a block."""


def lora_params(model: LanguageModel | DiffusionModel, rank: int, targets: str) -> float:
    """Parameters of a rank-`rank` LoRA adapter: rank x (d_in + d_out) per adapted matrix. Per layer the attention
    has four hidden x hidden projections (8 x hidden x rank); "all-linear" adds the MLP, whose matrices (2 for a
    DiT's GELU MLP, 3 for an LM's SwiGLU) share an intermediate width I found from the layer's remaining parameters
    (per-layer params - 4 hidden^2 = k x hidden x I). Every expert of a mixture of experts (Wan2.2) has its adapter.
    Dual-stream MMDiT blocks are counted as one stream (their text stream is a small share of the tokens)."""
    if targets not in LORA_TARGETS:
        raise ValueError(f"LoRA targets {targets!r}: choose one of {', '.join(LORA_TARGETS)}")
    hidden, layers = model.hidden, model.layers
    per_layer = 8.0 * hidden * rank
    if targets == "all-linear":
        matrices = 3 if isinstance(model, LanguageModel) else 2
        mlp_params = max(0.0, model.params / layers - 4 * hidden * hidden)
        intermediate = mlp_params / (matrices * hidden)
        per_layer += matrices * (hidden + intermediate) * rank
    experts = getattr(model, "experts", 1)
    return per_layer * layers * experts
