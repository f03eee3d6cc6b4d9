"""DiffusionNFT (algorithm diffusion_nft, docs/flow_algorithms.md): its loss and old-policy schedule against
NVlabs/DiffusionNFT's scripts/train_nft_sd3.py transcribed here on the same tensors, and short runs of the built-in
digits model: the reference loop trains and evaluates, and colocated ends at its parameters."""

import json
import math

import pytest
import torch
from running import train
from safetensors.torch import load_file
from test_run_ux import undocumented
from typer.testing import CliRunner

from dovetail.algo import diffusion_nft_loss, forward_timesteps, noised, old_policy_decay, soft_update
from dovetail.cli import app
from dovetail.config.common import DEFAULT_CHECKPOINT, ConfigError
from dovetail.config.load import load_config
from dovetail.graph.node import SampleId
from dovetail.pipelines.flow.config import flow_rules
from dovetail.pipelines.flow.recipe import sample_timesteps, sde_steps

pytestmark = pytest.mark.slow

DTYPE = torch.float64

# ------------------------------------------------------------------ upstream, transcribed


def upstream_nft_loss(forward_prediction, old_prediction, x0, noise, t, advantages, beta, adv_clip_max):
    """train_nft_sd3.py's policy loss of one micro-batch at one timestep (adv_mode "all", no KL)."""
    t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
    xt = (1 - t_expanded) * x0 + t_expanded * noise
    advantages_clip = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    normalized_advantages_clip = (advantages_clip / adv_clip_max) / 2.0 + 0.5
    r = torch.clamp(normalized_advantages_clip, 0, 1)
    positive_prediction = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    implicit_negative_prediction = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction
    x0_prediction = xt - t_expanded * positive_prediction
    with torch.no_grad():
        weight_factor = (
            torch.abs(x0_prediction.double() - x0.double()).mean(dim=tuple(range(1, x0.ndim)), keepdim=True).clip(1e-5)
        )
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    with torch.no_grad():
        negative_weight_factor = (
            torch.abs(negative_x0_prediction.double() - x0.double())
            .mean(dim=tuple(range(1, x0.ndim)), keepdim=True)
            .clip(min=0.00001)
        )
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    return (ori_policy_loss * adv_clip_max).mean()


def return_decay(step, decay_type):
    """train_nft_sd3.py's old-policy decay."""
    if decay_type == 0:
        flat, uprate, uphold = 0, 0.0, 0.0
    elif decay_type == 1:
        flat, uprate, uphold = 0, 0.001, 0.5
    else:
        flat, uprate, uphold = 75, 0.0075, 0.999
    if step < flat:
        return 0.0
    return min((step - flat) * uprate, uphold)


# ------------------------------------------------------------------ the formulas


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_the_loss_and_its_gradient_are_diffusion_nfts(beta):
    generator = torch.Generator().manual_seed(0)
    shape = (6, 2, 4, 4)
    x0, noise, old = (torch.randn(shape, generator=generator, dtype=DTYPE) for _ in range(3))
    velocity = torch.randn(shape, generator=generator, dtype=DTYPE, requires_grad=True)
    t = torch.tensor([1.0, 0.9, 0.7, 0.5, 0.3, 0.1], dtype=DTYPE)
    advantages = torch.tensor([-7.0, -2.0, 0.0, 0.5, 3.0, 6.0], dtype=DTYPE)  # beyond the clip at both ends
    expected = upstream_nft_loss(velocity, old, x0, noise, t, advantages, beta, 5.0)
    (expected_grad,) = torch.autograd.grad(expected, velocity)
    loss, stats = diffusion_nft_loss(velocity, old, x0, noised(x0, noise, t), t, advantages, beta=beta, adv_clip=5.0)
    (grad,) = torch.autograd.grad(loss, velocity)
    assert abs(loss.item() - expected.item()) <= 1e-6 * max(1.0, abs(expected.item()))
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=0)
    assert stats["optimality_mean"] == pytest.approx(((advantages.clamp(-5, 5) / 5 / 2 + 0.5).mean()).item())
    # with v_theta = v_old both implicit policies are the old one: L+- = t |v_old - (eps - x0)|^2 / mean|...|, any r
    same, _ = diffusion_nft_loss(old, old, x0, noised(x0, noise, t), t, advantages, beta=beta, adv_clip=5.0)
    error = old - (noise - x0)
    closed = t * (error**2).mean(dim=(1, 2, 3)) / (error.abs().mean(dim=(1, 2, 3)))
    assert same.item() == pytest.approx((5.0 * closed / beta).mean().item(), abs=1e-9)


