"""How a publication moves the committed weights from a trainer replica to the rollout devices: through Ray's object
store, or by a collective (one torch.distributed broadcast per dtype from the sender to the targets), chosen by
measured cost (`cluster.publication`).

The object store is the default path and always there: every publication exports the weights into it (a restarted
device, or one that was no target, loads a version from there). On one node it is shared memory, and nothing beats
it; across nodes Ray's object manager copies the whole weights to each target's node. A broadcast sends them once
over the devices' own links (gloo on CPU cores, NCCL between GPUs), which may cost less. `auto` times both on the
run's real weights at start-up, from device 0 to the devices on other nodes, and keeps the faster for publications
whose targets are on another node than the sender; `collective` broadcasts to every target but the sender.

Why this cannot deadlock. A worker's actor methods run one at a time, in submission order: if a receiver's broadcast
sat in that queue it could wait there behind work that waits for the sender, while the sender's queue waits for the
receiver. So the broadcast runs on a thread of its own on both sides (the worker's `publication` concurrency group,
one call at a time, in the order the driver sends them), and it depends on nothing in any worker's main queue:

* the sender broadcasts the weights it exported into the object store right after its commit (the object-store
  path's own export, an immutable snapshot: never the live trainer tensors, which its next commit may change while
  the broadcast runs), handed to it as an argument;
* a receiver receives into a staging buffer keyed by the version (`Staging`), and the ordinary `LoadWeights` in its
  main queue takes that version, waiting for it if it has not arrived.

A main queue thus waits only for a publication thread, and a publication thread only for the other members'
publication threads, which run the same broadcasts in the same order (the driver sends every member's call of one
publication before any of the next): no cycle. A broadcast that fails (a member died, the group broke, nothing came
within `STAGING_TIMEOUT_S`) leaves its error in the staging, and that publication loads from the object store
instead (`DeviceWorker.run`); the driver forms a new group for the next (`Incarnations.seen` marks the groups of a
dead member abandoned, so their members stop waiting at the rendezvous).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import numpy as np
import ray
import torch
import torch.distributed as dist

from dovetail.runtime.messages import LoadWeights
from dovetail.runtime.rendezvous import RayStore

Path = Literal["object_store", "collective"]
Layout = tuple[tuple[str, tuple[int, ...], str], ...]
"""(name, shape, numpy dtype) of every tensor of the published weights, in the order they are flattened."""
STAGING_TIMEOUT_S = 120.0
"""Seconds a `LoadWeights` waits for its broadcast (a publication group's timeout too) before it loads from the
object store."""


def layout_of(weights: dict[str, np.ndarray]) -> Layout:
    return tuple((name, tuple(array.shape), array.dtype.str) for name, array in sorted(weights.items()))


def flatten(weights: dict[str, np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The weights as one flat buffer per dtype (dtypes in the layout's order of first use), for one broadcast each."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, _, dtype in layout_of(weights):
        groups.setdefault(dtype, []).append(torch.from_numpy(np.ascontiguousarray(weights[name])).reshape(-1))
    return [torch.cat(parts).to(device) for parts in groups.values()]


def empty_buffers(layout: Layout, device: torch.device) -> list[torch.Tensor]:
    """Buffers `flatten` would fill for weights of `layout`, to receive into."""
    sizes: dict[str, int] = {}
    for _, shape, dtype in layout:
        sizes[dtype] = sizes.get(dtype, 0) + int(np.prod(shape, dtype=np.int64))
    return [torch.from_numpy(np.empty(size, dtype=np.dtype(dtype))).to(device) for dtype, size in sizes.items()]


def unflatten(buffers: list[torch.Tensor], layout: Layout) -> dict[str, np.ndarray]:
    """The weights (name -> numpy array, as `weights_of` exports them) back from `flatten`'s buffers."""
    host = {np.dtype(dtype).str: None for _, _, dtype in layout}
    for dtype, buffer in zip(host, buffers):
        host[dtype] = buffer.cpu().numpy()
    offsets = dict.fromkeys(host, 0)
    weights: dict[str, np.ndarray] = {}
    for name, shape, dtype in layout:
        size = int(np.prod(shape, dtype=np.int64))
        flat = host[dtype]
        assert flat is not None
        weights[name] = flat[offsets[dtype] : offsets[dtype] + size].reshape(shape)
        offsets[dtype] += size
    return weights


class Staging:
    """Received weights by version, between a worker's publication thread (`put`) and its main queue (`take`)."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._versions: dict[int, dict[str, np.ndarray] | Exception] = {}

    def put(self, version: int, received: dict[str, np.ndarray] | Exception) -> None:
        with self._ready:
            self._versions[version] = received
            self._ready.notify_all()

    def take(self, version: int, timeout_s: float = STAGING_TIMEOUT_S) -> dict[str, np.ndarray]:
        """The weights of `version`, once they arrived; raises the broadcast's error, or TimeoutError. Older
        versions still staged are dropped (their loads went to the object store)."""
        with self._ready:
            if not self._ready.wait_for(lambda: version in self._versions, timeout=timeout_s):
                raise TimeoutError(f"the broadcast of weights version {version} did not arrive in {timeout_s:g} s")
            received = self._versions.pop(version)
            self._versions = {v: staged for v, staged in self._versions.items() if v > version}
        if isinstance(received, Exception):
            raise received
        return received


def publication_group(prefix: str, rank: int, world: int, device: torch.device) -> tuple[object, RayStore]:
    """A process group of its own for broadcasts, met in Ray's key-value store under `prefix` like the device
    groups (`runtime.rendezvous`), and its store, which the caller keeps for the group's life (torch holds it from C++
    only: a store collected meanwhile fails the group's next use). Built directly, not with `dist.new_group`, which
    changes torch's global group registry: the main thread may be cutting a trainer group meanwhile."""
    timeout = timedelta(seconds=STAGING_TIMEOUT_S)
    store = RayStore(prefix, timeout)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, options), store
    return dist.ProcessGroupGloo(store, rank, world, timeout), store


