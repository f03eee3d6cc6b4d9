"""DeviceWorker: one Ray actor per device (a GPU, or on a CPU-only machine one pinned core).

It holds a pipeline's engines (`runtime.pipeline.PipelineEngines`: for a flow model or a language model, rollout,
trainer, reference and reward engines) and does the typed work the driver sends (`runtime.messages`). It carries out
work and never decides: which node runs where is the policy's, through the executor.

The engines live on the worker's device (the GPU Ray assigned it, else the CPU); what crosses Ray (rollouts,
scores, weights, trainer state) is CPU numpy / tensors, so the driver needs no GPU. Each train part's gradient is
added, as the part finishes, into the device's one fp64 sum of the open step (each part once, by its key (node,
index)); at the commit one all-reduce in a torch.distributed group (NCCL between GPUs, gloo between CPU cores) adds
the devices' sums (`reduce_parts`): fp32 gradients add up in fp64 to the same bits in any order, so the sum is the
same whichever device trained which part in whichever order — a run is bitwise reproducible under a scheduler that
places work by measured time — and every trainer replica takes the same optimizer step. A worker that dies loses its
sum: the executor re-runs its parts (same keys, same bits).

A publication's weights come through the object store, or by a broadcast that runs on a thread of its own
(`broadcast_weights`) and stages them for the `LoadWeights` in the main queue: `runtime.publication` says why that
cannot deadlock.
"""

import os
import socket
import statistics
import time
import uuid
from dataclasses import replace
from datetime import timedelta

import ray
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dovetail.config.load import parse_config
from dovetail.config.multiplex import MultiplexConfig
from dovetail.kinds import kind
from dovetail.models.memory import peak_bytes
from dovetail.models.training import (
    scale_gradients,
    stepped_lr,
    strict_fp32,
    trainable_parameters,
)
from dovetail.runtime.messages import (
    Commit,
    Committed,
    DeviceMemory,
    FurtherUpdate,
    Loaded,
    LoadWeights,
    Trained,
    TrainerWork,
    Work,
)
from dovetail.runtime.publication import (
    Layout,
    Staging,
    broadcast,
    empty_buffers,
    flatten,
    publication_group,
    unflatten,
)
from dovetail.runtime.ray_start import DEVICE_RESOURCE, LOOPBACK
from dovetail.runtime.rendezvous import RayStore, forget

GROUP_TIMEOUT_S = 120


class WorkerRestarted(RuntimeError):
    """A restarted DeviceWorker got work before it was configured again: the executor revives it and sends the work
    again (`runtime.recovery`)."""


def form_group(workers: list) -> str:
    """Every device joins one new torch.distributed group, its rank its place in `workers`; it meets in Ray's
    key-value store (`runtime.rendezvous`), which outlives any device. Returns the group's rendezvous prefix."""
    prefix = f"group-{uuid.uuid4().hex}"
    ray.get([w.join_group.remote(prefix, rank, len(workers)) for rank, w in enumerate(workers)])
    return prefix


def through_object_store(weights: dict) -> dict:
    """Weights as a publication moves them: into Ray's object store and out (what the profile times)."""
    return ray.get(ray.put(weights))


def worker_device() -> torch.device:
    """The GPU Ray assigned to this actor (Ray narrows CUDA_VISIBLE_DEVICES to it), else the CPU."""
    return torch.device("cuda", 0) if ray.get_gpu_ids() else torch.device("cpu")


def group_backend(device: torch.device) -> str:
    """NCCL all-reduces tensors on CUDA devices, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def join_process_group(prefix: str, rank: int, world: int, backend: str) -> RayStore:
    """Module-level: Ray cannot pickle actor methods that use torch.distributed. On a local run's node (loopback)
    every member is on this machine, and gloo's own connections stay on loopback too. Returns the group's store,
    which the caller keeps for the group's life: torch holds it from C++ only, and sub-groups cut later read it."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if ray.util.get_node_ip_address() == LOOPBACK:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    store = RayStore(prefix, timeout)
    named = c10d._world.group_count
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    except BaseException:
        # torch names a default group by a count of this process's groups, which it has advanced: a member whose
        # forming failed (its group abandoned) would name its next group apart from members that never tried, and
        # the group would never meet
        c10d._world.group_count = named
        raise
    return store


