"""Sharded trainers: a model whose parameters, gradients and AdamW moments are split over the devices of an FSDP
group (PyTorch's FSDP2, `torch.distributed.fsdp.fully_shard`), so that a device holds 1/N of what a replica holds.

A trainer process calls `torch.distributed.init_process_group` first (nccl on GPUs, gloo on CPUs), then `device_mesh`
(one FSDP group over every process, or HYBRID: groups of `group_size`, replicated across groups), then `shard`. After
that the model trains as a replica does (forward, backward, `clip_grad_norm_`, the optimizer's step): FSDP gathers each
block's parameters before its forward and backward and reduce-scatters its gradients after, so each process's optimizer
steps its own shards (`models.memory.memory_by_kind` counts what a process holds). What leaves a process is its own
shards (`local_state`, numpy as the runtime's object store wants), a full model assembled one parameter at a time
(`full_weights`, for publication), or a sharded checkpoint that every process writes at once and any device count reads
back (`save_checkpoint`, `load_checkpoint`). Replicated (unsharded) models go through the same state and checkpoint
functions, so a run can move between a replica and a sharded group through a checkpoint.

Mixed precision is FSDP's own, as verl and torchtitan run it: the sharded parameters, their gradients and the
optimizer state stay fp32 (the master weights); blocks gather bf16 copies to compute, and gradients are reduced in
fp32."""

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

PRECISIONS = ("fp32", "bf16")

BLOCK_LISTS = ("layers", "transformer_blocks", "single_transformer_blocks", "blocks")
"""The attribute names under which models keep their repeated transformer blocks: transformers' decoder layers
(`model.model.layers`), diffusers' MMDiT / FLUX blocks (`transformer_blocks`, `single_transformer_blocks`, which our
tiny flow model's SD3 transformer has too) and Wan's `blocks`."""


def device_mesh(device_type: str, group_size: int | None = None) -> DeviceMesh:
    """The mesh `shard` spreads a model over, from the initialised default process group: one FSDP group of every
    process (`group_size` None or the world size), or HYBRID, groups of `group_size` consecutive ranks that each hold
    a whole model's shards, replicated across the groups (gathers stay inside a group, typically a node; gradients
    are all-reduced across groups once per step)."""
    world = dist.get_world_size()
    if group_size is None or group_size == world:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    if group_size < 1 or world % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide the {world} trainer devices: give a divisor of {world}"
        )
    return init_device_mesh(device_type, (world // group_size, group_size), mesh_dim_names=("replicate", "shard"))


def group_mesh(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """The 1-D mesh of one torch.distributed group: the runtime's FSDP group, the trainer devices' group cut from the
    group of a pipeline's devices (`runtime.worker.group_of`)."""
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=("shard",))


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks, in order: the members of every module list named in `BLOCK_LISTS`, the
    outermost where lists nest. FSDP gathers and frees one block at a time, so a device holds whole parameters of
    one block (two, with prefetching) beside its shards; a model with none is sharded as one unit."""
    found: list[torch.nn.Module] = []
    for name, child in model.named_children():
        if name in BLOCK_LISTS and isinstance(child, torch.nn.ModuleList):
            found.extend(child)
        else:
            found.extend(blocks_of(child))
    return found


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """fp32: FSDP computes in the parameters' own dtype. bf16: blocks gather and compute in bf16, gradients are
    reduce-scattered in fp32 and land on the fp32 shards the optimizer steps."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {PRECISIONS}")
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    *,
    precision: str = "fp32",
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    sum_gradients: bool = False,
    cpu_offload: bool = False,
) -> torch.nn.Module:
    """`model` sharded in place over `mesh` (`device_mesh`) and returned: each block (`blocks_of`) an FSDP unit,
    then the root, which holds the rest (embeddings, the head, a flow model's patch and time embeddings).

    `reshard_after_forward` frees each block's gathered parameters after its forward and gathers them again for its
    backward (ZeRO-3: least memory); False keeps them until the backward (ZeRO-2: one gather fewer per block). The
    last block is never resharded after its forward, as its backward comes at once; FSDP keeps the root gathered for
    the same reason. `activation_checkpointing` keeps only each block's inputs through the forward and recomputes
    the rest in the backward. The root returns fp32 outputs (with bf16, cast from bf16 logits): the loss and
    log-probs are computed in fp32 whatever the precision. `sum_gradients`: the reduce-scatter adds the members'
    gradients where FSDP would average them, for losses summed over the parts of a step that the commit divides by
    the step's normaliser (the runtime's). `cpu_offload`: the shards, their gradients and the optimizer state live in
    the host's memory and each block's parameters are copied to the GPU for its forward and backward (FSDP's
    CPUOffloadPolicy; the optimizer steps on the CPU): for a GPU whose memory the shards would not fit."""
    policy = mixed_precision(precision)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    blocks = blocks_of(model)
    for index, block in enumerate(blocks):
        if activation_checkpointing:
            # The instance attribute is what `Module.__call__` runs, inside FSDP's hooks: the recompute in the
            # backward finds the block's parameters gathered, and state-dict names stay those of the model.
            block.forward = partial(checkpoint, block.forward, use_reentrant=False)
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=policy,
            offload_policy=offload,
            reshard_after_forward=reshard_after_forward and index < len(blocks) - 1,
        )
    fully_shard(model, mesh=mesh, mp_policy=replace(policy, output_dtype=torch.float32), offload_policy=offload)
    if sum_gradients:
        for unit in [*blocks, model]:
            unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]  # fully_shard made each an FSDPModule
            unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # a plain sum: gloo has no pre-scaled one
    return model


