"""Sharded trainers on a GPU at a real model width: bytes held by kind, peak bytes and step time of a replicated fp32
trainer, an FSDP2 trainer in bf16 and the same with activation checkpointing (`dovetail.models.sharding`).

    python3 benchmarks/gpu_check/sharded.py                          # on a lent GPU (benchmarks/gpu_check/run.sh)
    python3 benchmarks/gpu_check/sharded.py --device cpu --tiny      # smoke check: gloo, tiny widths, any machine

One process, world size 1 (nccl on CUDA, gloo on the CPU): the FSDP2 path end to end (mesh, `fully_shard` per block,
bf16 mixed precision, the reduce in fp32, AdamW on fp32 master shards, the full weights gathered one tensor at a time
for publication); with one device a shard is the whole model, so what bf16 and checkpointing save is activations and
time. Random init from published configs' widths, nothing downloaded:

* lm: Qwen2-0.5B's (hidden 896, 24 layers, 14 heads / 2 kv heads, MLP 4864, vocabulary 151936, tied embeddings),
  next-token loss on random tokens, batch x sequence of `--lm-batch`;
* flow: the SD3-medium transformer's (24 joint blocks of 24 heads x 64, text 4096 / pooled 2048, 16 latent channels,
  patch 2), flow-matching loss on 64x64 latents (a 512 px image) and 154 text tokens.

Each mode builds its model on the device, takes `--warmup` steps (AdamW's moments are made there), then times
`--steps` steps (forward, backward, grad-norm clip, AdamW step). Held bytes are counted from the tensors after the last
timed backward (`sharding.memory_by_kind`); peak is `torch.cuda.max_memory_allocated` over the timed steps, and
"rest" is peak minus held: activations, the gathered bf16 copies of a block, kernels' workspace. The replica trains in
strict fp32 (no TF32), as dovetail's trainers do. The table goes to stdout; `--json` writes the rows.
"""

import argparse
import gc
import json
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import SD3Transformer2DModel
from transformers import AutoModelForCausalLM, Qwen2Config

from dovetail.models import sharding
from dovetail.models.training import strict_fp32, synchronize

MODES = (
    ("replica", "fp32", False, False, False),
    ("fsdp-bf16", "bf16", True, False, False),
    ("fsdp-bf16-ac", "bf16", True, True, False),
    ("fsdp-bf16-ac-offload", "bf16", True, True, True),
)
"""(name, precision, sharded, activation checkpointing, CPU offload: on a GPU only)."""

QWEN2_0_5B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
SD3_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    pos_embed_max_size=192,
)
TINY_LM = QWEN2_0_5B | dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
TINY_LM["vocab_size"] = 512
TINY_FLOW = SD3_MEDIUM | dict(
    sample_size=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    caption_projection_dim=32,
    pooled_projection_dim=32,
    pos_embed_max_size=16,
)


def build(kind: str, tiny: bool, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    with device:
        if kind == "lm":
            config = Qwen2Config(**(TINY_LM if tiny else QWEN2_0_5B), dtype=torch.float32)
            return AutoModelForCausalLM.from_config(config).float()
        return SD3Transformer2DModel(**(TINY_FLOW if tiny else SD3_MEDIUM)).float()


def batch_of(kind: str, model: torch.nn.Module, args, device: torch.device) -> dict:
    """One step's inputs and target (the same every step: the figures are memory and time)."""
    generator = torch.Generator(device).manual_seed(1)
    if kind == "lm":
        batch, length = args.lm_batch
        ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=generator, device=device)
        return {"input_ids": ids, "labels": ids, "use_cache": False}
    config, batch = model.config, args.flow_batch
    side, text_tokens = (8, 8) if args.tiny else (64, 154)  # a 512 px image's latents; CLIP's 77 and T5's 77 tokens
    latents = torch.randn(batch, config.in_channels, side, side, generator=generator, device=device)
    text = torch.randn(batch, text_tokens, config.joint_attention_dim, generator=generator, device=device)
    pooled = torch.randn(batch, config.pooled_projection_dim, generator=generator, device=device)
    timestep = torch.rand(batch, generator=generator, device=device) * 1000
    return {
        "hidden_states": latents,
        "encoder_hidden_states": text,
        "pooled_projections": pooled,
        "timestep": timestep,
        "target": torch.randn(latents.shape, generator=generator, device=device),
    }


