"""DeviceWorker: one Ray actor per device (a GPU, or on a CPU-only machine one pinned core).

It holds the engines of one flow pipeline: a rollout engine (an inference copy of the policy at some
published weights version), a trainer engine (parameters and optimizer state) and the reward engine.
It carries out work and never decides: which node runs where is the policy's, through the executor.

The engines live on the worker's device (the GPU Ray assigned it, else the CPU); what crosses Ray
(trajectories, scores, weights, trainer state) is CPU numpy / tensors, so the driver needs no GPU.
Gradients accumulate on the device; at the commit the devices that hold the trainer engine all-reduce
them in a torch.distributed group (NCCL between GPUs, gloo between CPU cores) and take the same
optimizer step, so every trainer replica stays equal. A worker that dies loses its accumulated gradients: the
executor re-runs its train nodes of the open step.
"""

import copy
import os
import socket
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import ray
import torch
import torch.distributed as dist

from dovetail.config.train import TrainConfig
from dovetail.models.flow_rl import SampleId, accumulate_policy_gradient, commit, generate, recompute_log_probs
from dovetail.models.pretrain import latents_to_images
from dovetail.models.sampling import Trajectories
from dovetail.models.t2i import load_model, strict_fp32
from dovetail.recipe import advantages_of, make_optimizer, policy_gradient, sde_settings
from dovetail.rewards import load_rewards, score

DEVICE_RESOURCE = "dovetail_device"
GROUP_TIMEOUT_S = 120
PROFILE_ROUNDS = 3
"""Rounds of the start-up profile. One round's small-pass fit swung with this machine's noise (a fitted half point
of 0 made digen cut 8 fragments where 4 ran 1.4x faster)."""


def pack(trajectories: Trajectories, ids: list[SampleId]) -> dict:
    """Trajectories as numpy arrays: Ray moves numpy views ~10x faster than pickled tensors."""
    return {
        "prompts": trajectories.prompts,
        "prompt_ids": trajectories.prompt_ids.cpu().numpy(),
        "latents": trajectories.latents.cpu().numpy(),
        "log_probs": trajectories.log_probs.cpu().numpy(),
        "ids": [(s.step, s.prompt, s.index) for s in ids],
    }


def unpack(parts: list[dict], sigmas: torch.Tensor) -> tuple[Trajectories, list[tuple[int, int, int]]]:
    """Packed parts joined into one batch, on the device of `sigmas`."""

    def tensor(array):
        return torch.tensor(array, device=sigmas.device)

    joined = Trajectories.concat(
        [
            Trajectories(p["prompts"], tensor(p["prompt_ids"]), tensor(p["latents"]), tensor(p["log_probs"]), sigmas)
            for p in parts
        ]
    )
    return joined, [tuple(i) for p in parts for i in p["ids"]]


def form_group(workers: list) -> None:
    """Every device joins one torch.distributed group, rendezvous on the first device's node."""
    address, port = ray.get(workers[0].rendezvous.remote())
    ray.get([w.join_group.remote(address, port, len(workers)) for w in workers])


def weights_of(model) -> dict[str, np.ndarray]:
    """Parameters as numpy arrays: Ray moves numpy views ~10x faster than pickled tensors."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def tensors_of(weights: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v.copy()) for k, v in weights.items()}


def trainer_state_of(model, optimizer) -> dict:
    """Weights and optimizer state on the CPU: checkpoints and restarts must not need the GPU they came from."""
    optimizer_state = optimizer.state_dict()
    moments = {
        index: {name: value.cpu() if torch.is_tensor(value) else value for name, value in per_param.items()}
        for index, per_param in optimizer_state["state"].items()
    }
    return {"weights": weights_of(model), "optimizer": optimizer_state | {"state": moments}}


def load_trainer_state(model, optimizer, state: dict) -> None:
    """Into `model` / `optimizer` wherever they live: both loaders copy to the parameters' device."""
    model.load_state_dict(tensors_of(state["weights"]))
    optimizer.load_state_dict(state["optimizer"])


def worker_device() -> torch.device:
    """The GPU Ray assigned to this actor (Ray narrows CUDA_VISIBLE_DEVICES to it), else the CPU."""
    return torch.device("cuda", 0) if ray.get_gpu_ids() else torch.device("cpu")


def group_backend(device: torch.device) -> str:
    """NCCL all-reduces tensors on CUDA devices, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def join_process_group(address: str, port: int, rank: int, world: int, backend: str) -> None:
    """Module-level: Ray cannot pickle actor methods that use torch.distributed."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )


def all_reduce_sum(tensor: torch.Tensor, ranks: tuple[int, ...], groups: dict) -> None:
    """Sum `tensor` in place over the devices `ranks` (a subgroup cut once, by its members only)."""
    if len(ranks) < 2:
        return
    if ranks not in groups:
        groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    dist.all_reduce(tensor, group=groups[ranks])


