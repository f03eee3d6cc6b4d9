"""What a pipeline's shape says of itself: the contract every kind's shape keeps (`graph.flow.FlowShape`,
`graph.lm.LMShape`), so a policy asks a shape what it needs to know instead of which kind it is (a new kind's shape
that does not answer cannot be made)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import Field
from typing import TYPE_CHECKING, Any, ClassVar

from dovetail.cost.model import CostModel
from dovetail.graph.node import Engines, Kind, Node

if TYPE_CHECKING:
    from dovetail.graph.spec import PipelineSpec


class Shape(ABC):
    """How a policy cuts one pipeline's steps into nodes: a frozen dataclass, so a shape is compared, stored
    (`dataclasses.asdict`, a run profile's) and varied (`dataclasses.replace`) by fields."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    trainer_devices: int
    """Devices of the trainer pool (every kind's shape has the field)."""

    @abstractmethod
    def build(self, spec: PipelineSpec, steps: int, cost: CostModel) -> list[Node]:
        """The nodes of `steps` consecutive steps of `spec`'s pipeline cut this way."""

    @abstractmethod
    def engines(self, spec: PipelineSpec, cost: CostModel) -> Engines:
        """The pipeline's engines on one device under this cut."""

    @abstractmethod
    def describe(self) -> str:
        """The cut in the scenario's own words: the fields a user would set to run it (`dovetail plan`'s rows)."""

    @property
    @abstractmethod
    def rollout_engines(self) -> int | None:
        """Rollout engines the step's samples are dealt to, each running its shard's chain of nodes on its own
        devices (an LM's `shards`: the pool over them is an engine's width); None where the rollout's pieces are
        independent and each may run on any one device (a flow step's generate fragments)."""

    @property
    @abstractmethod
    def rollout_kind(self) -> Kind:
        """The node kind doing the bulk of the rollout: what the interference table weighs it as beside other work."""

    @property
    @abstractmethod
    def tails_migrate(self) -> bool:
        """Whether the step's long tail of samples may leave its engine for another (an LM's `migrate_at`,
        `tail_parallel`, and `stream`: micro-batches trained in finishing order while the tail runs)."""

    @property
    @abstractmethod
    def sizes_rollout_memory(self) -> bool:
        """Whether the rollout engine takes the share of a device it is given (`rollout_memory`: an LM engine's KV
        cache fills it), so a policy keeping several engines on a device may size it; else its footprint is fixed
        (a flow model's weights) and its pieces' working memory comes on top."""
