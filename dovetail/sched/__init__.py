"""Scheduling policies by name. The contract every policy keeps is `sched.policy.Policy`.

The registry is lazy: a name maps to where its class lives, imported on first use, so importing one policy (or
the package) never imports all of them."""

import dataclasses
from importlib import import_module

from pydantic import TypeAdapter

from dovetail.kinds import kind as pipeline_kind
from dovetail.sched.policy import Policy

POLICIES: dict[str, str] = {
    "colocated": "dovetail.sched.colocated:Colocated",
    "colocated-hsdp": "dovetail.sched.colocated:ColocatedHSDP",
    "disaggregated": "dovetail.sched.disaggregated:Disaggregated",
    "digen": "dovetail.sched.digen:Digen",
    "digen+tcss": "dovetail.sched.digen:DigenTCSS",
    "verl-sync": "dovetail.sched.verl_sync:VerlSync",
    "streamrl": "dovetail.sched.streamrl:StreamRL",
    "areal": "dovetail.sched.areal:Areal",
    "jigsaw": "dovetail.sched.jigsaw:Jigsaw",
    "jigsaw-greedy": "dovetail.sched.jigsaw:JigsawGreedy",
}
"""Policy name -> "module:Class"."""


def policy_class(name: str) -> type[Policy]:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}")
    module, _, attribute = POLICIES[name].partition(":")
    return getattr(import_module(module), attribute)


def shape_from_fields(kind: str, fields: dict):
    """A pipeline's shape from its fields (`dataclasses.asdict`, as a run profile stores it): an LM shape, or a flow
    shape — the search's own class when it stores a field that class adds to the kind's shape (digen's `DigenShape`:
    its TAG and TCSS choices; jigsaw's `SlicedLMShape` / `SlicedFlowShape`: the pipeline's sub-pool), else the
    kind's plain shape. Fields the shape lacks, or of the wrong type (a damaged profile), are a ValueError naming
    them (pydantic's ValidationError for a value)."""
    from dovetail.sched.digen_search import DigenShape
    from dovetail.sched.jigsaw import SlicedFlowShape, SlicedLMShape

    base = pipeline_kind(kind).load("shape")
    for richer in (DigenShape, SlicedLMShape, SlicedFlowShape):
        if issubclass(richer, base) and (_field_names(richer) - _field_names(base)) & set(fields):
            return from_fields(richer, fields)
    return from_fields(base, fields)


def _field_names(cls: type) -> set[str]:
    return {field.name for field in dataclasses.fields(cls)}


def from_fields(cls: type, fields: dict):
    """The dataclass `cls` of `fields`, each checked against its annotation."""
    unknown = sorted(set(fields) - _field_names(cls))
    if unknown:
        raise ValueError(f"{unknown[0]}: not a field of {cls.__name__}")
    return TypeAdapter(cls).validate_python(fields)