def flat_gradient(model) -> torch.Tensor:
    return torch.cat(
        [
            p.grad.flatten() if p.grad is not None else torch.zeros(p.numel(), device=p.device)
            for p in model.parameters()
        ]
    )


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels, so that a wall-clock time covers the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_work(model, config: TrainConfig, sde, samples: int, carry: Callable[[dict], dict]) -> dict[str, float]:
    """Measured seconds of each kind of work on `model`'s device, on a throw-away copy of it (samples of RL step
    -1, never trained): what the cost model is fitted to before planning. A small untimed round first takes the
    one-off costs (the judge is fitted on first use, first-call allocations); generation is then timed at two
    batch sizes, which pins down the fixed cost of a small pass (from the fastest rounds: interference only adds
    time); every other time is the median of PROFILE_ROUNDS. A publication is timed from the trainer's weights to a
    loaded rollout copy; `carry` moves the weights between them (the object store, or pickle in a dry run)."""
    trainer = copy.deepcopy(model)
    rollout = copy.deepcopy(model).requires_grad_(False)
    optimizer = make_optimizer(trainer, config)

    def one_of_each(n: int) -> dict[str, float]:
        prompts = [f"digit {p % 10}" for p in range(n)]
        ids = [SampleId(-1, p, 0) for p in range(n)]
        seconds = {}

        def timed(name, work):
            synchronize(trainer.device)
            start = time.perf_counter()
            result = work()
            synchronize(trainer.device)
            seconds[name] = time.perf_counter() - start
            return result

        trajectories = timed(
            "generate", lambda: generate(trainer, prompts, ids, sde, seed=config.seed, shared_group_noise=False)
        )
        timed("score", lambda: score(latents_to_images(trajectories.images), prompts, config.reward))
        with torch.no_grad():
            timed(
                "logprob",
                lambda: trainer(trajectories.latents[:, 0], sde.sigmas[:1].expand(n), trajectories.prompt_ids),
            )
        timed(
            "train",
            lambda: accumulate_policy_gradient(
                trainer,
                trajectories,
                torch.ones(n, device=trainer.device),
                [0],
                sde,
                chunk_size=n,
                total_pairs=n,
                clip_range=config.algo.clip_range,
            ),
        )
        timed("optimizer", lambda: commit(trainer, optimizer, config.train.max_grad_norm))
        timed("publish", lambda: rollout.load_state_dict(tensors_of(carry(weights_of(trainer)))))
        return seconds

    small = max(1, samples // 4)
    one_of_each(small)
    rounds = [(one_of_each(samples), one_of_each(small)) for _ in range(PROFILE_ROUNDS)]
    seconds = {name: statistics.median(full[name] for full, _ in rounds) for name in rounds[0][0]}
    return seconds | {
        "generate_fastest": min(full["generate"] for full, _ in rounds),
        "generate_small_fastest": min(part["generate"] for _, part in rounds),
    }


@ray.remote(num_cpus=0, resources={DEVICE_RESOURCE: 1}, max_restarts=-1, max_task_retries=0)
class DeviceWorker:
    def __init__(self, index: int, pin_core: bool = True):
        torch.set_num_threads(1)
        self.device = worker_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            strict_fp32()
        elif pin_core and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {index % os.cpu_count()})
        self.index = index
        self.config: TrainConfig | None = None

    def configure(self, config: dict, trainer_state: dict) -> None:
        """Build the engines for a run: trainer (weights + optimizer), rollout copy, reward judge; a device of the
        reward pool (the last runtime.reward_devices) holds the reward engine alone. Workers outlive a run, so
        one pool serves many runs (and tests) without restarting torch."""
        self.config = TrainConfig(**config)
        self.sde = sde_settings(self.config, self.device)
        self.rollout_version: int | None = None
        self.role: str | None = None
        self.accumulated: torch.Tensor | None = None
        load_rewards(self.config.reward)
        if self.index >= self.config.compute_devices:
            self.trainer = self.optimizer = self.reference = self.rollout = None
            return
        self.trainer = load_model(self.config.model.checkpoint).to(self.device)
        self.optimizer = make_optimizer(self.trainer, self.config)
        self.load_trainer_state(trainer_state)
        self.reference = (
            load_model(self.config.model.checkpoint).to(self.device).requires_grad_(False)
            if self.config.algo.beta > 0
            else None
        )
        self.rollout = copy.deepcopy(self.trainer).requires_grad_(False)

    def engines(self) -> list[str]:
        """The engines this device holds (every device holds the reward engine, built at configure)."""
        held = {"trainer": self.trainer, "rollout": self.rollout, "reference": self.reference}
        return [name for name, engine in held.items() if engine is not None] + ["reward"]

    def join_group(self, address: str, port: int, world: int) -> None:
        """(Re)join the torch.distributed group of all devices; trainer groups are cut from it at commits.
        Accumulated gradients survive (a re-join follows another device's restart)."""
        join_process_group(address, port, self.index, world, group_backend(self.device))
        self.groups: dict[tuple[int, ...], object] = {}

    def rendezvous(self) -> tuple[str, int]:
        """An address and a free port on this device's node, for the group's TCP rendezvous."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            return ray.util.get_node_ip_address(), probe.getsockname()[1]

    def ping(self) -> int:
        return os.getpid()

    def profile(self, samples: int) -> dict[str, float]:
        return profile_work(
            self.trainer, self.config, self.sde, samples, carry=lambda weights: ray.get(ray.put(weights))
        )

    # ---------------------------------------------------------------- trainer state
    def trainer_state(self) -> dict:
        return trainer_state_of(self.trainer, self.optimizer)

    def load_trainer_state(self, state: dict) -> None:
        """Take over another replica's committed state (after a restart, or to join the trainer pool)."""
        load_trainer_state(self.trainer, self.optimizer, state)
        self.optimizer.zero_grad(set_to_none=True)

    def export_weights(self) -> dict:
        """The trainer's weights as numpy arrays: what a publish node puts in the object store."""
        return weights_of(self.trainer)

    def load_rollout_weights(self, version: int, weights: list) -> float:
        """Switch the rollout engine to `version` (called between trajectories, never inside one)."""
        start = time.perf_counter()
        if self.rollout_version != version:
            state = weights[0] if isinstance(weights[0], dict) else ray.get(weights[0])
            self.rollout.load_state_dict(tensors_of(state))
            self.rollout_version = version
        return time.perf_counter() - start

    def switch_role(self, role: str) -> float:
        """Sleep one engine, wake the other. Both stay resident on the device (the model is small); the
        call measures the round trip, which is what a switch costs here."""
        start = time.perf_counter()
        self.role = role
        return time.perf_counter() - start

    # ---------------------------------------------------------------- work
    def generate(self, ids: list[tuple[int, int, int]], prompts: list[str], version: int, weights: list) -> dict:
        self.load_rollout_weights(version, weights)
        sample_ids = [SampleId(*i) for i in ids]
        trajectories = generate(
            self.rollout,
            prompts,
            sample_ids,
            self.sde,
            seed=self.config.seed,
            shared_group_noise=self.config.shared_group_noise,
        )
        return pack(trajectories, sample_ids) | {"version": version}

    def score(self, *parts: dict) -> dict:
        trajectories, ids = unpack(list(parts), self.sde.sigmas)
        scores = score(latents_to_images(trajectories.images), trajectories.prompts, self.config.reward)
        return {"ids": ids, "scores": scores}

    def old_log_probs(self, timesteps: list[int], *parts: dict) -> dict:
        """Recompute the log-probs of the taken steps under the trainer's weights (colocated baselines)."""
        trajectories, ids = unpack(list(parts), self.sde.sigmas)
        return {
            "ids": ids,
            "log_probs": recompute_log_probs(self.trainer, trajectories, timesteps, self.sde).cpu().numpy(),
        }

    def train(
        self, samples: list, timesteps: list[int], total_pairs: int, stale: bool, counts: tuple[int, ...], *inputs: dict
    ) -> dict:
        """Gradient of the GRPO loss of `samples` over `timesteps`; `stale` when they were generated by
        the previous weights (TCSS), which switches on the decoupled importance correction.

        `inputs` are the trajectory parts, score parts and, when the policy recomputes them, old
        log-prob parts the node reads (`counts` says how many of each); they hold whole groups, over
        which the advantages are computed.
        """
        trajectories, ids = unpack(list(inputs[: counts[0]]), self.sde.sigmas)
        position = {sample: row for row, sample in enumerate(ids)}
        rows = [position[tuple(sample)] for sample in samples]
        rewards = np.zeros(len(ids))
        for part in inputs[counts[0] : counts[0] + counts[1]]:
            rewards[[position[tuple(s)] for s in part["ids"]]] = part["scores"]["total"]
        for part in inputs[counts[0] + counts[1] :]:
            trajectories.log_probs[[position[tuple(s)] for s in part["ids"]]] = torch.from_numpy(part["log_probs"]).to(
                self.device
            )
        advantages = advantages_of(self.config, rewards, [sample[1] for sample in ids])
        self.optimizer.zero_grad(set_to_none=True)
        sums = policy_gradient(
            self.trainer,
            trajectories.select(rows),
            advantages[rows],
            timesteps,
            self.sde,
            self.config,
            total_pairs=total_pairs,
            reference_model=self.reference,
            stale=stale,
        )
        gradient = flat_gradient(self.trainer)
        self.accumulated = gradient if self.accumulated is None else self.accumulated + gradient
        self.optimizer.zero_grad(set_to_none=True)
        return {"stats": sums, "ids": [ids[r] for r in rows], "timesteps": timesteps, "rewards": rewards[rows]}

    def commit(self, ranks: tuple[int, ...]) -> float:
        """All-reduce the step's gradients over the trainer devices `ranks` and take one optimizer step;
        returns the pre-clip gradient norm (the same on every replica)."""
        total = (
            torch.zeros(sum(p.numel() for p in self.trainer.parameters()), device=self.device)
            if self.accumulated is None
            else self.accumulated.clone()
        )
        all_reduce_sum(total, ranks, self.groups)
        offset = 0
        for p in self.trainer.parameters():
            p.grad = total[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.accumulated = None
        return commit(self.trainer, self.optimizer, self.config.train.max_grad_norm)
