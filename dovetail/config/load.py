"""Reading a run config: a YAML file, dotted overrides (`section.field=value`), the schema of its `kind`, every
problem one line naming the field or file; and the checks of the machine a run starts on."""

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dovetail.config.common import ConfigError, invalid, ray_address
from dovetail.config.multiplex import MultiplexConfig, TrainConfig, multiplexed_tree
from dovetail.cost.catalog import device
from dovetail.kinds import DEFAULT_KIND, KINDS
from dovetail.plan.scenario import clip, parse_yaml, problem_lines, read_yaml


def apply_override(tree: dict[str, Any], override: str) -> None:
    shown = clip(repr(override))
    dotted, equals, raw = override.partition("=")
    path = dotted.strip().split(".")
    if not equals or not all(path):
        raise ConfigError(f"override {shown} must look like section.field=value, e.g. train.lr=1e-4")
    *parents, leaf = path
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {shown}: {clip(repr(key))} is a value, not a section")
    try:
        node[leaf] = parse_yaml(raw, f"override {shown}")
    except ValueError as error:
        raise ConfigError(str(error)) from None


def load_config(path: Path | str | None = None, overrides: Sequence[str] = (), *, rewards: bool = True) -> TrainConfig:
    """The run config of a YAML file (None, or an empty file: the defaults) with dotted overrides applied; `rewards`
    as `parse_config`'s. A reward module beside the file or in the working directory imports (`import_dirs_of`)."""
    tree = read_config_tree(None if path is None else Path(path))
    for override in overrides:
        apply_override(tree, override)
    if path is not None:
        import_dirs_of(tree, Path(path))
    return parse_config(tree, rewards=rewards)


def read_config_tree(path: Path | None) -> dict[str, Any]:
    """A config file's tree of sections (None, or an empty file: no section, the defaults), unvalidated."""
    if path is None:
        return {}
    try:
        tree = read_yaml(path)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: a config is a mapping of sections (algo:, train: ...), got {type(tree).__name__}")
    return tree


def import_dirs_of(tree: dict, config: Path) -> None:
    """A reward module beside the config file, or in the working directory, imports with no PYTHONPATH set, as
    `python train.py` finds a module beside train.py: each pipeline's `import_dirs`, where the file sets none, are
    those two directories (the config records them, so that every Ray worker and a resumed run look there too)."""
    directories = list(dict.fromkeys([str(config.resolve().parent), str(Path.cwd())]))
    entries = tree.get("pipelines") if tree.get("kind") == "multiplex" else [tree]
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict):
            entry.setdefault("import_dirs", directories)


def parse_config(tree: Any, *, rewards: bool = True) -> TrainConfig:
    """A config tree (YAML's, or `model_dump(mode="json")`'s) as the run config of its `kind`. `rewards=False`: its
    rewards are not looked up, so a custom one's module is not imported; for a run directory's config read to replay
    or export what it trained (neither scores anything), which thereby runs none of its writer's code."""
    if not isinstance(tree, dict):
        raise invalid(f"a config is a mapping of sections, got {type(tree).__name__}")
    kinds = {name: kind.load("config") for name, kind in KINDS.items()} | {"multiplex": MultiplexConfig}
    kind = tree.get("kind", DEFAULT_KIND)
    if not isinstance(kind, str) or kind not in kinds:
        raise invalid(f"kind: {clip(repr(kind))} is not a run kind; use one of {sorted(kinds)}")
    if kind == "multiplex":
        tree = multiplexed_tree(tree)
    try:
        return kinds[kind].model_validate(tree, context={"rewards": rewards})
    except ValidationError as error:
        raise invalid(*problem_lines(error, hidden=tuple(KINDS))) from None


def dump_config(config: TrainConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def check_this_machine(config: TrainConfig) -> None:
    """A local run (no cluster.address, no RAY_ADDRESS) of the Ray runtime has this machine's devices: as many CPU
    cores as this process may use (taskset / cgroups narrow them; device i is pinned to the i-th), or its CUDA GPUs.
    Checked when a run starts, never when a config is parsed: a dry run plans a GPU cluster from a laptop. Policy
    reference trains in this process and needs no cluster."""
    cluster = config.cluster
    if config.policy == "reference" or ray_address(cluster) is not None:
        return
    platform = device(cluster.device).platform
    if platform == "cpu":
        # os.cpu_count() is None where the count cannot be told: the process runs on one core at least
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if cluster.devices > cores:
            raise ConfigError(
                f"cluster.devices={cluster.devices}: this machine has {cores} CPU cores for a local run; lower "
                "cluster.devices, or give cluster.address of a Ray cluster"
            )
    elif platform == "cuda":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if cluster.devices > gpus:
            raise ConfigError(
                f"cluster.device={cluster.device}: {cluster.devices} GPUs asked for, this machine has {gpus} for "
                "a local run; set cluster.device=cpu-core, lower cluster.devices, or give cluster.address of a Ray "
                "cluster"
            )