def resharded(model: torch.nn.Module) -> None:
    """Every FSDP unit of `model` back to its shards. A forward without a backward (a member's log-probs) leaves the
    root and the last block gathered (`shard` says why), their parameters whole tensors: a commit that adds the
    shards' gradients across groups or steps the optimizer reads the shards, so it reshards first (a no-op after a
    backward, which reshards every unit)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: a sharded DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


SHARDED = StateDictOptions(full_state_dict=False, cpu_offload=True)
"""Each process's own shards, copied to the CPU: what `local_state` hands to the object store."""


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return _local(tensor).detach().cpu().numpy().copy()


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This process's trainer state as numpy arrays, 1/N of a replica's: its shards of the parameters and of the
    optimizer's moments under the model's parameter names, the optimizer's step counts and hyper-parameters.
    `load_local_state` puts it back into the same process's place in a mesh of the same shape (a new process
    in a restarted group included); another shape reads a checkpoint instead (`load_checkpoint` reshards)."""
    weights = get_model_state_dict(model, options=SHARDED)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=SHARDED)
    moments = {
        name: {key: _to_numpy(value) if torch.is_tensor(value) else value for key, value in per_param.items()}
        for name, per_param in optimizer_state["state"].items()
    }
    return {
        "weights": {name: _to_numpy(value) for name, value in weights.items()},
        "optimizer": {"state": moments, "param_groups": optimizer_state["param_groups"]},
        "sharded": sorted(name for name, value in get_model_state_dict(model).items() if isinstance(value, DTensor)),
    }


def local_tensors(tensors: dict[str, torch.Tensor]) -> dict:
    """This process's part of tensors kept beside a sharded model's (a flow run's EMA of its weights, which is
    elementwise: a shard's average is the average's shard) as numpy, in `local_state`'s layout without an optimizer:
    `merged_state` joins the members' into the whole tensors by name."""
    return {
        "weights": {name: _to_numpy(tensor) for name, tensor in tensors.items()},
        "sharded": sorted(name for name, tensor in tensors.items() if isinstance(tensor, DTensor)),
    }