def loopback_interface() -> str:
    """This machine's loopback network interface (`lo` on Linux, `lo0` on macOS)."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if not names:
        raise RuntimeError("no loopback network interface (lo) on this machine: a local run keeps its group on it")
    return min(names, key=len)


def group_of(ranks: tuple[int, ...], groups: dict):
    """The torch.distributed subgroup of the devices `ranks`, cut once (by its members only) and kept in `groups`."""
    if ranks not in groups:
        groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return groups[ranks]


def reduce_parts(total: torch.Tensor, ranks: tuple[int, ...], groups: dict) -> torch.Tensor:
    """The sum over the devices `ranks` of each device's `total`, the flat fp64 sum of the train parts it trained
    (zeros where it trained none), added in place by one all-reduce. fp32 terms add up in fp64 to the same bits in
    any order unless their magnitudes span more than 2^29 (less a few bits of carries), and the sum is rounded once to
    fp32 at the commit, so a run is the same bits whichever device trained which part, in whichever order it finished
    (and after a restart). A device holds one fp64 sum (8 bytes a trained parameter), where keeping each part to add
    them in key order at the commit held 8 bytes a parameter per part; one gradient per device crosses, where
    gathering every part to every device moved them all (4 fp64 parts on each of 2 devices of a 1.3 M-parameter
    model: ~140 ms gathered, ~20 ms all-reduced as one sum)."""
    if len(ranks) > 1:
        dist.all_reduce(total, group=group_of(ranks, groups))
    return total


def replica_ranks(ranks: tuple[int, ...], group: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """The trainer devices holding the same shards as `rank`, a member of the FSDP group `group`: the trainer devices
    `ranks` (sorted) cut into consecutive groups of `group`'s size, each a replica of the trainer (HYBRID), the
    member at `rank`'s place in each. One group: `rank` alone."""
    size = len(group)
    groups = [ranks[start : start + size] for start in range(0, len(ranks), size)]
    if len(ranks) % size or group not in groups:
        raise RuntimeError(
            f"the trainer devices {list(ranks)} are not cut into FSDP groups like {list(group)}: a sharded trainer's "
            "groups are consecutive devices of one size"
        )
    place = group.index(rank)
    return tuple(replica[place] for replica in groups)


@torch.no_grad()
def add_across(parameters: list[torch.nn.Parameter], replicas) -> None:
    """Add each sharded parameter's local gradient over the torch.distributed group `replicas` (the members that hold
    the same shard in the other FSDP groups), in place. A parameter without a gradient (its group trained nothing
    this step) takes zeros first: every member makes the same reductions."""
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        dist.all_reduce(parameter.grad.to_local(), group=replicas)


