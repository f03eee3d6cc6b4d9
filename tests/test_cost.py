"""Closed forms of the cost model, recomputed independently from the catalogue figures."""

import dataclasses
import math

import pytest

from dovetail.cost.calibration import Calibration
from dovetail.cost.catalog import device, diffusion_model, language_model
from dovetail.cost.model import CostModel

QWEN4B = language_model("Qwen3-4B")


def test_single_sequence_decode_is_bandwidth_plus_overhead():
    """One sequence at short context: every token reads the weights and the KV cache once."""
    cal = Calibration()
    cost = CostModel("H100", cal)
    h100 = device("H100")
    prompt, tokens = 100, 50
    kv_tokens = sum(prompt + j for j in range(tokens))
    bytes_read = tokens * QWEN4B.params * 2 + QWEN4B.kv_bytes_per_token * kv_tokens
    expected = (
        bytes_read / (h100.memory_bandwidth * cal.decode_bandwidth_efficiency)
        + tokens * QWEN4B.layers * cal.decode_layer_overhead_s
    )
    assert cost.decode(QWEN4B, [prompt], [tokens]) == pytest.approx(expected, rel=1e-12)


def test_decode_batch_is_bound_by_its_longest_member():
    cost = CostModel("H100")
    alone = cost.decode(QWEN4B, [100], [4000])
    with_short = cost.decode(QWEN4B, [100] * 9, [4000] + [10] * 8)
    assert alone < with_short < 1.05 * alone


def test_tensor_parallel_splits_bandwidth_work():
    """TP 4 reads a quarter of the bytes per device, and pays per token and layer two NVLink all-reduces of one
    hidden state: 2 x 3 ring steps each of a hop latency plus hidden x 2 / 4 bytes over 0.8 x 450 GB/s."""
    no_overhead = dataclasses.replace(Calibration(), decode_layer_overhead_s=0.0)
    cost, h100 = CostModel("H100", no_overhead), device("H100")
    step = h100.interconnect_latency_s + QWEN4B.hidden * 2 / 4 / (h100.interconnect_bandwidth * 0.8)
    allreduces = 100 * QWEN4B.layers * 2 * (2 * 3 * step)
    assert cost.decode(QWEN4B, [100], [100], devices=4) == pytest.approx(
        cost.decode(QWEN4B, [100], [100]) / 4 + allreduces
    )


def test_training_is_three_forwards_plus_recompute():
    cal = Calibration()
    cost = CostModel("A100-80G", cal)
    lengths = [1000, 3000]
    forward = 2 * QWEN4B.params * 4000 + 2 * QWEN4B.layers * QWEN4B.attention_width * (1000**2 + 3000**2)
    peak = device("A100-80G").peak_flops
    assert cost.train(QWEN4B, lengths, checkpointing=False) == pytest.approx(3 * forward / (peak * cal.train_mfu))
    assert cost.train(QWEN4B, lengths) == pytest.approx(4 * forward / (peak * cal.train_mfu))
    assert cost.logprob(QWEN4B, lengths) == pytest.approx(forward / (peak * cal.logprob_mfu))


def test_dit_generation_doubles_with_cfg_and_counts_latent_tokens():
    flux = diffusion_model("FLUX.1-12B")
    assert flux.latent_tokens(720, 720) == 45 * 45
    wan = diffusion_model("Wan2.1-14B")
    assert wan.latent_tokens(240, 416, 33) == 9 * 15 * 26
    cost = CostModel("H100")
    dit_only = cost.generate(flux, 4, 720, 720, 16, cfg=True) - cost.generate(flux, 4, 720, 720, 16, cfg=False)
    cal = Calibration()
    expected = 4 * 16 * CostModel.dit_forward_flops(flux, 2025) / (device("H100").peak_flops * cal.dit_inference_mfu)
    assert dit_only == pytest.approx(expected)


def test_bad_resolution_names_the_fix():
    with pytest.raises(ValueError, match="multiple of 16"):
        diffusion_model("FLUX.1-12B").latent_tokens(700, 720)