LOCAL_KEYS = ("weights", "optimizer", "sharded")
"""A local state's own entries; any other entry that is a local state itself (a PPO run's critic's, `local_state`;
a flow run's EMA, `local_tensors`) is merged beside them."""


def _joined_weights(shards: list[dict]) -> dict[str, np.ndarray]:
    """The whole tensors of the members' local `weights`: each sharded one's shards joined along dim 0."""
    first = shards[0]
    sharded = set(first["sharded"])
    return {
        name: np.concatenate([shard["weights"][name] for shard in shards]) if name in sharded else array
        for name, array in first["weights"].items()
    }


def merged_state(shards: list[dict]) -> dict:
    """The replicated trainer state (`models.training.trainer_state_of`'s layout: weights by name, AdamW's state by
    the parameter's index) of the local states `local_state` took from every member of a 1-D FSDP group, in rank
    order: each sharded tensor's and its moments' shards joined along dim 0, where FSDP cut them; what is not sharded
    (buffers, step counts, hyper-parameters) taken from the first member. What the driver checkpoints, evaluates and
    restarts a group with (on any number of devices: `local_of_full` cuts it again). A further entry that is a local
    state itself is merged as one (a critic's, a trainer state), or to its whole tensors by name (`local_tensors`:
    an EMA's); any other is the first member's."""
    first = shards[0]
    sharded = set(first["sharded"])

    def joined(name: str, pick) -> np.ndarray:
        return np.concatenate([pick(shard) for shard in shards]) if name in sharded else pick(first)

    weights = _joined_weights(shards)
    groups = first["optimizer"]["param_groups"]
    index = {name: i for i, name in enumerate(name for group in groups for name in group["params"])}
    state = {
        index[name]: {
            key: joined(name, lambda shard, n=name, k=key: shard["optimizer"]["state"][n][k])
            if isinstance(value, np.ndarray) and value.ndim
            else value
            for key, value in per_param.items()
        }
        for name, per_param in first["optimizer"]["state"].items()
    }
    param_groups = [group | {"params": [index[name] for name in group["params"]]} for group in groups]
    merged = {"weights": weights, "optimizer": {"state": state, "param_groups": param_groups}}
    for key, value in first.items():
        if key in LOCAL_KEYS:
            continue
        if isinstance(value, dict) and "sharded" in value:
            parts = [shard[key] for shard in shards]
            merged[key] = merged_state(parts) if "optimizer" in value else _joined_weights(parts)
        else:
            merged[key] = value
    return merged


def local_of_full(model: torch.nn.Module, optimizer: torch.optim.Optimizer, full: dict) -> dict:
    """This process's part of a replicated trainer state (`merged_state`'s layout), as `local_state` would give it,
    for `load_local_state`: each tensor cut as this process's shard of it is (no communication: every member holds
    the whole and keeps its own rows)."""
    templates = get_model_state_dict(model)

    def rows(name: str, array: np.ndarray) -> np.ndarray:
        template = templates[name]
        if not isinstance(template, DTensor):
            return array
        whole = torch.from_numpy(np.array(array, copy=True)).to(template.device)
        return _to_numpy(distribute_tensor(whole, template.device_mesh, template.placements, src_data_rank=None))

    names = [name for group in get_optimizer_state_dict(model, optimizer)["param_groups"] for name in group["params"]]
    moments = {
        names[index]: {
            key: rows(names[index], value) if isinstance(value, np.ndarray) and value.ndim else value
            for key, value in per_param.items()
        }
        for index, per_param in full["optimizer"]["state"].items()
    }
    param_groups = [
        group | {"params": [names[i] for i in group["params"]]} for group in full["optimizer"]["param_groups"]
    ]
    return {
        "weights": {name: rows(name, array) for name, array in full["weights"].items()},
        "optimizer": {"state": moments, "param_groups": param_groups},
        "sharded": sorted(name for name, value in templates.items() if isinstance(value, DTensor)),
    }


