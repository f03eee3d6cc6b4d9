"""Pipeline kinds, registered in one place: what makes a flow pipeline different from a language-model one.

A kind is named once, here, under one spelling (`flow`, `lm`), and everything that differs by kind is found from
its record: the run config's schema, the planner's pipeline spec, the Ray runtime's adapter and engines, how a
device is profiled and the cost model fitted to it, which node kinds the interference table measures, the
reference loop, and which node kinds create samples. Adding a kind means a record here and the modules it names.

The registry is lazy, like `sched.POLICIES`: each part is a "module:attribute" path imported on first use, so
importing this module imports nothing else, and each layer asks only for the parts at or below it (the planner
never resolves the runtime's parts, so it never imports torch)."""

from dataclasses import dataclass
from importlib import import_module


@dataclass(frozen=True)
class PipelineKind:
    name: str
    """The kind's one spelling: a config's and a scenario's `kind:`, a policy's `pipeline_kinds`."""
    config: str
    """The run config's schema (a `config.common.RunSection`)."""
    spec: str
    """The planner's pipeline spec (a `graph.spec.PipelineSpec`)."""
    shape: str
    """How a policy cuts the kind's steps (a `sched.policy.Shape` dataclass: a run profile stores its fields)."""
    adapter: str
    """The driver side of the runtime (an `runtime.pipeline.PipelineAdapter`)."""
    engines: str
    """The worker side of the runtime (an `runtime.pipeline.PipelineEngines`)."""
    profile: str
    """`profile_here(config, carry) -> measured seconds`: the start-up profile's work run in this process (the
    dry run's; the Ray runtime profiles through the engines' `profile`)."""
    fit: str
    """`fitted_cost(config, scenario, measured) -> CostModel`: the cost model corrected by what was measured."""
    check_checkpoint: str
    """`check_checkpoint(config)`: the run's checkpoint and model loadable, or one line saying what is wrong."""
    local: str
    """The reference loop's model, engines and step in one process (`runner.StepLog` drives it)."""
    export: str
    """`exporter(config) -> write(checkpoint, out)`: how a run's checkpoint is written as its model library's own
    directory (`dovetail export`), after the checks a resume makes; a run that cannot export, and what will not do,
    is a ValueError, one line."""
    interference: tuple[str, ...]
    """Node kinds (`graph.node.Kind` values) of this pipeline whose slowdown beside other pipelines' work a
    multiplexed run measures (`runtime.interference`)."""
    creates_samples: tuple[str, ...]
    """Node kinds that create the step's samples (the ledger's `generated`)."""
    staged_baseline: str
    """The stage-after-stage policy the planner simulates for a `reference` run of this kind, which schedules
    nothing itself."""
    environments: str = ""
    """The off-device side of a kind whose steps wait on environments (`graph.node.Kind.ENV`): built from the run
    config in an actor of no device (`runtime.worker.EnvironmentWorker`), it does what the adapter's `wait_work` and
    `RunContext.off_device` ask; empty for a kind that never waits."""

    def load(self, part: str):
        """The object a part's "module:attribute" path names, imported now."""
        module, _, attribute = getattr(self, part).partition(":")
        return getattr(import_module(module), attribute)


KINDS: dict[str, PipelineKind] = {
    kind.name: kind
    for kind in (
        PipelineKind(
            name="flow",
            config="dovetail.pipelines.flow.config:FlowTrainConfig",
            spec="dovetail.graph.spec:FlowSpec",
            shape="dovetail.graph.flow:FlowShape",
            adapter="dovetail.pipelines.flow.adapter:FlowAdapter",
            engines="dovetail.pipelines.flow.engines:FlowEngines",
            profile="dovetail.pipelines.flow.startup:profile_here",
            fit="dovetail.pipelines.flow.startup:fitted_cost",
            check_checkpoint="dovetail.pipelines.flow.startup:check_checkpoint",
            local="dovetail.pipelines.flow.local:FlowLocal",
            export="dovetail.pipelines.flow.export:flow_exporter",
            interference=("generate", "train"),
            creates_samples=("generate",),
            staged_baseline="colocated",
        ),
        PipelineKind(
            name="lm",
            config="dovetail.pipelines.lm.config:LMTrainConfig",
            spec="dovetail.graph.spec:LMSpec",
            shape="dovetail.graph.lm:LMShape",
            adapter="dovetail.pipelines.lm.adapter:LMAdapter",
            engines="dovetail.pipelines.lm.engines:LMEngines",
            profile="dovetail.pipelines.lm.startup:profile_here",
            fit="dovetail.pipelines.lm.startup:fitted_cost",
            check_checkpoint="dovetail.pipelines.lm.startup:check_checkpoint",
            local="dovetail.pipelines.lm.local:LMLocal",
            export="dovetail.pipelines.lm.export:lm_exporter",
            interference=("decode", "logprob", "train"),
            creates_samples=("prefill",),
            staged_baseline="verl-sync",
            environments="dovetail.pipelines.lm.multiturn:Episodes",
        ),
    )
}
"""Kind name -> its record."""

DEFAULT_KIND = "flow"
"""The kind of a config or scenario pipeline that names none."""


def kind(name: str) -> PipelineKind:
    if name not in KINDS:
        raise ValueError(f"kind: {name!r} is not a pipeline kind; use one of {', '.join(KINDS)}")
    return KINDS[name]