def test_fsdp_memory_arithmetic():
    cost = CostModel("H100")
    params, devices = 8e9, 8
    memory = cost.training_memory(params, 36, 4096, tokens_per_device=0, devices=devices)
    assert memory.weights == params * 2 / devices
    assert memory.grads == params * 2 / devices
    assert memory.optimizer == params * 12 / devices
    assert memory.total == pytest.approx(params * 16 / devices)
    offloaded = cost.training_memory(params, 36, 4096, tokens_per_device=0, devices=devices, offload=True)
    assert offloaded.total == params * 2 / devices


def test_kv_cache_room_and_rollout_memory():
    cost = CostModel("H100")
    room = cost.kv_cache_bytes(QWEN4B, devices=2)
    assert room == pytest.approx(2 * 80e9 * Calibration().rollout_memory_fraction - QWEN4B.params * 2)
    assert cost.rollout_memory(QWEN4B, 1000, devices=2).kv_cache == QWEN4B.kv_bytes_per_token * 1000 / 2
    with pytest.raises(ValueError, match="tensor-parallel"):
        CostModel("L40S").kv_cache_bytes(language_model("Qwen3-32B"))


def test_publish_is_bytes_over_bandwidth():
    cal = Calibration()
    host = device("H100").host_bandwidth * cal.host_link_efficiency
    expected = cal.publish_fixed_s + 14e9 * 2 / (host * cal.publish_bandwidth_efficiency)
    assert CostModel("H100").publish(14e9) == pytest.approx(expected)


def test_from_measurements_reproduces_a_profiled_run():
    records = [("decode", 2.0, 3.0), ("decode", 1.0, 1.5), ("train", 4.0, 2.0)]
    cost = CostModel.from_measurements("H100", records)
    assert cost.corrections() == {"decode": 1.5, "train": 0.5}
    analytic = CostModel("H100")
    assert cost.prefill(QWEN4B, [512]) == analytic.prefill(QWEN4B, [512])
    assert cost.logprob(QWEN4B, [512]) == analytic.logprob(QWEN4B, [512])
    assert math.isclose(cost.train(QWEN4B, [512]), 0.5 * analytic.train(QWEN4B, [512]))


@pytest.mark.parametrize("bad", [("dance", 1.0, 1.0), ("train", 0.0, 1.0), ("train", 1.0, -1.0)])
def test_from_measurements_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="op kind|must both be > 0"):
        CostModel.from_measurements("H100", [bad])


def test_unknown_catalogue_names_list_the_choices():
    with pytest.raises(ValueError, match="choose one of .*H100"):
        device("B300")
    with pytest.raises(ValueError, match="Qwen3-4B"):
        language_model("Qwen4")


FLUX = diffusion_model("FLUX.1-12B")


def test_ring_collectives_use_nvlink_inside_a_node_and_the_nic_across_nodes():
    """A ring over n devices: n - 1 steps, each a hop latency per message plus nbytes / n over the slowest link,
    NVLink at its efficiency inside a node, the NIC at the cross-node efficiency once the ring spans nodes."""
    cal = Calibration()
    cost, h100 = CostModel("H100", cal), device("H100")
    nbytes = FLUX.params * 2
    assert cost.collective_seconds(nbytes, 1) == 0.0
    assert cost.collective_seconds(nbytes, 8, messages=57) == pytest.approx(
        7 * (57 * h100.interconnect_latency_s + nbytes / 8 / (h100.interconnect_bandwidth * 0.8))
    )
    assert cost.collective_seconds(nbytes, 16) == pytest.approx(
        15 * (h100.network_latency_s + nbytes / 16 / (h100.network_bandwidth * cal.network_collective_efficiency))
    )
    assert cost.allreduce_seconds(nbytes, 16) == pytest.approx(2 * cost.collective_seconds(nbytes, 16))


