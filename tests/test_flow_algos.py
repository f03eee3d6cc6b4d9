"""The flow algorithms' options (docs/flow_algorithms.md), each against its upstream transcribed here on the same
tensors: GRPO-Guard's ratio normalisation (`algo.ratio_normalization`; X-GenGroup/Flow-Factory's GRPOGuardTrainer,
arXiv 2510.22319), MixGRPO's sliding SDE window (`algo.sde_window`; Tencent-Hunyuan/MixGRPO's GRPOTrainingStates)
and Flow-GRPO's EMA of the weights for evaluation (`eval.ema`; flow_grpo/ema.py's EMAModuleWrapper). Each trains a
short run of the built-in digits model under the reference loop."""

import json
import math

import pytest
import torch
from running import train
from safetensors.torch import load_file
from test_run_ux import undocumented
from typer.testing import CliRunner

from dovetail.algo import WeightEMA, flow_grpo_loss, sde_step, sliding_window
from dovetail.cli import app
from dovetail.config.common import DEFAULT_CHECKPOINT, ConfigError
from dovetail.config.load import load_config
from dovetail.graph.node import SampleId
from dovetail.pipelines.flow.config import flow_rules
from dovetail.pipelines.flow.recipe import sample_timesteps, sde_steps

DTYPE = torch.float64

# ------------------------------------------------------------------ upstream, transcribed


def guard_loss(log_prob, old_log_prob, advantages, prev_sample_mean, old_prev_sample_mean, dt, std_dev_t, clip):
    """Flow-Factory's GRPOGuardTrainer.optimize (src/flow_factory/trainers/grpo.py), its reweighted ratio and PPO
    loss with a symmetric clip range."""
    scale_factor = torch.sqrt(-dt) * std_dev_t
    mse = (prev_sample_mean - old_prev_sample_mean).flatten(1).pow(2).mean(dim=1)
    ratio = torch.exp((log_prob - old_log_prob) * scale_factor + mse / (2 * scale_factor))
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss)), ratio


class EMAModuleWrapper:
    """flow_grpo/ema.py's EMA (decay, update_step_interval), its `step` as train_sd3.py calls it with global_step."""

    def __init__(self, parameters, decay, update_step_interval):
        self.ema_parameters = [p.clone().detach() for p in parameters]
        self.decay, self.update_step_interval = decay, update_step_interval

    def get_current_decay(self, optimization_step):
        return min((1 + optimization_step) / (10 + optimization_step), self.decay)

    def step(self, parameters, optimization_step):
        one_minus_decay = 1 - self.get_current_decay(optimization_step)
        if (optimization_step + 1) % self.update_step_interval == 0:
            for ema_parameter, parameter in zip(self.ema_parameters, parameters):
                ema_parameter.add_(one_minus_decay * (parameter - ema_parameter))


class GRPOTrainingStates:
    """MixGRPO's fastvideo/utils/grpo_states.py, strategy "progressive" with prog_overlap and roll_back (as its
    finetune_flux_grpo_MixGRPO.sh runs it)."""

    def __init__(self, iters_per_group, group_size, max_timesteps, prog_overlap_step):
        self.iters_per_group, self.group_size, self.max_timesteps = iters_per_group, group_size, max_timesteps
        self.prog_overlap_step = prog_overlap_step
        self.cur_timestep = self.cur_iter_in_group = self.init_timestep = 0

    def update_iteration(self):
        self.cur_iter_in_group += 1
        if self.cur_iter_in_group >= self.iters_per_group:
            self.cur_iter_in_group = 0
            self.cur_timestep += self.prog_overlap_step
        if self.cur_timestep > self.max_timesteps:
            self.cur_timestep, self.cur_iter_in_group = self.init_timestep, 0


# ------------------------------------------------------------------ the formulas


