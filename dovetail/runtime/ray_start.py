"""Ray up for a run, without torch: a local instance (or the cluster a run names) and, for the command line, Ray and
the device workers started on a thread while the driver imports torch and its model stack
(`start_devices_in_background`). Kept apart from `launch` (which imports torch and the executor) so that Ray's
processes start before this process has imported torch: on two cores that import and Ray's start overlap instead of
following each other."""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager

import ray
from ray._private import ray_constants

from dovetail.config.common import REFERENCE, ray_address
from dovetail.config.multiplex import TrainConfig
from dovetail.cost.catalog import DEVICES, device
from dovetail.runtime.watchdog import start_watchdog

DEVICE_RESOURCE = "dovetail_device"
"""The Ray resource a CPU core offered as a device is (one per core of a local run)."""
LOOPBACK = "127.0.0.1"
"""The node address of a local run (`start_local_ray`): every server on it, and every peer on this machine."""


def device_bundle(config: TrainConfig) -> dict[str, float]:
    """What one device is to Ray: a GPU, or here one `dovetail_device` (a CPU core)."""
    platform = device(config.cluster.device).platform
    if platform == "cpu":
        return {DEVICE_RESOURCE: 1}
    if platform == "cuda":
        return {"GPU": 1}
    runnable = ", ".join(name for name, d in DEVICES.items() if d.platform in ("cuda", "cpu"))
    raise ValueError(
        f"cluster.device={config.cluster.device!r} can be planned (`dovetail simulate`) but not run: the Ray "
        f"runtime drives CUDA GPUs or CPU cores ({runnable})"
    )


RAY_NAMESPACE = "dovetail"
"""The Ray namespace a run's driver joins: `DevicePool`'s named workers are found in it."""


def start_ray(config: TrainConfig) -> None:
    """A local Ray instance (one `dovetail_device` per core, or the GPUs Ray finds), or the cluster at
    cluster.address or $RAY_ADDRESS (`ray_address`); either way it must hold cluster.devices devices."""
    (resource,) = device_bundle(config)
    if not ray.is_initialized():
        address = ray_address(config.cluster)
        with signal_handler_kept(signal.SIGTERM):
            if address:
                ray.init(address=address, namespace=RAY_NAMESPACE)
            else:
                start_local_ray(config.cluster.devices if resource == DEVICE_RESOURCE else None)
    elif threading.current_thread() is threading.main_thread():
        # started on another thread (`start_devices_in_background`), where Ray's own SIGTERM handler (which prints a
        # stack, and left a stopped run aborting at exit) replaced this process's in C and nothing could put it back
        signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGTERM))
    available = ray.cluster_resources().get(resource, 0)
    if available < config.cluster.devices:
        fix = (
            f"start the cluster's nodes with `ray start --resources='{{\"{DEVICE_RESOURCE}\": CORES}}'`"
            if resource == DEVICE_RESOURCE
            else "lower cluster.devices, or set cluster.device=cpu-core to use CPU cores"
        )
        raise RuntimeError(
            f"cluster.devices={config.cluster.devices} {config.cluster.device} devices asked for, but the Ray "
            f"instance has {available:g} {resource!r}; {fix}"
        )


@contextmanager
def signal_handler_kept(signum: int):
    """`ray.init` makes a driver's `signum` handler exit at once: the run's own (`runner.Interrupt`: save the step in
    flight, then stop) stays in place."""
    previous = signal.getsignal(signum)
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signum, previous)


_WATCHDOG: list[subprocess.Popen] = []
"""This process's watchdog (`runtime.watchdog`), started with its first local Ray instance; held for the life of the
process, whose end it watches."""


def start_local_ray(cpu_devices: int | None) -> None:
    """Our own Ray instance, never one already running on this machine (Ray's current-cluster file would join it),
    with every server on loopback: nothing of a local run is reachable from the network. Ray takes a loopback node
    address for the machine's own (so that other nodes could reach it) unless it runs as a single-machine instance,
    which is what its `ENABLE_RAY_CLUSTER` switch says while the node starts. `cpu_devices`: the CPU cores offered as
    devices (None on GPUs, which Ray finds itself). Its processes die with this one (`runtime.watchdog`).

    Its workers run at the driver's priority: Ray's default puts them at nice 15, below every other process of the
    machine, so that a run's devices lost their cores to anything else running beside it (a one-process run, the
    test suite's other process), whatever its share should have been."""
    options = {"address": "local", "_node_ip_address": LOOPBACK, "num_cpus": 1, "namespace": RAY_NAMESPACE}
    options |= {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    options["_system_config"] = {"worker_niceness": 0}
    if cpu_devices is not None:
        options["resources"] = {DEVICE_RESOURCE: cpu_devices}
    if not _WATCHDOG:
        _WATCHDOG.append(start_watchdog())
    cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    notice = ("ray._private.authentication.authentication_token_setup", "Token authentication is enabled for this")
    try:  # token authentication stays on; Ray's notice that it turned it on would open every run's output
        with warning_muted(*notice):
            ray.init(**options)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode


@contextmanager
def warning_muted(logger: str, text: str):
    """While inside, `logger`'s records that contain `text` are dropped (a warning about what is meant)."""

    def keep(record: logging.LogRecord) -> bool:
        return text not in record.getMessage()

    log = logging.getLogger(logger)
    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


def start_devices_in_background(config: TrainConfig, start_devices: Callable[[TrainConfig], dict]) -> Future:
    """`start_devices(config)` (`launch.start_devices_early`: the device pool, the workers importing their engines)
    on a thread of its own, after Ray itself is started there, for a caller with work of its own meanwhile (the
    command line: importing torch and the runner, checking the checkpoint, the base evaluation). Ray's start is mostly
    waiting on its processes, which come up while this process imports torch: the caller imports this module, which
    has not. The thread lives as long as this process: Ray's processes get Linux's parent-death signal when the
    thread that started them ends. Ray's notice that it leaves SIGTERM alone from a thread is muted: the run's own
    handler (`runner.Interrupt`) is the one meant."""
    started: Future = Future()

    def start() -> None:
        try:
            with warning_muted("ray._private.worker", "SIGTERM handler is not set"):
                if config.policy != REFERENCE and not ray_address(config.cluster):  # what `start_devices` starts
                    start_ray(config)
                started.set_result(start_devices(config))
        except BaseException as error:  # the run raises it where it waits for the devices
            started.set_exception(error)
            return
        threading.Event().wait()

    threading.Thread(target=start, name="start-devices", daemon=True).start()
    return started
