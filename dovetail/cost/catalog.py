"""Device and model catalogues: the public figures the cost model starts from.

Devices: dense (no sparsity) bf16 peak with fp32 accumulation (what training and inference kernels use), HBM
bandwidth, memory, and the three links a device talks over, each with its bandwidth per direction and the latency
of one hop of a collective: the intra-node link to a peer of the same node (NVLink through NVSwitch, or PCIe where a
device has no NVLink), the network to a peer in another node (the NIC per device of the vendors' reference nodes),
and the host link (PCIe to CPU memory: offload, engine sleep / wake, weight publication). Hop latencies are the
small-message regime of nccl-tests (NVIDIA/nccl-tests README, "Performance" section: an all-reduce of a few KB over
8 NVLink GPUs takes ~10 us, i.e. ~0.7 us per ring step; across InfiniBand nodes each step adds a NIC round trip of
a few us plus NCCL's proxy thread, ~8 us; through a PCIe root complex ~3 us). Models: shapes from each model's
public `config.json` / model card. Plain dataclasses; the cost model turns them into seconds and bytes.
"""

from dataclasses import dataclass

GB = 1e9
TB = 1e12
US = 1e-6


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense bf16 FLOP/s (fp32 accumulate)
    memory_bandwidth: float  # bytes/s, HBM (or DRAM share for a CPU core)
    memory_bytes: float
    interconnect_bandwidth: float  # bytes/s per direction to a peer in the same node
    network_bandwidth: float  # bytes/s per direction to a peer in another node (the device's own NIC)
    node_size: int = 8  # devices sharing the intra-node interconnect
    platform: str = "cuda"  # what the Ray runtime drives it with: cuda, cpu, or npu (planning only)
    interconnect_latency_s: float = 0.7 * US  # one ring step of a small collective inside a node
    network_latency_s: float = 8 * US  # one ring step across nodes
    host_bandwidth: float = 64 * GB  # bytes/s per direction to host memory: PCIe Gen5 x16


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        # H100 SXM5 data sheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, 80 GB, NVLink4 900 GB/s bidirectional,
        # PCIe Gen5 x16; HGX H100 reference node: one ConnectX-7 NDR 400 Gb/s (50 GB/s) per GPU.
        Device("H100", 989e12, 3.35 * TB, 80 * GB, 450 * GB, 50 * GB),
        # H800 SXM: H100 silicon with NVLink cut to 400 GB/s bidirectional (200 per direction; DeepSeek-V3
        # technical report, section 3.2: 160 GB/s achievable NVLink, 50 GB/s InfiniBand per GPU).
        Device("H800", 989e12, 3.35 * TB, 80 * GB, 200 * GB, 50 * GB),
        # H200 SXM data sheet: H100 compute and links, 141 GB HBM3e at 4.8 TB/s. Never below an H100 in any figure.
        Device("H200", 989e12, 4.8 * TB, 141 * GB, 450 * GB, 50 * GB),
        # A100 SXM 80 GB data sheet: 312 TFLOP/s bf16 dense, 2.039 TB/s HBM2e, NVLink3 600 GB/s bidirectional,
        # PCIe Gen4 x16 (32 GB/s); DGX A100: one HDR 200 Gb/s (25 GB/s) NIC per GPU.
        Device("A100-80G", 312e12, 2.039 * TB, 80 * GB, 300 * GB, 25 * GB, host_bandwidth=32 * GB),
        # A100 SXM 40 GB: the same silicon with 1.555 TB/s HBM2 (data sheet); the device of a published decode sweep.
        Device("A100-40G", 312e12, 1.555 * TB, 40 * GB, 300 * GB, 25 * GB, host_bandwidth=32 * GB),
        # L40S (Ada, PCIe card, no NVLink): 183 TFLOP/s bf16 dense with fp32 accumulation (the data sheet's 362 is
        # with sparsity / fp16 accumulation; GEMM target in the "L40S x12 benchmarks" guide of ai-hpc.github.io),
        # 864 GB/s GDDR6, 48 GB. Peers and host over PCIe Gen4 x16 (32 GB/s nominal, ~25 measured P2P through a
        # PCIe switch, same guide), hops through the PCIe root complex; 100 GbE per device assumed.
        Device(
            "L40S",
            183e12,
            0.864 * TB,
            48 * GB,
            25 * GB,
            12.5 * GB,
            interconnect_latency_s=3 * US,
            network_latency_s=10 * US,
            host_bandwidth=32 * GB,
        ),
        # Ascend 910B (Atlas 800T A2): ~320 TFLOP/s fp16/bf16, 64 GB HBM2e at 1.6 TB/s, HCCS 392 GB/s,
        # 200 GbE RoCE per NPU, PCIe Gen5 x16 to the host.
        Device("Ascend-910B", 320e12, 1.6 * TB, 64 * GB, 196 * GB, 25 * GB, platform="npu", network_latency_s=10 * US),
        # One x86 core with AVX-512 (2 FMA units x 16 fp32 lanes x ~3 GHz), a DRAM-bandwidth share and
        # the memory one core is given when a machine's cores serve as devices. Cores of one machine exchange
        # tensors through its memory (gloo on loopback, Ray's object store) whatever "node" they count as: the
        # network figure is set so that at the cross-node collective efficiency (0.8) a ring between cores moves
        # ~1 GB/s, what the catalogue assumed for them before links had their own efficiencies.
        Device(
            "cpu-core",
            0.1e12,
            10 * GB,
            8 * GB,
            5 * GB,
            1.25 * GB,
            node_size=1,
            platform="cpu",
            interconnect_latency_s=1 * US,
            network_latency_s=1 * US,
            host_bandwidth=10 * GB,
        ),
    )
}