def local_of_whole(template: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This process's part of `whole`, placed as `template` (a parameter) is: a DTensor of the same mesh and
    placements holding this process's rows where the template is sharded (no communication: every member holds the
    whole), `whole` itself where it is not. What keeps a tensor of a parameter's shape beside its shard (an EMA)."""
    if not isinstance(template, DTensor):
        return whole
    return distribute_tensor(whole.to(template.device), template.device_mesh, template.placements, src_data_rank=None)


def _like(template: torch.Tensor, array: np.ndarray, name: str) -> torch.Tensor:
    """`array` (a local shard `local_state` took) as a tensor placed as `template` is: a DTensor of the same mesh
    and placements where the template is one. A shard of another shape came from another mesh or model."""
    local = torch.from_numpy(np.array(array, copy=True)).to(template.device)
    expected = _local(template).shape
    if local.shape != expected:
        raise ValueError(
            f"trainer state {name} holds a shard of shape {tuple(local.shape)} where this process's is "
            f"{tuple(expected)}: load a local state into the mesh shape and rank it came from, or a checkpoint"
        )
    if isinstance(template, DTensor):
        return DTensor.from_local(
            local, template.device_mesh, template.placements, shape=template.shape, stride=template.stride()
        )
    return local


def _moment(template: torch.Tensor, value, name: str):
    """An optimizer state entry back from `local_state`: a moment is placed as its parameter is, a step count
    (a 0-d array) is a plain tensor, a number stays one."""
    if not isinstance(value, np.ndarray):
        return value
    return _like(template, value, name) if value.ndim else torch.from_numpy(value.copy())


def load_local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Put back the trainer state `local_state` took in this process's place of the same mesh shape: the shards
    are loaded as they are, with no communication beyond FSDP's own bookkeeping."""
    templates = get_model_state_dict(model)
    unknown = sorted(state["weights"].keys() ^ templates.keys())
    if unknown:
        raise ValueError(f"trainer state tensor {unknown[0]} is not one of the model's: load a state of the same model")
    set_model_state_dict(model, {name: _like(templates[name], array, name) for name, array in state["weights"].items()})
    moments = {
        name: {key: _moment(templates[name], value, name) for key, value in per_param.items()}
        for name, per_param in state["optimizer"]["state"].items()
    }
    set_optimizer_state_dict(model, optimizer, {"state": moments, "param_groups": state["optimizer"]["param_groups"]})


@torch.no_grad()
def full_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's whole state dict (the replica's names, fp32 master weights, persistent buffers), one tensor at a
    time on the CPU, block after block: each sharded parameter is gathered when its turn comes, so a process never
    holds more than one whole parameter beyond what it keeps. Every process of the group must draw the same tensors
    in the same order (each gather is a collective); publication reads them as they come."""
    for name, value in model.state_dict().items():
        yield name, (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()


@contextmanager
def _one_process_quietly() -> Iterator[None]:
    """Without a process group DCP reads and writes the whole checkpoint in this one process (a replicated trainer's
    checkpoint), which is what we mean: its warning that it assumes so is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable or uninitialized")
        yield


def save_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path | str) -> None:
    """A sharded checkpoint (`torch.distributed.checkpoint`) of the model and its optimizer in `directory`: every
    process writes its own shards at once, with metadata that lets any device count, or a replica, read it back.
    Without an initialised process group the one process writes the whole."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    with _one_process_quietly():
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory))


def load_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path | str) -> None:
    """Load a `save_checkpoint` directory into `model` and `optimizer`, sharded or not, over however many
    processes: each reads the parts of the stored shards that overlap its own (DCP reshards)."""
    if not (Path(directory) / ".metadata").exists():
        raise FileNotFoundError(f"no sharded checkpoint in {directory} (its .metadata is missing)")
    model_state, optimizer_state = get_state_dict(model, optimizer)  # an unstepped optimizer's state is made here
    state = {"model": model_state, "optimizer": optimizer_state}
    with _one_process_quietly():
        dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
