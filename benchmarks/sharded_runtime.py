"""Sharded trainers on the Ray runtime at a published model's width: a Qwen2 of Qwen2-0.5B's layer shape (hidden 896,
MLP 4864, 14 query / 2 key-value heads, tied embeddings; random init, `--layers` of its 24, a one-token-per-character
vocabulary) trained by GRPO (`verl-sync`) on 2 CPU cores three ways: replicated fp32, FSDP fp32, FSDP bf16 with
activation checkpointing. Per device: the trainer's bytes by kind (counted from the tensors, the step's metrics), the
rollout engine's, the process's peak; beside them what dovetail's memory check counts for the same trainer
(`ClusterSection.check_trainer_fits`), and the steady step time with the planner's prediction of it (the run's
replay). Then `cluster.device_memory_gb` set between the sharded and the replicated need: the replicated run is
refused in one line naming `train.sharding: fsdp`, and the sharded run trains within it.

    python benchmarks/sharded_runtime.py --out runs/sharded            # ~6 min on 2 CPU cores
    python benchmarks/sharded_runtime.py --kind flow --out runs/sharded-flow

`--kind flow`: FlowGRPO (`colocated`) on a diffusers StableDiffusion3Pipeline whose transformer has the SD3-medium
blocks' width (24 heads x 64 = 1536, `--layers` joint blocks; random init) behind the test suite's tiny text encoders
and VAE (tests/tiny_pipelines.py: 8x8 latents, so the transformer's blocks are nearly all of the parameters), with
the built-in `brightness` reward.

Prints a markdown table (and writes OUT/sharded_runtime.json).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from transformers import Qwen2Config, Qwen2ForCausalLM

from dovetail.config.common import (
    GB,
    REPLICA_TRAINED_BYTES,
    REPLICA_WEIGHT_BYTES,
    ROLLOUT_WEIGHT_BYTES,
    SHARD_TRAINED_BYTES,
)
from dovetail.config.load import load_config
from dovetail.cost.model import CostModel
from dovetail.graph.lm import engines
from dovetail.graph.node import Role
from dovetail.models.tokenizer import CharTokenizer
from dovetail.runtime.replay import replay_run
from dovetail.sched import policy_class

ALPHABET = "0123456789+="
MODES = {
    "replicated fp32": [],
    "fsdp fp32": ["train.sharding=fsdp"],
    "fsdp bf16 + checkpointing": ["train.sharding=fsdp", "train.precision=bf16", "train.activation_checkpointing=true"],
}


def model_dir(directory: Path, layers: int) -> Path:
    """Qwen2-0.5B's layer shape at `layers` layers, random init, with a character tokenizer: a user's model.path."""
    chars = CharTokenizer(ALPHABET)
    config = Qwen2Config(
        vocab_size=chars.vocab_size,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=chars.pad_id,
        bos_token_id=chars.bos_id,
        eos_token_id=chars.eos_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(directory)
    chars.to_transformers().save_pretrained(directory)
    return directory


def sd3_dir(directory: Path, layers: int) -> Path:
    """The test suite's tiny StableDiffusion3Pipeline (tests/tiny_pipelines.py) with an MMDiT of SD3-medium's block
    width (24 heads x 64, caption projection 1536) and `layers` joint blocks, and its prompts file."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from tiny_pipelines import PROMPTS, tiny_sd3_pipeline

    pipeline = tiny_sd3_pipeline(
        directory, num_layers=layers, attention_head_dim=64, num_attention_heads=24, caption_projection_dim=1536
    )
    (directory / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return pipeline


def dataset(directory: Path) -> Path:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(30) for b in range(30)]
    path = directory / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train(out: Path, overrides: list[str], steps: int) -> subprocess.CompletedProcess:
    """`dovetail train` as a user runs it, in a process of its own (each mode's workers start afresh)."""
    command = [sys.executable, "-m", "dovetail.cli", "train", "--out", str(out), "--overwrite", "--steps", str(steps)]
    return subprocess.run([*command, *overrides], capture_output=True, text=True)


def planned_trainer_bytes(out: Path) -> float | None:
    """The planner's resident trainer memory on one device for the run's config and shape (`graph.lm.engines`); None
    for a flow run (its planner prices FSDP's layout for every policy)."""
    config = load_config(out / "config.yaml", [])
    if config.kind != "lm":
        return None
    spec = config.scenario(1).pipelines[0]
    cost = CostModel(config.cluster.device)
    shape = policy_class(config.policy).shape(spec, config.cluster.devices, None, cost)
    return engines(spec, cost, shape).resident_gb[Role.TRAINER] * GB