@ray.remote(
    num_cpus=0,
    resources={DEVICE_RESOURCE: 1},
    max_restarts=-1,
    max_task_retries=0,
    concurrency_groups={"liveness": 1, "publication": 1, "metrics": 1},
)
class DeviceWorker:
    def __init__(self, index: int, pin_core: bool = True):
        """`index`: the device's place in the pool that started it, which picks its core; a run gives the worker
        its place in that run's pool at `configure` (the same, unless the run goes on without a lost device)."""
        torch.set_num_threads(1)
        self.device = worker_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            strict_fp32()
        elif pin_core and hasattr(os, "sched_setaffinity"):
            # device i is the i-th core this process may use (taskset / cgroups narrow them): two runs started on
            # different cores keep to them
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cores[index % len(cores)]})
        self.index = index
        self._engines = None
        self.group: str | None = None
        """The rendezvous prefix of this device's current group (`form_group`)."""
        self.publication_groups: dict[str, tuple[object, RayStore]] = {}
        """This device's publication groups and their stores, by rendezvous prefix (the publication thread's alone)."""
        self.staging = Staging()
        self.held_memory = DeviceMemory()
        """The bytes held by kind after the last work here (`memory` answers it, from a thread of its own)."""

    def configure(self, config: dict, trainer_state: dict, index: int) -> None:
        """Build the pipeline's engines for a run in which this is device `index`; a device past `compute_devices`
        (the reward pool) holds the reward engine alone. Workers outlive a run, so one pool serves many runs (and
        tests) without restarting torch."""
        self.index = index
        parsed = parse_config(config)
        assert not isinstance(parsed, MultiplexConfig), "a worker serves one pipeline: it is given that one's config"
        self.config = parsed
        self.publication_groups.clear()  # an earlier run's: it is over, and its driver forgot their rendezvous
        holds_policy = self.index < self.config.compute_devices
        engines = kind(self.config.kind).load("engines")
        self._engines = engines(self.config, self.device, holds_policy, trainer_state)
        self.gradient: torch.Tensor | None = None
        """The fp64 sum of the open step's train parts' gradients here (None before the first)."""
        self.summed: set[tuple[str, int]] = set()
        """The parts (node, index) in `gradient`: a part sent again to this process is added once."""
        self.step_parts: dict[tuple[str, int], Work] = {}
        """The open step's train parts here, by key: a commit of several updates (`Commit.updates`) runs them
        again for each update after the first."""
        self.role: str | None = None
        self.held_memory = self.engines.memory()

    @property
    def engines(self):
        """The pipeline's engines here; a new incarnation (Ray restarted this actor) has none until `configure`."""
        if self._engines is None:
            raise WorkerRestarted(f"device {self.index} restarted and is not configured yet")
        return self._engines

    def preload(self, kind_name: str) -> None:
        """Import a pipeline kind's engines (torch's model stack: seconds) before `configure` needs them. A run
        started from the command line sends this as its workers start, before its own process imports the same
        stack, so that the two imports overlap instead of following each other (`launch.start_devices_early`)."""
        kind(kind_name).load("engines")

    def held_engines(self) -> list[str]:
        """The engines this device holds (every device holds the reward engine, built at configure)."""
        return self.engines.held()

    def join_group(self, prefix: str, rank: int, world: int) -> None:
        """(Re)join the torch.distributed group of all devices as `rank`; trainer groups are cut from it at commits.
        Accumulated gradients survive (a re-join follows another device's restart)."""
        self.store = join_process_group(prefix, rank, world, group_backend(self.device))
        self.groups: dict[tuple[int, ...], object] = {}
        # every member has left the group this one replaces (each leaves before it joins, and joining waits for all):
        # its rendezvous keys are nobody's any more
        previous, self.group = self.group, prefix
        if previous is not None and previous != prefix:
            forget(previous)

    @ray.method(concurrency_group="liveness")
    def ping(self) -> int:
        """This process's pid, answered on a thread of its own: a worker whose work waits for a peer (a commit's
        all-reduce) still tells a revive that it is alive, so the revive can send that peer its work."""
        return os.getpid()

    @ray.method(concurrency_group="publication")
    def broadcast_weights(self, prefix: str, rank: int, world: int, version: int, layout: Layout, weights) -> None:
        """One publication by broadcast, on the publication thread: rank 0 sends `weights` (the exported snapshot),
        the others receive weights of `layout` into their staging under `version`. A failure (a member died, the
        group broke) is staged instead: that version loads from the object store, and this group is left."""
        try:
            if prefix not in self.publication_groups:
                self.publication_groups[prefix] = publication_group(prefix, rank, world, self.device)
            buffers = flatten(weights, self.device) if rank == 0 else empty_buffers(layout, self.device)
            group, _ = self.publication_groups[prefix]
            broadcast(group, buffers)
            if rank > 0:
                self.staging.put(version, unflatten(buffers, layout))
        except Exception as error:  # any failure is the publication's: it has a fallback
            self.publication_groups.pop(prefix, None)
            if rank > 0:
                self.staging.put(version, error)

    @ray.method(concurrency_group="metrics")
    def memory(self) -> DeviceMemory:
        """This device's bytes by kind as its last work left them, and its peak so far: answered on a thread of its
        own, so a step's metrics never wait for the work queued here (a device that took no part in the step's
        commit, whose answer carries the trainer devices' memory)."""
        return replace(self.held_memory, peak=peak_bytes(self.device))

    def profile(self, samples: int) -> dict[str, float]:
        return self.engines.profile(samples, carry=through_object_store)

    def time_kind(self, kind: str, samples: int, repeats: int) -> list[tuple[float, float]]:
        """(start, end) of each of `repeats` runs of one kind of the profile's work here: `runtime.interference` times
        it alone, and beside another pipeline's work on this device."""
        return self.engines.time_kind(kind, samples, repeats, carry=through_object_store)

    def trainer_state(self) -> dict:
        """The trainer's state (a sharded trainer's: this member's shards)."""
        return self.engines.trainer_state()

    def export_weights(self) -> dict:
        """The trainer's weights as numpy arrays: what a publish node puts in the object store. Every member of a
        sharded trainer's group is asked at once; the first answers the weights."""
        group = self.engines.sharded_group
        return self.engines.export_weights(keep=group is None or self.index == group[0])

    @ray.method(num_returns=2)
    def taken_trainer_state(self) -> tuple[bool, dict]:
        """`trainer_state` as the second of two objects: the driver waits on the first, a flag, to learn that the
        call succeeded, and hands the second on by reference without fetching it (a trainer state is three times the
        weights)."""
        return True, self.trainer_state()

    @ray.method(num_returns=2)
    def taken_weights(self) -> tuple[bool, dict]:
        """`export_weights` as the second of two objects, as `taken_trainer_state` gives the state."""
        return True, self.export_weights()

    def switch_role(self, role: str) -> float:
        """Sleep one engine, wake the other (`PipelineEngines.hold`: vLLM's rollout engine sleeps while the device
        trains; the others stay resident, the models being small); returns the round trip, what a switch costs here."""
        start = time.perf_counter()
        self.engines.hold(role)
        self.role = role
        return time.perf_counter() - start

    def run(self, work: Work, part: tuple[str, int] | None = None):
        """Do one piece of work, `part` (node, index) of a node. A train part's gradient is kept under that key
        for the commit."""
        if isinstance(work, Commit):
            if work.group and self.engines.sharded_group is None:  # a member no train node has reached yet
                self._shard(work.group)
            return self._commit(work)
        if isinstance(work, LoadWeights):
            return self._load(work)
        if isinstance(work, TrainerWork) and work.group:
            self._shard(work.group)
        replica = self.engines.sharded_group is None
        if self.engines.trainer is not None and replica:  # a sharded trainer's gradients add up over the step
            self.engines.trainer.zero_grad(set_to_none=True)
        result = self.engines.run(work)
        if isinstance(result, Trained) and replica:
            assert part is not None, "a train part is sent with its key"  # executor._launch sends every part's
            gradient = self.engines.part_gradient()
            if part not in self.summed:
                self.gradient = gradient if self.gradient is None else self.gradient.add_(gradient)
                self.summed.add(part)
                self.step_parts[part] = work
        self.held_memory = self.engines.memory(self._held_gradient())
        return result

    def _shard(self, group: tuple[int, ...]) -> None:
        """Shard the trainer over the devices `group` at its first work there (`PipelineEngines.shard_trainer`); the
        group stays the trainer's for the run."""
        engines = self.engines
        if engines.sharded_group is None:
            from dovetail.models.sharding import group_mesh  # a sharded run's (`PipelineEngines.shard_trainer`)

            engines.shard_trainer(group, group_mesh(group_of(group, self.groups), self.device.type))
        elif engines.sharded_group != group:
            raise RuntimeError(
                f"the trainer is sharded over devices {list(engines.sharded_group)} and a node trains on "
                f"{list(group)}: a sharded trainer keeps one group for the run; use a policy that trains on one "
                "pool of devices, or train.sharding: replicate"
            )

    def _load(self, work: LoadWeights) -> Loaded:
        """Switch the rollout engine to the published version: the broadcast's staged weights where it was sent
        one, else (or if it failed) the object store's."""
        engines, start = self.engines, time.perf_counter()  # a bare incarnation raises at once, before any wait
        weights, path = work.weights, "object_store"
        if work.staged:
            try:
                weights, path = self.staging.take(work.version), "collective"
            except Exception:  # the broadcast failed or never came: the object store has it
                pass
        engines.load_rollout_weights(work.version, weights)
        self.held_memory = engines.memory(self._held_gradient())
        return Loaded(time.perf_counter() - start, path)

    def _commit(self, work: Commit) -> Committed:
        """Add the step's train parts' gradients of every trainer device (`reduce_parts`) and take one optimizer
        step. Its answer carries the device's memory: the gradients as the commit holds them (the fp64 sum and the
        trainer's own), the rest after the optimizer step (AdamW makes its moments at its first). A sharded
        trainer's gradients were added in the backward (FSDP's reduce-scatter): its commit scales them and steps."""
        if self.engines.sharded_group is not None:
            return self._commit_shards(work)
        start = time.perf_counter()
        total = self.gradient if self.gradient is not None else self._zero_gradient()
        undo = self._undo_point(total) if work.updates > 1 else None
        try:
            summed = reduce_parts(total, work.ranks, self.groups)
            synced = time.perf_counter()
            self.engines.set_step_gradient([summed], work.scale)
            gradients = self.engines.memory([summed]).gradients
            self.gradient, self.summed = None, set()
            grad_norm = self._step(work)
            lr = stepped_lr(self.engines.optimizer)
            further = tuple(self._further_update(work) for _ in range(work.updates - 1))
        except Exception:
            if undo is not None:  # a peer lost in a later update's all-reduce: the commit is sent again, whole
                self._undo(undo)
            raise
        self.step_parts = {}
        seconds = time.perf_counter() - synced
        self.held_memory = self.engines.memory()
        memory = replace(self.held_memory, gradients=gradients)
        return Committed(grad_norm, lr, synced - start, seconds, memory, further=further)

    def _undo_point(self, total: torch.Tensor) -> tuple:
        """What a commit of several updates changes before its last all-reduce: the trainer's state (and what the
        engines keep beside it), the step's gradient here (the all-reduce adds into it), its parts. A commit whose
        first all-reduce fails has changed nothing; one that fails in a later update's has stepped the weights."""
        return self.engines.trainer_state(), total.clone(), set(self.summed), dict(self.step_parts)

    def _undo(self, point: tuple) -> None:
        """Back to `_undo_point`'s: the executor sends the commit again once the lost peer is back, and it must find
        this device as the first attempt did."""
        state, self.gradient, self.summed, self.step_parts = point
        self.engines.load_trainer_state(state)

    def _step(self, work: Commit) -> float:
        """One optimizer step on the gradient set (the lr is the RL step's: `commit`'s `updates_per_step`), and what
        the engines keep beside the weights follows; returns the pre-clip gradient norm."""
        grad_norm = self.engines.step_optimizers(work.updates)
        self.engines.after_commit()
        return grad_norm

    def _further_update(self, work: Commit) -> FurtherUpdate:
        """An update after the commit's first: the step's train parts here run again on the weights now (in the
        order of their keys; their fp64 sum is the same bits in any order), the devices' sums added as for the
        first, and one more optimizer step."""
        trained, total = [], self._zero_gradient()
        for key in sorted(self.step_parts):
            trained.append(self.engines.train_again(self.step_parts[key]))
            total += self.engines.part_gradient()
        self.engines.set_step_gradient([reduce_parts(total, work.ranks, self.groups)], work.scale)
        return FurtherUpdate(self._step(work), trained)

    def _commit_shards(self, work: Commit) -> Committed:
        """A sharded trainer's commit: every member scales its shard of the step's summed gradient and steps its
        shards; the gradient norm is the whole gradient's (the members' squares added). Under HYBRID (the trainer
        devices `work.ranks` cut into several FSDP groups, each a replica that trained its own nodes) each member
        first adds its shard's gradient to those of the members at its place in the other groups, so that every
        replica takes the same step."""
        start = time.perf_counter()
        trained = self.engines.trained_modules()  # the trainer, and a PPO run's critic beside it
        group = self.engines.sharded_group
        assert group is not None, "a sharded commit follows the trainer's first sharded work"
        from dovetail.models.sharding import resharded  # a sharded run's (`PipelineEngines.shard_trainer`)

        for module in trained:
            resharded(module)
        replicas = replica_ranks(tuple(sorted(work.ranks)), group, self.index)
        if len(replicas) > 1:
            add_across([p for module in trained for p in trainable_parameters(module)], group_of(replicas, self.groups))
        synced = time.perf_counter()
        for module in trained:
            scale_gradients(module, work.scale)
        gradients = self.engines.memory().gradients
        grad_norm = self._step(work)
        self.held_memory = self.engines.memory()
        memory = replace(self.held_memory, gradients=gradients)
        seconds = time.perf_counter() - synced
        _, optimizer = self.engines.held_trainer()
        return Committed(grad_norm, stepped_lr(optimizer), synced - start, seconds, memory, group)

    def _held_gradient(self) -> list[torch.Tensor]:
        return [] if self.gradient is None else [self.gradient]

    def _zero_gradient(self) -> torch.Tensor:
        """A flat fp64 gradient of zeros of a part's length (`PipelineEngines.gradient_size`: what a part is)."""
        return torch.zeros(self.engines.gradient_size(), dtype=torch.float64, device=self.device)

    def time_sync(self, ranks: tuple[int, ...], repeats: int) -> float:
        """Median seconds of a commit's adding across the devices `ranks` (each calls this at once), one part of the
        trainer's gradient size per device: what the planner's commit across trainer replicas is fitted to
        (`cost.model.CostModel.replica_allreduce_seconds`). The first round, which cuts the group, is not timed."""
        total = self._zero_gradient()
        seconds = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            reduce_parts(total, ranks, self.groups)
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds[1:])