def fsdp_gather(devices: int, nbytes: float) -> float:
    """One FSDP all-gather (or reduce-scatter) of `nbytes`, one collective per FLUX layer, recomputed by hand."""
    cal, h100 = Calibration(), device("H100")
    if devices <= 8:
        bandwidth, latency = h100.interconnect_bandwidth * cal.collective_bandwidth_efficiency, 0.7e-6
    else:
        bandwidth, latency = h100.network_bandwidth * cal.network_collective_efficiency, 8e-6
    return (devices - 1) * (FLUX.layers * latency + nbytes / devices / bandwidth)


def test_a_communication_bound_pass_costs_its_fsdp_traffic():
    """FLUX, one 720x720 sample at one timestep per pass on 16 H100s (two nodes): the bf16 all-gathers of
    forward and backward plus the fp32 gradient reduce-scatter outlast the compute, every pass."""
    cal = Calibration()
    cost = CostModel("H100", cal)
    tokens = FLUX.latent_tokens(720, 720)
    traffic = 2 * fsdp_gather(16, FLUX.params * 2) + fsdp_gather(16, FLUX.params * cal.grad_reduce_bytes)
    samples = 32  # two per device: two passes
    assert cost.dit_train(FLUX, samples, 1, tokens, devices=16, micro_batch=1) == pytest.approx(16 * 2 * traffic)
    # The forward-only loop pays one all-gather per pass.
    gather = fsdp_gather(16, FLUX.params * 2)
    assert cost.dit_logprob(FLUX, samples, 3, tokens, devices=16, micro_batch=1) == pytest.approx(3 * 16 * 2 * gather)


def test_tsp_amortises_per_pass_traffic_and_small_pass_underutilisation():
    """Ten timesteps batched in one pass cost their FLOPs at the large-pass efficiency (inside a node, where the
    traffic hides under compute); looped one by one they pay ten passes of traffic."""
    cal = Calibration()
    cost = CostModel("H100", cal)
    tokens = FLUX.latent_tokens(720, 720)
    looped = 10 * cost.dit_train(FLUX, 16, 1, tokens, devices=8, micro_batch=1)
    batched = cost.dit_train(FLUX, 16, 10, tokens, devices=8, micro_batch=1)
    pairs = 10
    mfu = cal.dit_train_mfu * pairs * tokens / (pairs * tokens + cal.dit_half_mfu_tokens)
    assert batched == pytest.approx(
        16 * 4 * pairs * CostModel.dit_forward_flops(FLUX, tokens) / (device("H100").peak_flops * mfu)
    )
    assert looped > batched
    # Across nodes every pass is traffic-bound: ten passes of it against one.
    assert 10 * cost.dit_train(FLUX, 16, 1, tokens, devices=16, micro_batch=1) > 3 * cost.dit_train(
        FLUX, 16, 10, tokens, devices=16, micro_batch=1
    )
    assert cost.pass_mfu(0.6, cal.dit_half_mfu_tokens) == pytest.approx(0.3)


def test_reference_forward_streams_its_shard_from_host_each_pass():
    """verl runs the reference model under FSDP CPUOffload: a pass also copies the device's bf16 shard in."""
    cal = Calibration()
    cost = CostModel("H100", cal)
    h100 = device("H100")
    tokens = FLUX.latent_tokens(256, 256)  # a small pass: transfer-bound once streaming
    gather = fsdp_gather(8, FLUX.params * 2)
    host = FLUX.params * 2 / 8 / (h100.host_bandwidth * cal.host_link_efficiency)
    compute = CostModel.dit_forward_flops(FLUX, tokens) / (
        h100.peak_flops * cal.dit_logprob_mfu * tokens / (tokens + cal.dit_half_mfu_tokens)
    )
    assert compute < gather + host
    streamed = cost.dit_logprob(FLUX, 8, 1, tokens, devices=8, micro_batch=1, host_streaming=True)
    assert streamed == pytest.approx(8 * (gather + host))
    assert cost.dit_logprob(FLUX, 8, 1, tokens, devices=8, micro_batch=1) == pytest.approx(8 * max(compute, gather))