def row(name: str, out: Path, params: int, devices: int) -> dict:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    memory = lines[-1]["memory_bytes_per_device"]
    trainer = max(m["parameters"] + m["gradients"] + m["optimizer"] for m in memory)
    if name == "replicated fp32":
        counted = (REPLICA_WEIGHT_BYTES + REPLICA_TRAINED_BYTES) * params
    else:
        counted = (REPLICA_WEIGHT_BYTES + SHARD_TRAINED_BYTES) * params / devices
    replay = replay_run(out)
    return {
        "mode": name,
        "trainer_bytes": trainer,
        "counted_trainer_bytes": counted,
        "planned_trainer_bytes": planned_trainer_bytes(out),
        "rollout_bytes": max(m["rollout"] for m in memory),
        "peak_bytes": lines[-1]["memory_peak_bytes"],
        "step_s": replay["measured_steady_step_s"],
        "predicted_step_s": replay["predicted_steady_step_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/sharded"))
    parser.add_argument("--kind", choices=("lm", "flow"), default="lm")
    parser.add_argument("--layers", type=int, default=None, help="default: 6 (lm), 2 (flow)")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.kind == "flow":
        layers = args.layers or 2
        pipeline = sd3_dir(args.out, layers)
        from diffusers import SD3Transformer2DModel

        params = sum(p.numel() for p in SD3Transformer2DModel.from_pretrained(pipeline / "transformer").parameters())
        title = f"SD3 transformer of SD3-medium's block width x {layers} joint blocks"
        base = [
            "kind=flow",
            "policy=colocated",
            f"model.path={pipeline}",
            "model.max_sequence_length=4",
            f"prompts.path={args.out / 'prompts.txt'}",
            "prompts.eval_fraction=0.3",
            "prompts.eval_prompts=2",
            "reward={brightness: 1.0}",
            "algo.prompts_per_step=2",
            "algo.group_size=4",
            "sampling.num_steps=4",
            "eval.per_prompt=1",
            "eval.every=1000",
            "checkpoint.every=1000",
            "cluster.devices=2",
            "runtime.profile_samples=4",
        ]
        run_modes(args, base, params, title)
        return
    layers = args.layers or 6
    model = model_dir(args.out / "qwen2-width", layers)
    params = sum(p.numel() for p in Qwen2ForCausalLM.from_pretrained(model).parameters())
    title = f"Qwen2-0.5B layer shape x {layers} layers"
    base = [
        "kind=lm",
        "policy=verl-sync",
        f"model.path={model}",
        f"prompts.path={dataset(args.out)}",
        "reward={answer_match: 1.0}",
        "sampling.max_new_tokens=4",
        "algo.prompts_per_step=4",
        "algo.group_size=4",
        "eval.every=1000",
        "eval.prompts=4",
        "checkpoint.every=1000",
        "cluster.devices=2",
    ]
    run_modes(args, base, params, title)


def run_modes(args, base: list[str], params: int, title: str) -> None:
    rows = []
    for name, overrides in MODES.items():
        start = time.perf_counter()
        done = train(args.out / name.replace(" ", "-"), [*base, *overrides], args.steps)
        if done.returncode != 0:
            raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
        rows.append(row(name, args.out / name.replace(" ", "-"), params, 2) | {"wall_s": time.perf_counter() - start})
    sharded_need = (ROLLOUT_WEIGHT_BYTES * params + max(4 * params, 16 * params / 2)) / GB
    budget = f"cluster.device_memory_gb={sharded_need * 1.01:.4g}"
    refused = train(args.out / "budget-replicated", [*base, budget], args.steps)
    within = train(args.out / "budget-sharded", [*base, budget, "train.sharding=fsdp"], args.steps)
    result = {
        "params": params,
        "model": title,
        "rows": rows,
        "budget": budget,
        "replicated_under_budget": {"exit": refused.returncode, "said": refused.stderr.strip().splitlines()[-1:]},
        "sharded_under_budget": {"exit": within.returncode},
    }
    (args.out / "sharded_runtime.json").write_text(json.dumps(result, indent=2))
    policy = next(o for o in base if o.startswith("policy=")).removeprefix("policy=")
    print(f"{title}: {params / 1e6:.1f} M parameters, 2 CPU cores, {policy}\n")
    print(
        "| mode | trainer bytes / device | memory check | planner | rollout | peak (RSS) | step s | planner's step s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['trainer_bytes'] / GB:.3f} GB | {r['counted_trainer_bytes'] / GB:.3f} GB "
            f"| {planned(r['planned_trainer_bytes'])} "
            f"| {r['rollout_bytes'] / GB:.3f} GB | {r['peak_bytes'] / GB:.2f} GB | {r['step_s']:.2f} "
            f"| {r['predicted_step_s']:.2f} |"
        )
    print(f"\n{budget}: replicated exit {refused.returncode}: {' '.join(result['replicated_under_budget']['said'])}")
    print(f"{budget} with train.sharding=fsdp: exit {within.returncode}")


def planned(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GB:.3f} GB"


if __name__ == "__main__":
    main()