ENVIRONMENT_CALLS = 1024
"""Calls an `EnvironmentWorker` takes at once: each shard's env node waits in one of its threads."""


ENVIRONMENT_RESTARTS = 5
"""Times Ray restarts a pipeline's EnvironmentWorker, and sends a call in flight again, before the run gives up on it:
an environment that keeps killing its worker is a bug, not a fault, and must not spin."""


@ray.remote(
    num_cpus=0,
    max_restarts=ENVIRONMENT_RESTARTS,
    max_task_retries=ENVIRONMENT_RESTARTS,
    max_concurrency=ENVIRONMENT_CALLS,
)
class EnvironmentWorker:
    """One pipeline's environments off the devices (a run whose trajectories' waits free their devices,
    `graph.node.Kind.ENV`): its kind's off-device side (`PipelineKind.environments`: for a language model the
    episodes, `pipelines.lm.multiturn.Episodes`) in an actor of no device and no CPU share (Ray may place it on any
    node). An env node's call steps its trajectories' episodes and waits out their latency here, in a thread of its
    own, so the device its turn ran on is the policy's to fill meanwhile. It carries out work and never decides, as
    a DeviceWorker. One that dies is restarted by Ray as a DeviceWorker is, and the calls it had in flight (an env
    node's step, a prefill's reset) are sent again to the new incarnation by Ray itself (`max_task_retries`), so the
    executor sees nothing but a longer wait: the new one holds no episode, and opens again each one it is asked to
    step from the trajectory the call carries (`pipelines.lm.multiturn.Episodes`)."""

    def __init__(self, config: dict) -> None:
        torch.set_num_threads(1)
        parsed = parse_config(config)
        assert not isinstance(parsed, MultiplexConfig), "an environment worker serves one pipeline"
        self.environments = kind(parsed.kind).load("environments")(parsed)

    def ready(self) -> bool:
        """Answers once the actor is built (its environment's process started)."""
        return True

    def ping(self) -> int:
        """This process's pid (what a fault injection kills)."""
        return os.getpid()

    def run(self, work: Work):
        return self.environments.run(work)

    def stop(self) -> None:
        self.environments.stop()
