"""Two small pipelines, a language model (sort) and a flow model (digits), and how their final parameters compare
with a reference's: what the multiplexing and cluster tests run, in one place."""

import torch
from safetensors.torch import load_file

STEPS = 3
LM = {
    "kind": "lm",
    "task": "sort",
    "algo": {"prompts_per_step": 4, "group_size": 4},
    "eval": {"prompts": 8, "every": 100},
    "checkpoint": {"every": 100},
    "runtime": {"profile_samples": 4},
    "train": {"lr": 1e-3},
}
FLOW = {
    "kind": "flow",
    "algo": {"prompts_per_step": 4, "group_size": 4},
    "eval": {"per_prompt": 2, "every": 100},
    "checkpoint": {"every": 100},
    "runtime": {"profile_samples": 8},
}


def final_weights(run_dir) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"))


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def same_parameters(name: str, a: dict, b: dict) -> bool:
    """The language-model pipeline to the bit (its trainer's unit is a group whose gradients add up in fp64: no
    split changes them, tests/test_lm_exactness.py); the flow pipeline within 1e-5 of its reference, 3 steps of
    AdamW at lr 1e-4 moving each weight by up to 3e-4."""
    if name == "sort":
        return all(torch.equal(a[k], b[k]) for k in a)
    return max_difference(a, b) <= 1e-5
