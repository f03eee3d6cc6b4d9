"""Planner scenarios for the simulator tests, built from a few keyword overrides: one flow or language-model
pipeline's fields (`flow_pipeline`, `lm_pipeline`) and a scenario around them (`scenario`). A test file writes down
only what its tests depend on."""

from dovetail.plan.scenario import Scenario, load_scenario, parse_scenario

FLOW = {
    "kind": "flow",
    "name": "p",
    "model": "SD3.5-M",
    "prompts": 8,
    "group": 4,
    "denoising_steps": 10,
    "trained_timesteps": 3,
    "height": 512,
    "width": 512,
}
"""A text-to-image pipeline of SD3.5-M at 512x512: 8 prompts of 4 samples, 3 of 10 denoising steps trained."""

LM = load_scenario("jigsaw-qwen3-0.6b-16xh100").pipelines[0].model_dump(mode="python", exclude_none=True)
"""A language-model pipeline of Qwen3-0.6B: 32 prompts of 4 responses, lognormal lengths up to 4096 tokens (the shipped
jigsaw-qwen3-0.6b-16xh100's, which benchmarks/planner_figures.py's many-pipelines table copies too)."""


def flow_pipeline(**changes) -> dict:
    """FLOW with `changes` (any flow pipeline field)."""
    return {**FLOW, **changes}


def lm_pipeline(**changes) -> dict:
    """LM with `changes` (any language-model pipeline field)."""
    return {**LM, **changes}


def scenario(
    *pipelines: dict,
    name: str = "small",
    device: str = "H100",
    devices: int = 4,
    steps: int = 1,
    policies=("colocated",),
    **schedule,
) -> Scenario:
    """A scenario of `pipelines` (FLOW alone when none) on `devices` of `device`, its schedule `steps` of `policies`
    and any other schedule field in `schedule`. Read as a scenario file is (`parse_scenario`): a value the planner
    refuses raises a ValueError of one line naming the field."""
    return parse_scenario(
        {
            "name": name,
            "cluster": {"device": device, "devices": devices},
            "pipelines": list(pipelines) or [flow_pipeline()],
            "schedule": {"steps": steps, "policies": list(policies), **schedule},
        }
    )
