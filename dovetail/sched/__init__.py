"""Scheduling policies by name. A policy class has `name`, `shape(spec, devices, trainer_devices, cost)`
(how it cuts each pipeline's step into nodes) and `decide(view, events)`."""

from dovetail.sched.areal import Areal
from dovetail.sched.colocated import Colocated
from dovetail.sched.digen import Digen, DigenTCSS
from dovetail.sched.disaggregated import Disaggregated
from dovetail.sched.jigsaw import Jigsaw, JigsawGreedy
from dovetail.sched.policy import Policy
from dovetail.sched.streamrl import StreamRL
from dovetail.sched.verl_sync import VerlSync

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (Colocated, Disaggregated, Digen, DigenTCSS, VerlSync, StreamRL, Areal, Jigsaw, JigsawGreedy)}


def policy_class(name: str) -> type[Policy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None
