"""What every trainer does, whatever its model: weights in and out of what crosses Ray (numpy), trainer-state
snapshots, the flat gradient of a part and the sum of parts at a commit, the optimizer step, fp32 kept strict, a
LoRA adapter seeded by the run."""

import math
import sys

import numpy as np
import torch

from dovetail.files import one_line
from dovetail.graph.node import sample_key


def strict_fp32() -> None:
    """No TF32 in CUDA matmuls or convolutions: the fp32 engines then compute on a GPU what the CPU reference does."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def weights_of(model) -> dict[str, np.ndarray]:
    """The trained weights as numpy arrays (Ray moves numpy views ~10x faster than pickled tensors): a flow model's
    `trained_state_dict` (a LoRA run's adapter alone), a language model's whole state."""
    state = model.trained_state_dict() if hasattr(model, "trained_state_dict") else model.state_dict()
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


def tensors_of(weights: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v, copy=True)) if isinstance(v, np.ndarray) else v for k, v in weights.items()}


def trainer_state_of(model, optimizer) -> dict:
    """A snapshot of the weights and optimizer state on the CPU, as numpy arrays: checkpoints and restarts must not
    need the GPU they came from, later optimizer steps must not change it, and a runtime trainer hands one to the
    object store at every commit (pickled tensors took 3x as long as numpy views there)."""
    optimizer_state = optimizer.state_dict()
    moments = {
        index: {
            name: value.detach().cpu().numpy().copy() if torch.is_tensor(value) else value
            for name, value in per_param.items()
        }
        for index, per_param in optimizer_state["state"].items()
    }
    return {"weights": weights_of(model), "optimizer": optimizer_state | {"state": moments}}


def load_trainer_state(model, optimizer, state: dict) -> None:
    """Into `model` / `optimizer` wherever they live: both loaders copy to the parameters' device."""
    load_weights(model, state["weights"])
    moments = {index: tensors_of(per_param) for index, per_param in state["optimizer"]["state"].items()}
    optimizer.load_state_dict(state["optimizer"] | {"state": moments})


def load_weights(model, weights: dict[str, np.ndarray]) -> None:
    """Weights `weights_of` took into a model of the same kind."""
    tensors = tensors_of(weights)
    if hasattr(model, "load_trained_state_dict"):
        model.load_trained_state_dict(tensors)
    else:
        model.load_state_dict(tensors)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters that train (a LoRA run's adapter): gradients, their gather and the optimizer hold these."""
    return [p for p in model.parameters() if p.requires_grad]


def compute_device(model) -> torch.device:
    """Where `model` computes, so its inputs go there: its parameters' device, or for a sharded model (parameters
    that are DTensors, with a `device_mesh`) its mesh's: with CPU offload the shards live on the host and each block
    is copied to the GPU for its passes. Read without importing torch.distributed.tensor (0.6 s), which a process
    that never shards does not need."""
    parameter = next(model.parameters())
    mesh = getattr(parameter, "device_mesh", None)
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return parameter.device


def flat_gradient(model) -> torch.Tensor:
    return torch.cat(
        [
            p.grad.flatten() if p.grad is not None else torch.zeros(p.numel(), device=p.device)
            for p in trainable_parameters(model)
        ]
    )


def set_summed_gradient(model, parts: list[torch.Tensor], scale: float) -> None:
    """Give `model`'s trainable parameters the sum of the flat gradients `parts`, added in the order given and in
    their precision, times `scale`, then rounded once to each parameter's dtype. The commit of every runtime
    replica and the language-model reference loop both go through here, so the same parts give the same bits."""
    trained = trainable_parameters(model)
    device = trained[0].device
    dtype = parts[0].dtype if parts else torch.float32
    total = torch.zeros(sum(p.numel() for p in trained), dtype=dtype, device=device)
    for gradient in parts:
        total += gradient.to(device)
    if scale != 1.0:
        total *= scale
    offset = 0
    for p in trained:
        p.grad = total[offset : offset + p.numel()].view_as(p).to(p.dtype, copy=True)
        offset += p.numel()


def scale_gradients(model, scale: float) -> None:
    """Multiply the gradients the trainable parameters accumulated by `scale`: a sharded trainer's commit, whose
    parts' summed gradients FSDP already added into the parameters' own (each member its shard)."""
    if scale == 1.0:
        return
    for p in trainable_parameters(model):
        if p.grad is not None:
            p.grad.mul_(scale)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels, so that a wall-clock time covers the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_optimizer(model, train) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (a LoRA run's adapter alone), at the config's `train` section's lr and
    weight_decay: every kind's trainer and the reference loop build theirs here. `commit` sets each step's lr from
    the schedule, so the optimizer carries no scheduler of its own to checkpoint."""
    return torch.optim.AdamW(trainable_parameters(model), lr=train.lr, weight_decay=train.weight_decay)


def scheduled_lr(train, step: int) -> float:
    """The lr of optimizer step `step` (0 for the first) under the `train` section's schedule: transformers'
    `get_{constant,linear,cosine}_schedule_with_warmup` in closed form, so that it is a function of the step alone
    and every process computes the same bits."""
    warmup = train.warmup_steps
    if step < warmup:
        return train.lr * (float(step) / float(max(1, warmup)))
    if train.lr_schedule == "constant":
        return train.lr
    if train.lr_schedule == "linear":
        return train.lr * max(0.0, float(train.steps - step) / float(max(1, train.steps - warmup)))
    progress = float(step - warmup) / float(max(1, train.steps - warmup))
    return train.lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """How many steps `optimizer` has taken, from the count AdamW keeps per parameter: it travels with the
    optimizer's state into every checkpoint and trainer snapshot, so a resumed or restarted trainer goes on with it.
    The largest count, since a parameter that never had a gradient has none."""
    return max((int(state["step"]) for state in optimizer.state.values() if "step" in state), default=0)


def commit(model, optimizer: torch.optim.Optimizer, train, updates_per_step: int = 1) -> float:
    """One optimizer step for the whole logical batch at the lr the `train` section's schedule gives this step,
    its gradient clipped to `train.max_grad_norm`; returns the pre-clip gradient norm. With `updates_per_step`
    updates on each RL step's batch (an LM run's algo.num_iterations) the schedule counts RL steps, as verl steps
    its lr scheduler once per update_policy: every update of a step takes its step's lr."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train.max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # a sharded trainer's (a DTensor): the norm over every member's shards
        grad_norm = grad_norm.full_tensor()
    lr = scheduled_lr(train, optimizer_steps(optimizer) // updates_per_step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


def stepped_lr(optimizer: torch.optim.Optimizer) -> float:
    """The lr of the optimizer's latest step (`commit` sets every parameter group's alike): TRL's `learning_rate`."""
    return float(optimizer.param_groups[0]["lr"])


def with_lora(model, lora: dict, seed: int, task_type: str | None = None):
    """The model with a peft LoRA adapter (rank, alpha, target modules), the only part that trains: a
    `peft.PeftModel`. Its random initial A matrices are drawn from `seed`, so every process of a run starts from
    the same adapter. peft is imported here, by the first LoRA run of a process: it takes seconds to import."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora["rank"],
        lora_alpha=lora["alpha"] if lora["alpha"] is not None else lora["rank"],
        target_modules=lora["target_modules"],
        lora_dropout=0.0,
        task_type=task_type,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sample_key(seed, "lora"))
        try:
            return get_peft_model(model, config)
        except ValueError as error:  # no module matches the targets
            raise ValueError(f"model.lora.target_modules={lora['target_modules']}: {one_line(error)}") from None


def has_lora(model) -> bool:
    """Whether `model` is a peft model `with_lora` made. Until peft is imported no model can be one, and a run
    without LoRA never imports it."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def lora_state_dict(model) -> dict[str, torch.Tensor]:
    """The LoRA adapter's tensors of a `with_lora` model, under peft's names."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def load_lora_state_dict(model, state: dict[str, torch.Tensor]) -> None:
    """Load adapter tensors `lora_state_dict` gave into a `with_lora` model, refusing tensors that do not fit."""
    from peft import set_peft_model_state_dict

    expected = lora_state_dict(model)
    misfit = sorted(expected.keys() ^ state.keys()) or sorted(
        k for k in expected if state[k].shape != expected[k].shape
    )
    if misfit:
        raise ValueError(f"the LoRA adapter's tensors do not fit the model's adapter (tensor {misfit[0]})")
    set_peft_model_state_dict(model, state)
