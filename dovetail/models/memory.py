"""What a process holds, counted from its tensors: a trainer's parameters, gradients and optimizer state, a module's
weights, and the process's peak. Kept apart from `models.sharding` so that counting costs no import of
torch.distributed (seconds): every device and the reference loop count their memory at each step."""

import resource
import sys
from collections.abc import Callable

import torch


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of this process's part of a tensor: a sharded DTensor's local shard (the only tensors with
    `to_local`), a plain tensor's own."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def memory_by_kind(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this process holds now, by kind, summed over the tensors themselves (a DTensor counts its local shard):
    parameters, gradients (those not None) and optimizer state (AdamW's moments and step counts). The gathered
    copies FSDP makes for a block's forward and backward live only for that block and are not counted."""
    return {
        "parameters": sum(tensor_bytes(p) for p in model.parameters()),
        "gradients": sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None),
        "optimizer": sum(
            tensor_bytes(value)
            for state in list(optimizer.state.values())
            for value in list(state.values())
            if torch.is_tensor(value)
        )
        if optimizer is not None
        else 0,
    }


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's own parameters and buffers: what a rollout copy of a model (a flow policy's) holds."""
    return sum(tensor_bytes(t) for t in [*module.parameters(), *module.buffers()])


def peak_bytes(device: torch.device) -> int:
    """The most this process has held so far: on a GPU the memory torch allocated there, else the process's peak
    resident set (every tensor, the libraries, the Python heap), which Linux counts in KiB and macOS in bytes."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, trained parameters) of a model: what a replicated trainer of it holds (`ClusterSection.
    check_trainer_fits`). Counts a model built on the meta device (`counted_on_meta`) as well as a loaded one."""
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.parameters() if p.requires_grad)


def counted_on_meta(build: Callable[[], torch.nn.Module]) -> tuple[int, int]:
    """`parameter_counts` of the model `build` makes, built on the meta device: shapes without storage, so a
    user's 32B model is counted from its config in a moment, on any machine."""
    with torch.device("meta"):
        return parameter_counts(build())