def loss_of(kind: str, model: torch.nn.Module, batch: dict) -> torch.Tensor:
    if kind == "lm":
        return model(**batch).loss
    inputs = {k: v for k, v in batch.items() if k != "target"}
    return torch.nn.functional.mse_loss(model(**inputs).sample, batch["target"])


def step(kind: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict, measure: bool):
    """One training step; the bytes held by kind after its backward, where `measure`."""
    loss_of(kind, model, batch).backward()
    held = sharding.memory_by_kind(model, optimizer) if measure else None
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return held


def run_mode(kind: str, mode: tuple, args, device: torch.device, mesh) -> dict:
    name, precision, sharded, checkpointing, offload = mode
    model = build(kind, args.tiny, device)
    if sharded:
        sharding.shard(model, mesh, precision=precision, activation_checkpointing=checkpointing, cpu_offload=offload)
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = batch_of(kind, model, args, device)

    for _ in range(args.warmup):
        step(kind, model, optimizer, batch, False)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, held = [], None
    for i in range(args.steps):
        start = time.perf_counter()
        held = step(kind, model, optimizer, batch, i == args.steps - 1)
        synchronize(device)
        times.append(time.perf_counter() - start)
    assert held is not None
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    # fp32 master weights and optimizer state whatever the compute precision.
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {v.dtype for s in optimizer.state.values() for v in s.values() if v.dim()} == {torch.float32}

    gather_seconds = None
    if sharded:
        start = time.perf_counter()
        gathered = sum(t.numel() for _, t in sharding.full_weights(model))
        gather_seconds = time.perf_counter() - start
        assert gathered >= parameters  # every parameter came back whole (a tied one twice)
    return {
        "kind": kind,
        "mode": name,
        "parameters": parameters,
        **{f"{k}_bytes": v for k, v in held.items()},
        "peak_bytes": peak,
        "rest_bytes": peak - sum(held.values()) if peak is not None else None,
        "step_s": statistics.median(times),
        "gather_s": gather_seconds,
    }


def size(value: int | None) -> str:
    """Bytes in GB at real widths, in MB at the smoke check's."""
    if value is None:
        return "-"
    return f"{value / 1e9:.2f} GB" if abs(value) >= 1e8 else f"{value / 1e6:.2f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny widths: a smoke check of the path, any machine")
    parser.add_argument("--kinds", nargs="+", choices=("lm", "flow"), default=["lm", "flow"])
    parser.add_argument("--lm-batch", type=int, nargs=2, default=None, metavar=("ROWS", "TOKENS"))
    parser.add_argument("--flow-batch", type=int, default=None, help="images per step")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args()
    args.lm_batch = args.lm_batch or ([2, 16] if args.tiny else [4, 1024])
    args.flow_batch = args.flow_batch or 2
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; give --device cpu --tiny for the smoke check")

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        strict_fp32()
    else:
        torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        mesh = sharding.device_mesh(device.type)
        rows = []
        for kind in args.kinds:
            for mode in MODES if device.type == "cuda" else [m for m in MODES if not m[4]]:
                rows.append(run_mode(kind, mode, args, device, mesh))
                gc.collect()  # the mode's model and optimizer, before the next is built
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nsharded trainers on {name} ({backend}, world size 1), {args.steps} timed steps after {args.warmup}")
    print("| kind | mode | params | parameters | gradients | optimizer | peak | rest | step s | gather s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        gather = "-" if row["gather_s"] is None else f"{row['gather_s']:.2f}"
        print(
            f"| {row['kind']} | {row['mode']} | {row['parameters'] / 1e6:.1f} M | {size(row['parameters_bytes'])} | "
            f"{size(row['gradients_bytes'])} | {size(row['optimizer_bytes'])} | {size(row['peak_bytes'])} | "
            f"{size(row['rest_bytes'])} | {row['step_s']:.3f} | {gather} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"device": name, "backend": backend, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
