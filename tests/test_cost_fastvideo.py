"""fastvideo's FSDP (DanceGRPO, MixGRPO: fp32 parameters all-gathered per layer, every forward under bf16 autocast, one
image per pass) against the closed form of `CostModel.fsdp_pass_seconds`, and verl's bf16 FSDP passes unchanged by
it. Sources: `Calibration.fastvideo_exposed_fraction`."""

import math

import pytest

from dovetail.cost.catalog import diffusion_model
from dovetail.cost.model import BF16, FP32, CostModel

FLUX = diffusion_model("FLUX.1-12B")


def cast_seconds(cost: CostModel, casts: int) -> float:
    """Autocast's casts of every gathered fp32 weight to bf16: 4 bytes read and 2 written per parameter per forward."""
    bandwidth = cost.device.memory_bandwidth * cost.calibration.optimizer_bandwidth_efficiency
    return casts * FLUX.params * 6 / bandwidth


@pytest.mark.parametrize(("compute", "transfer"), [(0.1, 0.3), (0.5, 0.2), (0.25, 0.25)])
def test_bf16_passes_take_the_longer_of_compute_and_transfer(compute, transfer):
    assert CostModel("H100").fsdp_pass_seconds(FLUX, compute, transfer, BF16, casts=2) == max(compute, transfer)


@pytest.mark.parametrize(("compute", "transfer", "casts"), [(0.1, 0.3, 1), (0.5, 0.2, 2), (0.0, 0.4, 25)])
def test_fp32_passes_cast_the_weights_and_expose_part_of_the_shorter(compute, transfer, casts):
    cost = CostModel("H800")
    exposed = cost.calibration.fastvideo_exposed_fraction
    busy = compute + cast_seconds(cost, casts)
    expected = max(busy, transfer) + exposed * min(busy, transfer)
    assert cost.fsdp_pass_seconds(FLUX, compute, transfer, FP32, casts) == pytest.approx(expected, rel=1e-12)


def test_the_sampling_trainer_pays_per_forward():
    """DanceGRPO's sampling of one 720x720 image in 25 steps on a 32-GPU FULL_SHARD group: each forward is the
    fp32 all-gather of every layer, the forward's compute with its cast, the exposed fraction of the shorter;
    verl's bf16 gathers take half the bytes and no cast."""
    cost = CostModel("H800")
    tokens = FLUX.latent_tokens(720, 720, 1)
    compute = cost.compute_seconds(
        cost.dit_forward_flops(FLUX, tokens), cost.pass_mfu(cost.calibration.dit_inference_mfu, tokens)
    )
    gather = cost.collective_seconds(FLUX.params * FP32, 32, FLUX.layers)
    busy = compute + cast_seconds(cost, 1)
    per_forward = max(busy, gather) + cost.calibration.fastvideo_exposed_fraction * min(busy, gather)
    rest = cost.text_encode_seconds(FLUX, 1, 1) + cost.vae_decode_seconds(FLUX, 1, 720, 720, 1, 1)
    fp32 = cost.generate(FLUX, 1, 720, 720, 25, batch=1, sharded_over=32, param_bytes=FP32)
    assert fp32 == pytest.approx(25 * per_forward + rest, rel=1e-9)
    bf16 = cost.generate(FLUX, 1, 720, 720, 25, batch=1, sharded_over=32, param_bytes=BF16)
    half_gather = cost.collective_seconds(FLUX.params * BF16, 32, FLUX.layers)
    assert bf16 == pytest.approx(25 * max(compute, half_gather) + rest, rel=1e-9)
    assert math.isclose(gather, 2 * half_gather, rel_tol=0.05)  # the same ring, twice the bytes (latency aside)