def test_a_positive_sample_pulls_the_velocity_to_its_target_and_a_negative_one_away():
    """The gradient at v_theta = v_old: r = 1 moves v_theta towards eps - x0, r = 0 away from it."""
    generator = torch.Generator().manual_seed(1)
    shape = (2, 1, 4, 4)
    x0, noise, old = (torch.randn(shape, generator=generator, dtype=DTYPE) for _ in range(3))
    t = torch.tensor([0.6, 0.6], dtype=DTYPE)
    target = noise - x0
    for advantage, sign in ((5.0, 1.0), (-5.0, -1.0)):
        velocity = old.clone().requires_grad_(True)
        loss, _ = diffusion_nft_loss(
            velocity, old, x0, noised(x0, noise, t), t, torch.full((2,), advantage, dtype=DTYPE), beta=1.0, adv_clip=5
        )
        (grad,) = torch.autograd.grad(loss, velocity)
        towards_target = (-grad * (target - old)).sum().item()
        assert sign * towards_target > 0


def test_the_old_policys_decay_is_upstreams_for_its_three_schedules():
    schedules = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}
    for decay_type, (flat, rate, ceiling) in schedules.items():
        for step in (0, 1, 2, 74, 75, 76, 100, 499, 500, 501, 1000, 10_000):
            ours = old_policy_decay(step, flat=flat, rate=rate, ceiling=ceiling)
            assert ours == return_decay(step, decay_type), (decay_type, step)
    old, new = {"w": torch.ones(3, dtype=DTYPE)}, {"w": torch.full((3,), 3.0, dtype=DTYPE)}
    soft_update(old, new, 0.25)
    torch.testing.assert_close(old["w"], torch.full((3,), 0.25 + 0.75 * 3.0, dtype=DTYPE))


def test_the_config_trains_its_own_random_timesteps_of_all_k_and_samples_by_the_ode():
    config = load_config(None, ["algorithm=diffusion_nft", "sampling.num_steps=10"])
    assert (config.algo.timestep_fraction, config.algo.timestep_rounding, config.algo.timestep_pool) == (
        0.99,
        "floor",
        "all",
    )
    assert flow_rules(config).trained_timesteps == 9  # int(10 * 0.99), as upstream
    ids = [SampleId(3, p, m) for p in range(4) for m in range(4)]
    drawn = [sample_timesteps(config, s) for s in ids]
    assert all(len(row) == 9 and len(set(row)) == 9 and set(row) <= set(range(10)) for row in drawn)
    assert len({tuple(row) for row in drawn}) > 1  # each sample its own
    assert 9 in {k for row in drawn for k in row}  # the last step (sigma_9 > 0) trains too
    assert sample_timesteps(config, ids[5]) == drawn[5]  # keyed by identity
    assert sde_steps(config, ids) == [[]] * len(ids)  # no stochastic step: the ODE
    with pytest.raises(ValueError, match="count=0"):
        forward_timesteps(10, 0, torch.Generator())


@pytest.mark.parametrize(
    "override",
    ["algo.num_iterations=2", "algo.ratio_normalization=true", "algo.timesteps=prefix"],
)
def test_what_diffusion_nft_cannot_take_is_refused_in_one_line(override):
    with pytest.raises(ConfigError, match="algorithm diffusion_nft"):
        load_config(None, ["algorithm=diffusion_nft", override])
    result = CliRunner().invoke(app, ["train", "algorithm=diffusion_nft", override, "--dry-run"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output


# ------------------------------------------------------------------ short runs

NFT = [
    "algorithm=diffusion_nft",
    "algo.prompts_per_step=4",
    "algo.group_size=4",
    "sampling.num_steps=6",
    "algo.timestep_fraction=0.34",  # 2 of the 6 steps a sample
    "eval.per_prompt=2",
    "train.lr=3e-3",
]


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out, step: int, name: str = "model") -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / f"step_{step:06d}" / f"{name}.safetensors")


