"""What a Ray run measures before its first step, kept per machine and config: the start-up profile of each
pipeline's work and, for a multiplexed run, the interference table. Measuring them takes seconds to tens of seconds
(a third of a multiplexed run's start-up here) and gives the same figures, within the machine's noise, every time the
same config starts on the same machine.

An entry's key hashes what the figures depend on: the machine (processor, cores this process may use, torch and
dovetail versions, the kernel setting), the pipeline config less what cannot change a device's seconds (steps,
evaluation, checkpoints, trackers, the policy, which schedules the work but does not change it, how many devices)
and, for the
interference table, every pipeline of the run. Anything else that changes is a new key, so a stale entry is never
read. `dovetail train --reprofile` (or DOVETAIL_CACHE=off) measures afresh; entries live in $DOVETAIL_CACHE
(default ~/.cache/dovetail/startup).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

FORMAT = 3
"""Bumped when what an entry holds, or how it is measured, changes."""

UNTIMED_FIELDS = (
    "train.steps",
    "eval",
    "checkpoint",
    "logger",
    "policy",
    "priority",
    "name",
    "cluster.devices",
    "cluster.lost_after_s",
)
"""Config fields that do not change how long a device takes for the profile's work (`cluster.devices`: how many,
each profiled alike; a run that goes on without a lost device plans with the figures it measured)."""


def cache_dir() -> Path | None:
    """Where entries live; None when DOVETAIL_CACHE is "off"."""
    setting = os.environ.get("DOVETAIL_CACHE", "")
    if setting == "off":
        return None
    return Path(setting) if setting else Path.home() / ".cache" / "dovetail" / "startup"


def machine() -> dict:
    """What of this machine a device's seconds depend on."""
    processor = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
        ]
        processor = names[0] if names else processor
    try:
        dovetail_version = version("dovetail")
    except PackageNotFoundError:
        dovetail_version = "unknown"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {
        "processor": processor,
        "cores": cores,
        "gpus": gpus,
        "torch": torch.__version__,
        "dovetail": dovetail_version,
        "kernels": {name: os.environ.get(name) for name in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")},
    }


def timed_fields(config_tree: dict) -> dict:
    """A pipeline config dump less `UNTIMED_FIELDS`."""
    tree = json.loads(json.dumps(config_tree))
    for dotted in UNTIMED_FIELDS:
        *parents, leaf = dotted.split(".")
        section = tree
        for key in parents:
            section = section.get(key, {}) if isinstance(section, dict) else {}
        if isinstance(section, dict):
            section.pop(leaf, None)
    return tree


def key_of(what: str, config_trees: list[dict]) -> str:
    payload = {"format": FORMAT, "what": what, "machine": machine(), "configs": [timed_fields(t) for t in config_trees]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def cached(what: str, config_trees: list[dict], measure: Callable[[], dict], reprofile: bool = False) -> dict:
    """`measure()`'s figures (a JSON-able dict) for `what` of these pipeline configs on this machine: read from the
    cache, or measured and written there (also when `reprofile`)."""
    directory = cache_dir()
    if directory is None:
        return measure()
    path = directory / f"{what}-{key_of(what, config_trees)}.json"
    if not reprofile and path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # a damaged entry is measured again
            pass
    figures = measure()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(figures))
        os.replace(partial, path)
    except OSError:  # a cache that cannot be written costs the next start-up a measurement, nothing else
        pass
    return figures
