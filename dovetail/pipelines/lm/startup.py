"""What a language-model run does before its first step: check that its model, tokenizer, prompts and the
rewards' dataset columns will do (the dry run's check too), profile its work in this process (the dry run's), and
fit the cost model to what a device measured.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.util import find_spec

import torch

from dovetail.cost.model import CostModel
from dovetail.graph.lm import trainable_params
from dovetail.graph.spec import LMSpec
from dovetail.models.causal_lm import causal_lm_config, causal_lm_parameter_counts
from dovetail.models.engine import engine_problem
from dovetail.models.memory import parameter_counts
from dovetail.pipelines.lm.config import ROLLOUT_PASS, STEP_PASS, LMTrainConfig
from dovetail.pipelines.lm.engines import ROLLOUT_KINDS, LMEngines
from dovetail.pipelines.lm.model import encode_prompts, load_policy, load_run_tokenizer, model_context
from dovetail.pipelines.lm.prompts import RunPrompts
from dovetail.plan.prepare import rollout_wake_s
from dovetail.plan.scenario import Scenario
from dovetail.rewards.text import columns_read, text_reward_fn
from dovetail.runtime.pipeline import with_train_priced


def fitted_cost(config: LMTrainConfig, scenario: Scenario, measured: dict) -> CostModel:
    """The analytic cost model with one correction per kind of work, fitted to a device's measured seconds; a kind
    profiled at two sizes (`lm_engines.SIZED_KINDS`: a few responses and the step's train pass; the rollout's kinds
    at a step's decode call too, where larger) gets a fixed cost per pass besides (`CostModel.from_measurements` per
    pass: the least-squares line through its sizes). A role switch is fitted too: the catalogue's switch
    moves the engine's whole memory budget (gigabytes for a GPU's KV cache), where a CPU core's engines stay resident
    and a switch is a round trip. A CPU core's figures are then priced as a run on those cores pays them
    (`CostModel.on_busy_cores`: the driver's and Ray's share of the cores, a Ray call per node)."""
    spec = scenario.pipelines[0]
    assert isinstance(spec, LMSpec), "an LM run's scenario (`LMTrainConfig.scenario`) is its one LM pipeline"
    analytic = CostModel(config.cluster.device)
    model = spec.catalogue_model()

    def sized(suffix: str) -> dict[str, float]:
        prompts, lengths = measured[f"prompt_tokens{suffix}"], measured[f"lengths{suffix}"]
        full = [p + n for p, n in zip(prompts, lengths)]
        return {
            "prefill": analytic.prefill(model, prompts),
            "decode": analytic.decode(model, prompts, lengths),
            "score": analytic.rule_score(len(prompts)),
            "logprob": analytic.logprob(model, full),
            "train": analytic.train(model, full),
        }

    predicted = sized("") | {
        "optimizer": analytic.optimizer_step(model.params),
        "publish": analytic.publish(model.params),
        "switch": rollout_wake_s(scenario, analytic),
    }
    if "sync" in measured:
        trained = trainable_params(spec) or model.params
        predicted["sync"] = analytic.replica_allreduce_seconds(trained, 1, measured["sync_devices"])
    step_pass = sized(STEP_PASS)
    measured = with_train_priced(with_train_priced(measured, predicted), step_pass, STEP_PASS)
    records = [
        (kind, predicted[kind], max(measured[kind], 1e-9))
        for kind in predicted
        if predicted[kind] > 0 and kind in measured
    ]
    records += [
        (kind, step_pass[kind], max(measured[f"{kind}{STEP_PASS}"], 1e-9)) for kind in step_pass if step_pass[kind] > 0
    ]
    if f"lengths{ROLLOUT_PASS}" in measured:  # the rollout's kinds timed at a step's decode call too: a third point
        rollout_pass = sized(ROLLOUT_PASS)
        records += [
            (kind, rollout_pass[kind], max(measured[f"{kind}{ROLLOUT_PASS}"], 1e-9))
            for kind in ROLLOUT_KINDS
            if rollout_pass[kind] > 0
        ]
    return CostModel.from_measurements(config.cluster.device, records, per_pass=True).on_busy_cores()


def check_checkpoint(config: LMTrainConfig) -> None:
    """What every run meets as it starts, whatever its policy (the dry run's check): the model loads (a user's: its
    config is a causal LM's, its weights are not read), its trainer (replicated or sharded) fits
    `cluster.device_memory_gb` (its parameters counted without its weights), its tokenizer loads, the dataset reads,
    the prompts it encodes (a dataset's every one; a task's first: the base evaluation's, the first step's) leave
    max_new_tokens in the model's context, the rewards' columns are the dataset's, and `sampling.engine=vllm` finds
    vLLM installed. A model our engine does not compute is said in one line on stderr: its rollouts run on
    transformers' own forward."""
    path = config.model.path
    if path is not None:  # its config and tokenizer: a large model's weights are the run's to load
        model_config, tokenizer = causal_lm_config(path), load_run_tokenizer(config)
        lora = None if config.model.lora is None else config.model.lora.model_dump()
        params, trained = causal_lm_parameter_counts(path, lora=lora, seed=config.seed)
    else:
        model, tokenizer = load_policy(config)
        model_config = model.config
        params, trained = parameter_counts(model)
    trainer_devices = config.runtime.trainer_devices or config.compute_devices
    config.cluster.check_trainer_fits(params, trained, config.model.lora, config.train, trainer_devices)
    prompts = RunPrompts(config)
    if config.env is None:  # an env run's prompts are its environment's first observations, fitted as it runs
        encode_prompts(config, tokenizer, prompts.all() or [*prompts.eval(), *prompts.step(0)], model_context(config))
    check_columns(config, prompts)
    if config.rollout_engine == "vllm" and find_spec("vllm") is None:
        raise ValueError(
            "sampling.engine=vllm: this environment has no vLLM (install it where the GPUs are; on CPU `make "
            "test-vllm` builds .venv-vllm with its CPU build), or set sampling.engine=dovetail"
        )
    problem = engine_problem(model_config, model_context(config))
    if config.user_model and config.rollout_engine == "dovetail" and problem is not None:
        print(
            f"note: {config.model.path}: our rollout engine does not compute {problem}; rollouts run on "
            "transformers' own forward (slower)",
            file=sys.stderr,
        )


def check_columns(config: LMTrainConfig, prompts: RunPrompts) -> None:
    """Every column a dataset run's reward reads (`columns_read`) is one of the dataset's: else one line naming the
    reward, the columns and the file, before any work."""
    if config.prompts is None:
        return
    columns = {name for row in prompts.all() for name in row.columns}
    for name in config.rewards:
        missing = columns_read(name, text_reward_fn(name, dataset=True)) - columns
        if missing:
            raise ValueError(
                f"reward {name!r} reads the column {', '.join(sorted(missing))}, which {config.prompts.path} has not "
                f"(its columns: {sorted(columns)}): add it, or set prompts.prompt_field to the prompt's column"
            )


def profile_here(config: LMTrainConfig, carry: Callable[[dict], dict]) -> dict:
    """The start-up profile in this process (the dry run's)."""
    return LMEngines(config, torch.device("cpu"), True, None).profile(config.runtime.profile_samples, carry)
