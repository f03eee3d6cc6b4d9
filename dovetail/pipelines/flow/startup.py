"""What a flow run does before its first step: check that its model and prompts load (the dry run's check too),
profile its work in this process (the dry run's), and fit the cost model to what a device measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from dovetail.cost.calibration import DEFAULT
from dovetail.cost.catalog import diffusion_model
from dovetail.cost.model import CostModel
from dovetail.graph.spec import FlowSpec
from dovetail.models.diffusers_flow import (
    check_prompt_table,
    load_decoder,
    load_flow_model,
    transformer_parameter_counts,
)
from dovetail.models.memory import parameter_counts
from dovetail.pipelines.flow.config import FlowTrainConfig
from dovetail.pipelines.flow.engines import profile_work
from dovetail.pipelines.flow.recipe import sde_settings
from dovetail.plan.prepare import rollout_wake_s
from dovetail.plan.scenario import Scenario
from dovetail.prompts import prompt_split
from dovetail.runtime.pipeline import with_train_priced


def fitted_cost(config: FlowTrainConfig, scenario: Scenario, measured: dict[str, float]) -> CostModel:
    """The analytic cost model fitted to a device's measured seconds: the small-pass half point from the fastest
    generation at two batch sizes, then one correction per kind of work (`CostModel.from_measurements`). A guided
    run's profile measured guided passes, so the analytic side prices them guided too (else the correction would
    carry the doubling and the graph would double it again). A CPU core's figures are then priced as a run on those
    cores pays them (`CostModel.on_busy_cores`)."""
    samples = config.runtime.profile_samples
    spec = scenario.pipelines[0]
    assert isinstance(spec, FlowSpec), "a flow run's scenario (`FlowTrainConfig.scenario`) is its one flow pipeline"
    model = diffusion_model(spec.model)
    tokens = model.latent_tokens(spec.height, spec.width, spec.frames)
    small = max(1, samples // 4)
    held = tokens * (2 if spec.cfg else 1)  # a sample's tokens in one pass: a guided pass holds both branches
    ratio = measured["generate_fastest"] / measured["generate_small_fastest"]
    half = held * (samples - ratio * small) / (ratio - 1) if ratio > 1 else DEFAULT.dit_half_mfu_tokens
    calibration = replace(DEFAULT, dit_half_mfu_tokens=max(half, 0.0))

    analytic = CostModel(config.cluster.device, calibration)
    predicted = {
        "generate": analytic.generate(
            model, samples, spec.height, spec.width, spec.denoising_steps, spec.frames, spec.cfg
        ),
        "score": analytic.rule_score(samples),
        "logprob": analytic.dit_logprob(model, samples, 1, tokens, spec.cfg),
        "train": analytic.dit_train(model, samples, 1, tokens, spec.cfg),
        "optimizer": analytic.optimizer_step(model.params),
        "publish": analytic.publish(model.params),
        "switch": rollout_wake_s(scenario, analytic),
    }
    measured = with_train_priced(measured, predicted)
    records = [(kind, predicted[kind], max(measured[kind], 1e-9)) for kind in predicted if kind in measured]
    return CostModel.from_measurements(config.cluster.device, records, calibration).on_busy_cores()


def check_checkpoint(config: FlowTrainConfig) -> None:
    """What every run meets as it starts, whatever its policy (the dry run's check): the built-in model loads, as
    the run loads it (a truncated or foreign file fails here), its trainer (replicated or sharded) fits
    `cluster.device_memory_gb` (a diffusers transformer counted from its config), and the prompts split. A diffusers
    directory's layout the config has checked, and its prompt table is checked here; its model is not loaded (a dry
    run plans a GPU cluster from a laptop)."""
    if config.model.path is None:
        params, trained = parameter_counts(load_flow_model(config))
    else:
        lora = None if config.model.lora is None else config.model.lora.model_dump()
        params, trained = transformer_parameter_counts(config.model.path, lora=lora, seed=config.seed)
    trainer_devices = config.runtime.trainer_devices or config.compute_devices
    config.cluster.check_trainer_fits(params, trained, config.model.lora, config.train, trainer_devices)
    prompt_split(config)
    if config.model.path is not None:
        check_prompt_table(config)


def profile_here(config: FlowTrainConfig, carry: Callable[[dict], dict]) -> dict[str, float]:
    """The start-up profile in this process (the dry run's), on the checkpoint's model."""
    model = load_flow_model(config)
    samples = config.runtime.profile_samples
    return profile_work(model, load_decoder(config), config, sde_settings(config), samples, carry)