@dataclass(frozen=True)
class LanguageModel:
    """A decoder-only transformer with grouped-query attention."""

    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def kv_bytes_per_token(self) -> float:
        """bf16 K and V for one token across all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim

    def shape(self) -> dict:
        """Everything but the name: what a scenario's `architecture` carries of a model outside the catalogue."""
        return {
            "params": self.params,
            "layers": self.layers,
            "hidden": self.hidden,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab": self.vocab,
        }


def language_model_of_config(name: str, config: dict) -> LanguageModel:
    """A decoder-only model's shape from its transformers config.json (Llama, Qwen, Mistral and the like name their
    fields alike; GPT-2's n_layer / n_embd / n_head too): parameters counted from the matrices, embeddings (and an
    untied output head), q / k / v / o projections, a gated MLP where `intermediate_size` is given (else GPT-2's
    4 x hidden two-matrix MLP), and the norms. A field it lacks is a ValueError naming it."""
    aliases = {
        "layers": ("num_hidden_layers", "n_layer"),
        "hidden": ("hidden_size", "n_embd"),
        "heads": ("num_attention_heads", "n_head"),
        "vocab": ("vocab_size",),
    }
    values = {}
    for field, names in aliases.items():
        found = next((config[n] for n in names if isinstance(config.get(n), int) and config[n] > 0), None)
        if found is None:
            raise ValueError(f"config.json of {name} gives no {' or '.join(names)}: the planner cannot price it")
        values[field] = found
    layers, hidden, heads, vocab = values["layers"], values["hidden"], values["heads"], values["vocab"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    intermediate = config.get("intermediate_size")
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * intermediate if intermediate else 8 * hidden * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", True) else 2)
    params = embeddings + layers * (attention + mlp + 2 * hidden) + hidden
    return LanguageModel(name, float(params), layers, hidden, heads, kv_heads, head_dim, vocab)


@dataclass(frozen=True)
class DiffusionModel:
    """A diffusion transformer (DiT / MMDiT) over VAE latents, plus its text encoder and VAE.

    Latent tokens per sample = latent frames x (H / (vae_spatial * patch)) x (W / (vae_spatial * patch)),
    with latent frames = (frames - 1) / vae_temporal + 1 for video.
    `text_tokens` join the self-attention (MMDiT) unless `cross_attention` is set (Wan: they are
    attended to from every layer instead).
    """

    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    vae_spatial: int
    patch: int
    text_tokens: int
    text_encoder_params: float
    vae_decoder_flops_per_pixel: float  # decoder FLOPs per output pixel (per frame for video)
    vae_temporal: int = 1
    cross_attention: bool = False
    experts: int = 1  # Wan2.2-A14B: a high-noise and a low-noise expert, one active per step

    @property
    def total_params(self) -> float:
        """Parameters trained, stored and published (every expert); `params` is what one step runs."""
        return self.params * self.experts

    def latent_tokens(self, height: int, width: int, frames: int = 1) -> int:
        stride = self.vae_spatial * self.patch
        if height % stride or width % stride:
            raise ValueError(
                f"{self.name}: resolution {height}x{width} is not a multiple of {stride} "
                f"(VAE x{self.vae_spatial}, patch {self.patch}); pick a height/width divisible by {stride}"
            )
        if (frames - 1) % self.vae_temporal:
            raise ValueError(
                f"{self.name}: frames={frames} must be 1 + a multiple of {self.vae_temporal} (VAE temporal stride)"
            )
        latent_frames = (frames - 1) // self.vae_temporal + 1
        return latent_frames * (height // stride) * (width // stride)


# Shapes from the Hugging Face config.json of each checkpoint (Qwen/Qwen3-*, meta-llama/Llama-3.1-8B).
LANGUAGE_MODELS: dict[str, LanguageModel] = {
    m.name: m
    for m in (
        LanguageModel("Qwen3-0.6B", 0.60e9, 28, 1024, 16, 8, 128, 151936),
        LanguageModel("Qwen3-4B", 4.02e9, 36, 2560, 32, 8, 128, 151936),
        LanguageModel("Qwen3-8B", 8.19e9, 36, 4096, 32, 8, 128, 151936),
        LanguageModel("Qwen3-14B", 14.8e9, 40, 5120, 40, 8, 128, 151936),
        LanguageModel("Qwen3-32B", 32.8e9, 64, 5120, 64, 8, 128, 151936),
        LanguageModel("Llama-3.1-8B", 8.03e9, 32, 4096, 32, 8, 128, 128256),
        # dovetail's own tiny Llama on a synthetic task (dovetail/assets/<task>-lm), character tokens: 5 layers,
        # 128 wide, 4 heads, 1,318,912 parameters with the 53-token vocabulary (the agentic tasks' 98 tokens add
        # 5,760). What the CPU quick start of LM GRPO runs.
        LanguageModel("tiny-lm", 1_318_912, 5, 128, 4, 4, 32, 53),
    )
}

# VAE decoder FLOPs per output pixel are estimates from the decoders' conv shapes (not measured):
# ~2.4 MFLOP/pixel for the 16-channel 2D KL VAEs (SD3 / FLUX / Qwen-Image), ~3.2 MFLOP per
# frame-pixel for the causal 3D video VAEs. Text encoders: T5-XXL encoder 4.7B (FLUX, SD3.5),
# umT5-XXL encoder 5.7B (Wan), LLaVA-Llama-3-8B (HunyuanVideo), Qwen2.5-VL-7B (Qwen-Image, 8.3B
# with its vision tower).
DIFFUSION_MODELS: dict[str, DiffusionModel] = {
    m.name: m
    for m in (
        # black-forest-labs/FLUX.1-dev: 19 double + 38 single blocks, 3072 wide, 24 heads, 2x2 patches.
        DiffusionModel("FLUX.1-12B", 11.9e9, 57, 3072, 24, 8, 2, 512, 4.7e9, 2.4e6),
        # Wan-AI/Wan2.1-T2V-14B: 40 layers, 5120 wide, 40 heads, patch (1,2,2), Wan-VAE 4x8x8, umT5.
        DiffusionModel(
            "Wan2.1-14B", 14.0e9, 40, 5120, 40, 8, 2, 512, 5.7e9, 3.2e6, vae_temporal=4, cross_attention=True
        ),
        # Wan-AI/Wan2.2-T2V-A14B: two 14B experts (high / low noise), each shaped like Wan2.1-14B; one
        # expert is active per denoising step, so per-step cost is that of a 14B model.
        DiffusionModel(
            "Wan2.2-A14B",
            14.0e9,
            40,
            5120,
            40,
            8,
            2,
            512,
            5.7e9,
            3.2e6,
            vae_temporal=4,
            cross_attention=True,
            experts=2,
        ),
        # tencent/HunyuanVideo: 20 dual + 40 single blocks, 3072 wide, 24 heads, causal 3D VAE 4x8x8.
        DiffusionModel("HunyuanVideo-13B", 12.8e9, 60, 3072, 24, 8, 2, 256, 8.0e9, 3.2e6, vae_temporal=4),
        # Qwen/Qwen-Image: 60 MMDiT blocks, 3072 wide, 24 heads, 2x2 patches over a 16-channel 8x VAE.
        DiffusionModel("QwenImage-20B", 20.4e9, 60, 3072, 24, 8, 2, 256, 8.3e9, 2.4e6),
        # stabilityai/stable-diffusion-3.5-medium: 24 MMDiT-X blocks, 1536 wide, 24 heads.
        DiffusionModel("SD3.5-M", 2.5e9, 24, 1536, 24, 8, 2, 333, 4.7e9, 2.4e6),
        # dovetail's own tiny MMDiT on 8x8 digits (dovetail/assets/digits-t2i): pixels are the latents
        # (no VAE), 2x2 patches, 4 learned prompt tokens, no text encoder. What the CPU quick start runs.
        DiffusionModel("digits-t2i", 1.68e6, 3, 128, 4, 1, 2, 4, 0.0, 0.0),
    )
}


def _lookup(table: dict, name: str, what: str):
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(sorted(table))}") from None


def dominates(faster: Device, slower: Device) -> bool:
    """`faster` is at least as good as `slower` in every figure (compute, bandwidths, memory, node size, latencies) on
    the same platform: it must never be predicted slower (`tests/test_search_properties.py`)."""
    return (
        faster.platform == slower.platform
        and faster.peak_flops >= slower.peak_flops
        and faster.memory_bandwidth >= slower.memory_bandwidth
        and faster.memory_bytes >= slower.memory_bytes
        and faster.interconnect_bandwidth >= slower.interconnect_bandwidth
        and faster.network_bandwidth >= slower.network_bandwidth
        and faster.host_bandwidth >= slower.host_bandwidth
        and faster.node_size >= slower.node_size
        and faster.interconnect_latency_s <= slower.interconnect_latency_s
        and faster.network_latency_s <= slower.network_latency_s
    )


def device(name: str) -> Device:
    return _lookup(DEVICES, name, "device")


def language_model(name: str) -> LanguageModel:
    return _lookup(LANGUAGE_MODELS, name, "language model")


def diffusion_model(name: str) -> DiffusionModel:
    return _lookup(DIFFUSION_MODELS, name, "diffusion model")