def test_ratio_normalization_is_grpo_guards_ratio_and_its_log_is_the_unbiased_noise_projection():
    generator = torch.Generator().manual_seed(0)
    batch, shape = 6, (6, 2, 4, 4)
    x = torch.randn(shape, generator=generator, dtype=DTYPE)
    velocity, old_velocity = (torch.randn(shape, generator=generator, dtype=DTYPE) for _ in range(2))
    sigma = torch.tensor([0.9, 0.7, 0.5, 0.9, 0.3, 0.6], dtype=DTYPE)
    sigma_next = sigma - 0.15
    noise = torch.randn(shape, generator=generator, dtype=DTYPE)
    old = sde_step(old_velocity, x, sigma, sigma_next, noise_level=0.7, noise=noise)
    new = sde_step(velocity, x, sigma, sigma_next, noise_level=0.7, prev_latents=old.prev_latents)
    advantages = torch.randn(batch, generator=generator, dtype=DTYPE)
    dt = (sigma_next - sigma).view(-1)
    expected, ratio = guard_loss(new.log_prob, old.log_prob, advantages, new.mean, old.mean, dt, new.std_dev_t, 0.2)
    loss, stats = flow_grpo_loss(
        new.log_prob,
        old.log_prob,
        advantages,
        clip_range=0.2,
        mean=new.mean,
        ratio_normalization=True,
        old_mean=old.mean,
        total_std=new.std,
    )
    assert abs(loss.item() - expected.item()) <= 1e-6
    assert abs(stats["ratio_max"] - ratio.max().item()) <= 1e-6 and ratio.std() > 0.01  # the ratios differ from 1
    # the normalised log-ratio is mean((mean - old_mean) . eps): no -|d|^2 / (2 std^2) bias, no 1 / std scale
    projection = ((new.mean - old.mean) * noise).flatten(1).mean(dim=1)
    torch.testing.assert_close(torch.log(ratio), projection, atol=1e-10, rtol=0)
    plain, _ = flow_grpo_loss(new.log_prob, old.log_prob, advantages, clip_range=0.2)
    assert abs(plain.item() - expected.item()) > 1e-3  # the option changes the loss


def test_the_ema_is_flow_grpos_and_its_closed_form_over_a_few_steps():
    generator = torch.Generator().manual_seed(1)
    weights = [{"w": torch.randn(3, 2, generator=generator, dtype=DTYPE)} for _ in range(7)]  # theta_0 .. theta_6
    ours = WeightEMA(weights[0], decay=0.9, every=2)
    upstream = EMAModuleWrapper([weights[0]["w"]], decay=0.9, update_step_interval=2)
    for n in range(1, 7):
        ours.update(weights[n], n)
        upstream.step([weights[n]["w"]], n)
    torch.testing.assert_close(ours.shadow["w"], upstream.ema_parameters[0], atol=1e-12, rtol=0)
    # updates after steps 1, 3, 5 with d_n = min(0.9, (1 + n) / (10 + n)): 2/11, 4/13, 0.9 (6/15 < 0.9)
    d = {1: 2 / 11, 3: 4 / 13, 5: 6 / 15}
    closed = d[1] * d[3] * d[5] * weights[0]["w"]
    closed += (1 - d[1]) * d[3] * d[5] * weights[1]["w"] + (1 - d[3]) * d[5] * weights[3]["w"]
    closed += (1 - d[5]) * weights[5]["w"]
    torch.testing.assert_close(ours.shadow["w"], closed, atol=1e-12, rtol=0)


@pytest.mark.parametrize("num_steps, size, shift_every, stride", [(10, 3, 2, 1), (25, 4, 25, 1), (12, 2, 3, 2)])
def test_the_sliding_window_is_mixgrpos_window_at_every_step(num_steps, size, shift_every, stride):
    upstream = GRPOTrainingStates(shift_every, size, max_timesteps=num_steps - 1 - size, prog_overlap_step=stride)
    for step in range(4 * num_steps * shift_every):
        window = sliding_window(num_steps, size, shift_every, step, stride=stride)
        assert window == list(range(upstream.cur_timestep, upstream.cur_timestep + size))
        assert window[-1] <= num_steps - 2  # never the last step
        upstream.update_iteration()
    # by hand: K = 10, size 3, moving 1 every 2 steps, back to 0 after start 6 (steps 6..8)
    starts = [sliding_window(10, 3, 2, step)[0] for step in range(16)]
    assert starts == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 0, 0]
    in_range = [sliding_window(10, 2, 1, step, low=2, high=6) for step in range(4)]
    assert in_range == [[2, 3], [3, 4], [4, 5], [2, 3]]  # in window_range [2, 6): steps 2..5