def broadcast(group, buffers: list[torch.Tensor]) -> None:
    """One broadcast per buffer (per dtype) from rank 0."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for buffer in buffers:
        group.broadcast([buffer], options).wait()


@dataclass(frozen=True)
class Publication:
    """How a pipeline's run publishes: the setting, the path it resolved to, and what `auto` measured (seconds of
    one publication from device 0 to the devices on other nodes, by each path; None where nothing was measured)."""

    setting: Literal["auto", "object_store", "collective"]
    path: Path
    object_store_s: float | None = None
    collective_s: float | None = None

    def receivers(self, sender: int, targets: tuple[int, ...], nodes: Callable[[], list[str | None]]) -> tuple:
        """The group of a publication from `sender` to `targets`, the sender first; () where it goes through the
        object store alone. Under `auto`, only the targets on another node than the sender's receive by broadcast:
        on the sender's node the object store is shared memory."""
        if self.path == "object_store":
            return ()
        others = [target for target in targets if target != sender]
        if self.setting == "auto":
            node_of = nodes()
            others = [target for target in others if node_of[target] != node_of[sender]]
        return (sender, *others) if others else ()

    def line(self, pipeline: str | None) -> str:
        """What `auto` chose, and why, in one line (naming the pipeline of a multiplexed run)."""
        of = f" ({pipeline})" if pipeline else ""
        return (
            f"publication auto{of}: {self.path.replace('_', ' ')} across nodes, the faster measured on these weights "
            f"(collective {self.collective_s:.3g} s, object store {self.object_store_s:.3g} s)"
        )


def send(workers: list, group: tuple[int, ...], prefix: str, version: int, layout: Layout, weights) -> None:
    """Every member of `group` broadcasts on its publication thread: the sender (rank 0) the exported weights
    `weights` (a ref, which Ray hands it resolved), the others into their staging."""
    for rank, device in enumerate(group):
        payload = weights if rank == 0 else None
        workers[device].broadcast_weights.remote(prefix, rank, len(group), version, layout, payload)


def measured(
    setting: Literal["auto", "object_store", "collective"],
    pipeline: str,
    workers: list,
    prefix_of: Callable[[tuple[int, ...]], str],
    nodes: list[str | None],
    compute_devices: int,
) -> Publication:
    """The publication of a pipeline's run, measured where `auto` has a choice: one publication of the trainer's
    weights from device 0 to every compute device on another node, through the object store and by broadcast, each
    once after a round that warms it (the broadcast's forms its group), into the rollout engines as `LoadWeights` of
    versions below 0 (they hold the same weights as version 0, which their first rollout loads again). The group it
    forms meets under `prefix_of(group)` (`Incarnations.publication_prefix`), which the run's publications along it
    take up. Not kept with the start-up profile (`runtime.startup_cache`): it depends on which
    nodes the devices landed on."""
    targets = tuple(device for device in range(compute_devices) if nodes[device] != nodes[0])
    if setting != "auto" or not targets:
        return Publication(setting, "object_store" if setting == "auto" else setting)
    prefix = prefix_of((0, *targets))
    layout: Layout = ()
    seconds: dict[str, float] = {}
    for version, path in enumerate(["object_store", "collective"] * 2, start=1):
        succeeded, weights = workers[0].taken_weights.remote()
        ray.get(succeeded)
        layout = layout or layout_of(ray.get(weights))
        start = time.perf_counter()
        if path == "collective":
            send(workers, (0, *targets), prefix, -version, layout, weights)
        staged = path == "collective"
        loaded = ray.get([workers[d].run.remote(LoadWeights(pipeline, -version, weights, staged)) for d in targets])
        # a broadcast that failed loaded from the object store: it is no candidate
        failed = any(load.path != path for load in loaded)
        seconds[path] = float("inf") if failed else time.perf_counter() - start
    collective = seconds["collective"] < seconds["object_store"]
    path_chosen: Path = "collective" if collective else "object_store"
    return Publication(setting, path_chosen, seconds["object_store"], seconds["collective"])