def test_a_short_run_trains_and_moves_the_old_policy_by_its_schedule(tmp_path):
    """Two steps with algo.nft.decay_rate 0.25 (decay_max 0.5): the old policy starts at the base weights and after
    step n takes decay d_n = min(0.25 n, 0.5): old_1 = 0.25 base + 0.75 theta_1, old_2 = 0.5 old_1 + 0.5 theta_2."""
    out = tmp_path / "run"
    overrides = [*NFT, "policy=reference", "eval.every=1", "checkpoint.every=1", "algo.nft.decay_rate=0.25"]
    train(load_config(None, overrides), out, steps=2)
    lines = metrics(out)
    assert [line["step"] for line in lines if "reward/total" in line] == [1, 2]
    assert all(math.isfinite(line["eval_reward"]) for line in lines if "eval_reward" in line)
    assert all(0 < line["optimality_mean"] < 1 and math.isfinite(line["loss"]) for line in lines if "loss" in line)
    assert undocumented({k for line in lines for k in line}) == []
    base = load_file(DEFAULT_CHECKPOINT / "model.safetensors")
    first, second = weights(out, 1), weights(out, 2)
    assert max((second[k] - base[k]).abs().max().item() for k in base) > 1e-4  # it trained
    old = weights(out, 2, "old_policy")
    for name in base:
        old_1 = 0.25 * base[name] + 0.75 * first[name]
        torch.testing.assert_close(old[name], 0.5 * old_1 + 0.5 * second[name], atol=1e-6, rtol=0)


def test_a_resumed_run_samples_with_the_checkpoints_old_policy_as_the_uninterrupted_one(tmp_path):
    overrides = [*NFT, "policy=reference", "eval.every=100", "checkpoint.every=1", "algo.nft.decay_rate=0.25"]
    train(load_config(None, overrides), tmp_path / "whole", steps=2)
    train(load_config(None, overrides), tmp_path / "part", steps=1)
    train(load_config(None, overrides), tmp_path / "part", steps=2, resume=tmp_path / "part")
    for name in ("model", "old_policy"):
        whole, resumed = weights(tmp_path / "whole", 2, name), weights(tmp_path / "part", 2, name)
        assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole), name


@pytest.mark.exactness
@pytest.mark.usefixtures("local_ray")
def test_colocated_and_digen_end_at_the_reference_loops_weights_and_old_policy(tmp_path):
    """The old policy samples and gives v_old on every trainer replica and is what they publish; the fresh noise and
    timesteps are keyed by the sample: colocated, and digen with fragments and one-timestep chunks, end at the
    reference loop's weights and old policy (<= 1e-5, the flow policies' bound). At lr 1e-3: AdamW's first step
    moves a weight by lr g / (|g| + 1e-8), and a few of NFT's gradient elements are ~1e-8, where the policies'
    summation orders differ by a few percent: at lr 3e-3 that is 1.9e-5 (measured), at 1e-3 6e-6, the same from the
    first step to the third (no drift)."""
    common = [
        *NFT, "train.lr=1e-3", "cluster.devices=2", "eval.every=100", "checkpoint.every=1", "algo.nft.decay_rate=0.25",
    ]  # fmt: skip
    policies = {
        "reference": ["policy=reference"],
        "colocated": ["policy=colocated"],
        "digen": ["policy=digen", "runtime.fragments=2", "runtime.tsp_chunk=1"],  # fragments, one timestep a chunk
    }
    runs = {name: tmp_path / name for name in policies}
    for name, out in runs.items():
        train(load_config(None, [*common, *policies[name]]), out, steps=3)
    base = load_file(DEFAULT_CHECKPOINT / "model.safetensors")
    expected, old = weights(runs["reference"], 3), weights(runs["reference"], 3, "old_policy")
    assert max((expected[k] - base[k]).abs().max().item() for k in base) > 1e-4
    assert max((expected[k] - old[k]).abs().max().item() for k in base) > 1e-5  # the old policy lags
    logged = {name: [m for m in metrics(out) if "loss" in m] for name, out in runs.items()}
    for name in ("colocated", "digen"):
        got, got_old = weights(runs[name], 3), weights(runs[name], 3, "old_policy")
        assert max((got[k] - expected[k]).abs().max().item() for k in base) <= 1e-5, name
        assert max((got_old[k] - old[k]).abs().max().item() for k in base) <= 1e-5, name
        assert undocumented({k for m in logged[name] for k in m}) == []
        assert [m["optimality_mean"] for m in logged[name]] == pytest.approx(
            [m["optimality_mean"] for m in logged["reference"]], abs=1e-6
        ), name