def test_the_configs_sliding_window_samples_and_trains_the_window_and_the_odes_elsewhere():
    config = load_config(None, ["sampling.num_steps=8", "algo.sde_window.size=2", "algo.sde_window.shift_every=3"])
    assert config.algo.timesteps == "window" and flow_rules(config).trained_timesteps == 2
    for step in range(12):
        ids = [SampleId(step, 0, 0), SampleId(step, 1, 1)]
        expected = sliding_window(8, 2, 3, step)
        assert [sample_timesteps(config, s) for s in ids] == [expected, expected]
        assert sde_steps(config, ids) == [expected, expected]  # the SDE only there


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["algo.sde_window.size=2", "algo.sde_window.shift_every=2", "algo.timesteps=prefix"], "leave algo.timest"),
        (["algo.sde_window.size=2", "algo.sde_window.shift_every=2", "algo.compat=dance_grpo"], "per_sample_timest"),
        (["algo.ratio_normalization=true", "algorithm=dance_grpo"], "normalises the Flow-GRPO SDE's steps"),
        (["algo.ratio_normalization=true", "sampling.sde_kind=cps"], "normalises the Flow-GRPO SDE's steps"),
        (["algo.num_iterations=2", "algo.ratio_normalization=true"], "algo.num_iterations=2: one update a batch"),
        (["algo.num_iterations=2", "policy=digen+tcss"], r"algo.num_iterations=2: digen\+tcss trains stale samples"),
        (["algo.num_iterations=0"], "algo.num_iterations"),
        (["eval.ema.decay=1.5"], "eval.ema.decay"),
        (["eval.ema.every=0"], "eval.ema.every"),
    ],
)
def test_an_option_that_cannot_apply_is_one_line_naming_it(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(None, overrides)
    result = CliRunner().invoke(app, ["train", *overrides, "--dry-run"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output


# ------------------------------------------------------------------ short runs

SHORT = [
    "policy=reference",
    "algo.prompts_per_step=4",
    "algo.group_size=4",
    "sampling.num_steps=6",
    "eval.per_prompt=2",
    "eval.every=1",
    "checkpoint.every=1",
    "train.lr=3e-3",
]


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out, step: int) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / f"step_{step:06d}" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize(
    "option",
    [
        ["algo.ratio_normalization=true"],
        ["algo.sde_window.size=2", "algo.sde_window.shift_every=1"],
        ["eval.ema.decay=0.9", "eval.ema.every=1"],
    ],
    ids=["ratio_normalization", "sde_window", "ema"],
)
def test_a_short_run_with_each_option_trains_and_records_reward_and_eval(option, tmp_path):
    out = tmp_path / "run"
    train(load_config(None, [*SHORT, *option]), out, steps=2)
    lines = metrics(out)
    assert [line["step"] for line in lines if "reward/total" in line] == [1, 2]
    assert all(math.isfinite(line["eval_reward"]) for line in lines if "eval_reward" in line)
    base = load_file(DEFAULT_CHECKPOINT / "model.safetensors")
    assert max((weights(out, 2)[k] - base[k]).abs().max().item() for k in base) > 1e-4  # it trained
    if option[0].startswith("algo.sde_window"):
        assert [line["timesteps"] for line in lines if "timesteps" in line] == [[0, 1], [1, 2]]
    if option[0].startswith("eval.ema"):
        # every=1: updates after steps 1 and 2 with d_1 = 2/11, d_2 = 3/12, from the base weights
        ema = load_file(out / "checkpoints" / f"step_{2:06d}" / "ema.safetensors")
        first, second = weights(out, 1), weights(out, 2)
        for name, average in ema.items():
            after_one = base[name] + (1 - 2 / 11) * (first[name] - base[name])
            expected = after_one + (1 - 3 / 12) * (second[name] - after_one)
            torch.testing.assert_close(average, expected, atol=1e-6, rtol=0)
        assert any(not torch.equal(ema[k], second[k]) for k in ema)  # evaluated weights other than the trained ones


@pytest.mark.slow
def test_a_resumed_ema_run_averages_on_as_the_uninterrupted_one(tmp_path):
    ema = ["eval.ema.decay=0.9", "eval.ema.every=1"]
    train(load_config(None, [*SHORT, *ema]), tmp_path / "whole", steps=2)
    train(load_config(None, [*SHORT, *ema]), tmp_path / "part", steps=1)
    train(load_config(None, [*SHORT, *ema]), tmp_path / "part", steps=2, resume=tmp_path / "part")
    whole, resumed = (
        load_file(tmp_path / r / "checkpoints" / "step_000002" / "ema.safetensors") for r in ("whole", "part")
    )
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
def test_the_window_and_the_normalised_ratio_on_the_ray_runtime_reproduce_the_reference(tmp_path):
    """The sliding window and GRPO-Guard's ratio go through the code every policy runs (`recipe`): digen's
    fragments and timestep chunks end at the reference loop's parameters (<= 1e-5, as tests/test_compat.py's)."""
    common = [
        "algo.prompts_per_step=4", "sampling.num_steps=6", "algo.sde_window.size=2", "algo.sde_window.shift_every=1",
        "algo.ratio_normalization=true", "eval.every=100", "checkpoint.every=100", "cluster.devices=2",
    ]  # fmt: skip
    runs = {}
    for policy in (["policy=reference"], ["policy=digen", "runtime.fragments=2", "runtime.tsp_chunk=1"]):
        runs[policy[0]] = out = tmp_path / policy[0].partition("=")[2]
        train(load_config(None, common + policy), out, steps=2)
    reference, digen = (weights(out, 2) for out in runs.values())
    assert max((reference[k] - digen[k]).abs().max().item() for k in reference) <= 1e-5
    base = load_file(DEFAULT_CHECKPOINT / "model.safetensors")
    assert max((reference[k] - base[k]).abs().max().item() for k in reference) > 1e-4  # it did train


@pytest.mark.slow
@pytest.mark.exactness
@pytest.mark.usefixtures("local_ray")
def test_the_ema_on_the_ray_trainers_is_the_reference_loops_through_a_resume(tmp_path):
    """Under a Ray policy the trainers keep the EMA beside their weights (`pipelines.flow.ema`): colocated, and digen
    stopped after step 2 and resumed from its checkpoint, end at the reference loop's weights and EMA (<= 1e-5, the
    flow policies' bound), and evaluate the EMA as it does (the same eval reward at every step)."""
    common = [
        *SHORT[1:], "cluster.devices=2", "eval.ema.decay=0.9", "eval.ema.every=2", "eval.every=1", "checkpoint.every=1",
    ]  # fmt: skip
    runs = {name: tmp_path / name for name in ("reference", "colocated", "digen")}
    train(load_config(None, [*common, "policy=reference"]), runs["reference"], steps=3)
    train(load_config(None, [*common, "policy=colocated"]), runs["colocated"], steps=3)
    digen = [*common, "policy=digen", "runtime.fragments=2", "runtime.tsp_chunk=1"]
    train(load_config(None, digen), runs["digen"], steps=2)
    train(load_config(None, digen), runs["digen"], steps=3, resume=runs["digen"])

    def ema(out) -> dict[str, torch.Tensor]:
        return load_file(out / "checkpoints" / f"step_{3:06d}" / "ema.safetensors")

    expected, trained = ema(runs["reference"]), weights(runs["reference"], 3)
    assert max((expected[k] - trained[k]).abs().max().item() for k in expected) > 1e-5  # an average, not the weights
    evaluations = {name: [m["eval_reward"] for m in metrics(out) if "eval_reward" in m] for name, out in runs.items()}
    for name in ("colocated", "digen"):
        assert max((ema(runs[name])[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5, name
        assert max((weights(runs[name], 3)[k] - trained[k]).abs().max().item() for k in trained) <= 1e-5, name
        assert evaluations[name] == pytest.approx(evaluations["reference"], abs=1e-6), name


@pytest.mark.slow
@pytest.mark.exactness
@pytest.mark.usefixtures("local_ray")
def test_a_sharded_trainers_ema_is_the_reference_loops_through_a_resume(tmp_path):
    """train.sharding: fsdp on 2 devices (colocated): each member keeps the EMA of its own shards of the weights;
    joined, the run's EMA and weights end at the reference loop's (<= 1e-5, the sharded flow bound of
    tests/test_user_model.py), the EMA evaluated as the reference evaluates its own, and a resume from the step-2
    checkpoint ends at the run's EMA and weights to the bit."""
    common = [
        *SHORT[1:], "cluster.devices=2", "eval.ema.decay=0.9", "eval.ema.every=1", "eval.every=3", "checkpoint.every=1",
    ]  # fmt: skip
    sharded = [*common, "policy=colocated", "train.sharding=fsdp"]
    runs = {name: tmp_path / name for name in ("reference", "sharded", "resumed")}
    train(load_config(None, [*common, "policy=reference"]), runs["reference"], steps=3)
    train(load_config(None, sharded), runs["sharded"], steps=3)
    checkpoint = runs["sharded"] / "checkpoints" / f"step_{2:06d}"
    train(load_config(None, sharded), runs["resumed"], steps=3, resume=checkpoint)

    def ema(out) -> dict[str, torch.Tensor]:
        return load_file(out / "checkpoints" / f"step_{3:06d}" / "ema.safetensors")

    expected, trained = ema(runs["reference"]), weights(runs["reference"], 3)
    assert max((expected[k] - trained[k]).abs().max().item() for k in expected) > 1e-5  # an average, not the weights
    assert max((ema(runs["sharded"])[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5
    assert max((weights(runs["sharded"], 3)[k] - trained[k]).abs().max().item() for k in trained) <= 1e-5
    evaluations = {name: [m["eval_reward"] for m in metrics(out) if "eval_reward" in m] for name, out in runs.items()}
    assert evaluations["sharded"] and evaluations["sharded"] == pytest.approx(evaluations["reference"], abs=1e-5)
    resumed, whole = ema(runs["resumed"]), ema(runs["sharded"])
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    assert all(torch.equal(weights(runs["resumed"], 3)[k], weights(runs["sharded"], 3)[k]) for k in whole)
    at_two = load_file(checkpoint / "ema.safetensors")
    assert any(not torch.equal(whole[k], at_two[k]) for k in whole), "step 3 moved the average"


@pytest.mark.slow
@pytest.mark.exactness
@pytest.mark.usefixtures("local_ray")
def test_two_updates_a_batch_on_colocated_end_at_the_reference_loops_weights(tmp_path):
    """algo.num_iterations=2 (Flow-GRPO's num_inner_epochs): after the first update the batch trains again on the
    weights it left, its old log-probs still the rollout's, so the ratio moves from 1 and the clip acts. colocated,
    whose commit trains its devices' parts again, ends at the reference loop's weights (<= 1e-5) with its
    second-update figures, and the run is not the one-update run."""
    common = [
        "algo.prompts_per_step=4", "algo.group_size=4", "sampling.num_steps=6", "eval.per_prompt=2", "train.lr=3e-3",
        "eval.every=100", "checkpoint.every=100", "cluster.devices=2",
    ]  # fmt: skip
    runs = {
        "reference": [*common, "policy=reference", "algo.num_iterations=2"],
        "colocated": [*common, "policy=colocated", "algo.num_iterations=2"],
        "one": [*common, "policy=reference"],
    }
    for name, overrides in runs.items():
        train(load_config(None, overrides), tmp_path / name, steps=2)
    ends = {name: weights(tmp_path / name, 2) for name in runs}
    assert max((ends["colocated"][k] - ends["reference"][k]).abs().max().item() for k in ends["one"]) <= 1e-5
    assert max((ends["one"][k] - ends["reference"][k]).abs().max().item() for k in ends["one"]) > 1e-4
    lines = {name: metrics(tmp_path / name) for name in ("reference", "colocated")}
    for name, logged in lines.items():
        assert all(m["update_2/clip_frac"] > 0 and m["update_2/ratio_mean"] != 1.0 for m in logged), name
    assert undocumented({k for logged in lines.values() for m in logged for k in m}) == []
    assert [m["update_2/ratio_mean"] for m in lines["colocated"]] == pytest.approx(
        [m["update_2/ratio_mean"] for m in lines["reference"]], rel=1e-4
    )


def test_export_of_an_ema_run_writes_the_emas_weights_as_a_diffusers_directory_beside_the_trained_ones(
    sd3_pipeline_dir, tiny_prompts_file, tmp_path
):
    from diffusers import SD3Transformer2DModel
    from test_user_model import small

    out = tmp_path / "run"
    overrides = small(sd3_pipeline_dir, tiny_prompts_file, "policy=reference", "eval.ema.every=1")
    train(load_config(None, overrides), out, steps=1)
    exported = tmp_path / "export"
    result = CliRunner().invoke(app, ["export", str(out), str(exported)])
    assert result.exit_code == 0, result.output
    base = load_file(sd3_pipeline_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    trained = SD3Transformer2DModel.from_pretrained(exported / "transformer").state_dict()
    average = SD3Transformer2DModel.from_pretrained(exported / "ema" / "transformer").state_dict()
    assert max((trained[k] - base[k]).abs().max().item() for k in base) > 1e-4
    for name, weight in base.items():  # one update after step 1: d_1 = 2/11
        torch.testing.assert_close(average[name], weight + (1 - 2 / 11) * (trained[name] - weight), atol=1e-6, rtol=0)
