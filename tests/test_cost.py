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


def test_passes_profiled_at_two_sizes_fit_a_fixed_cost_per_pass():
    """A device that pays 0.2 s a pass plus 1.5x the analytic seconds: two sizes of a kind give both back; a kind at
    one size, a line through the origin's far side (negative intercept) or records that are not one pass each keep
    the ratio."""
    records = [("train", 1.0, 0.2 + 1.5), ("train", 3.0, 0.2 + 4.5), ("train", 2.0, 0.2 + 3.0), ("decode", 2.0, 3.0)]
    cost = CostModel.from_measurements("H100", records, per_pass=True)
    assert cost.fixed("train") == pytest.approx(0.2) and cost.corrections()["train"] == pytest.approx(1.5)
    assert cost.fixed("decode") == 0.0 and cost.corrections()["decode"] == pytest.approx(1.5)
    assert cost.train(QWEN4B, [512]) == pytest.approx(1.5 * CostModel("H100").train(QWEN4B, [512]))
    faster_than_linear = CostModel.from_measurements("H100", [("train", 1.0, 0.5), ("train", 3.0, 3.0)], per_pass=True)
    assert faster_than_linear.fixed_costs() == {} and faster_than_linear.corrections()["train"] == pytest.approx(
        3.5 / 4
    )
    replayed = CostModel.from_measurements("H100", records)
    assert replayed.fixed_costs() == {} and replayed.corrections()["train"] == pytest.approx(9.6 / 6)
    assert cost.ranked_on(device("L40S")).fixed("train") == pytest.approx(0.2)


def test_a_cpu_profile_priced_on_busy_cores_pays_the_run_s_share_and_a_call_per_node():
    """A CPU core's profile had the core to itself; a run shares it with its driver and Ray and calls each node
    through Ray: every kind (measured or not) `cpu_run_slowdown` longer and each pass `cpu_node_call_s` more, a fitted
    fixed cost slowed too. A GPU's model is unchanged (its driver has host cores of its own)."""
    cal = Calibration()
    records = [("train", 1.0, 0.2 + 1.5), ("train", 3.0, 0.2 + 4.5), ("decode", 2.0, 3.0)]
    profiled = CostModel.from_measurements("cpu-core", records, per_pass=True)
    busy = profiled.on_busy_cores()
    assert busy.train(QWEN4B, [512]) == pytest.approx(cal.cpu_run_slowdown * profiled.train(QWEN4B, [512]))
    assert busy.prefill(QWEN4B, [512]) == pytest.approx(cal.cpu_run_slowdown * profiled.prefill(QWEN4B, [512]))
    assert busy.fixed("train") == pytest.approx(0.2 * cal.cpu_run_slowdown + cal.cpu_node_call_s)
    assert busy.fixed("decode") == busy.fixed("publish") == pytest.approx(cal.cpu_node_call_s)
    on_gpu = CostModel.from_measurements("H100", records, per_pass=True)
    assert on_gpu.on_busy_cores() is on_gpu


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


def test_ring_collectives_use_nvlink_inside_a_node_and_the_nics_across_nodes():
    """A ring over n devices: n - 1 steps, each a hop latency per message plus nbytes / n at the ring's bus
    bandwidth: NVLink at its efficiency inside a node; across nodes one ring per NIC rail, so the NICs of the
    group's devices on a node carry its traffic side by side (8 per 8-GPU node: 320 GB/s under NVLink's 360; a group
    of 12 has 4 on one node: 160 GB/s), each at the cross-node efficiency; a hybrid-sharded replica ring has one
    device per node (one NIC)."""
    cal = Calibration()
    cost, h100 = CostModel("H100", cal), device("H100")
    nbytes = FLUX.params * 2
    assert cost.collective_seconds(nbytes, 1) == 0.0
    assert cost.collective_seconds(nbytes, 8, messages=57) == pytest.approx(
        7 * (57 * h100.interconnect_latency_s + nbytes / 8 / (h100.interconnect_bandwidth * 0.8))
    )
    nic = h100.network_bandwidth * cal.network_collective_efficiency
    nvlink = h100.interconnect_bandwidth * cal.collective_bandwidth_efficiency
    assert 8 * nic < nvlink
    assert cost.collective_seconds(nbytes, 16) == pytest.approx(15 * (h100.network_latency_s + nbytes / 16 / (8 * nic)))
    assert cost.collective_seconds(nbytes, 12) == pytest.approx(11 * (h100.network_latency_s + nbytes / 12 / (4 * nic)))
    assert cost.collective_seconds(nbytes, 16, per_node=1) == pytest.approx(
        15 * (h100.network_latency_s + nbytes / 16 / nic)
    )
    assert cost.allreduce_seconds(nbytes, 16) == pytest.approx(2 * cost.collective_seconds(nbytes, 16))
    # A device whose node's NICs together outrun its intra-node link: the ring is NVLink-bound across nodes too.
    fast = CostModel(dataclasses.replace(h100, network_bandwidth=100e9), cal)
    assert fast.collective_seconds(nbytes, 16) == pytest.approx(15 * (h100.network_latency_s + nbytes / 16 / nvlink))


def test_a_replica_all_reduce_crosses_one_nic_per_ring():
    """HSDP: groups of 8 replicated over 4 nodes all-reduce each device's 1/8 shard of the fp32 gradients in a ring
    of 4 (one device per node, through its own NIC): 2 x 3 ring steps of a quarter of the shard each."""
    cal = Calibration()
    cost, h100 = CostModel("H100", cal), device("H100")
    shard = FLUX.params * cal.grad_reduce_bytes / 8
    nic = h100.network_bandwidth * cal.network_collective_efficiency
    assert cost.replica_allreduce_seconds(FLUX.params, 8, 4) == pytest.approx(
        2 * 3 * (h100.network_latency_s + shard / 4 / nic)
    )
    assert cost.replica_allreduce_seconds(FLUX.params, 8, 1) == 0.0


def fsdp_gather(devices: int, nbytes: float, layers: int = FLUX.layers) -> float:
    """One FSDP all-gather (or reduce-scatter) of `nbytes`, one collective per layer (FLUX's 57), recomputed by
    hand."""
    cal, h100 = Calibration(), device("H100")
    if devices <= 8:
        bandwidth, latency = h100.interconnect_bandwidth * cal.collective_bandwidth_efficiency, 0.7e-6
    else:  # whole 8-GPU nodes: their eight NICs side by side
        bandwidth, latency = 8 * h100.network_bandwidth * cal.network_collective_efficiency, 8e-6
    return (devices - 1) * (layers * latency + nbytes / devices / bandwidth)


def fastvideo_pass(cal: Calibration, compute: float, transfer: float, params: float, casts: int) -> float:
    """A pass of fastvideo's fp32 FSDP under bf16 autocast, by hand: each forward casts the fp32 weights to bf16 (6
    bytes per parameter through HBM at the optimizer's efficiency) before its compute, and the exposed fraction of
    the shorter of compute and traffic adds to the longer."""
    busy = compute + casts * params * 6 / (device("H100").memory_bandwidth * cal.optimizer_bandwidth_efficiency)
    return max(busy, transfer) + cal.fastvideo_exposed_fraction * min(busy, transfer)


def test_a_pass_takes_the_longer_of_its_compute_and_its_fsdp_traffic():
    """SD3.5-M, one 256x256 sample at one timestep per pass on 16 H100s (two nodes): a training pass pays the bf16
    all-gathers of forward and backward plus the fp32 gradient reduce-scatter (they outlast its compute), with fp32
    parameters (fastvideo's FSDP) twice the all-gather bytes, its forward and recompute casting them (`fastvideo_pass`);
    a forward-only pass the longer of its compute and one all-gather."""
    cal = Calibration()
    cost, h100 = CostModel("H100", cal), device("H100")
    sd3 = diffusion_model("SD3.5-M")
    tokens = sd3.latent_tokens(256, 256)
    traffic = 2 * fsdp_gather(16, sd3.params * 2, sd3.layers) + fsdp_gather(
        16, sd3.params * cal.grad_reduce_bytes, sd3.layers
    )
    samples = 32  # two per device: two passes
    assert cost.dit_train(sd3, samples, 1, tokens, devices=16, micro_batch=1) == pytest.approx(16 * 2 * traffic)
    fp32 = 3 * fsdp_gather(16, sd3.params * 4, sd3.layers)
    train = (
        4
        * CostModel.dit_forward_flops(sd3, tokens)
        / (h100.peak_flops * cal.dit_train_mfu * tokens / (tokens + cal.dit_half_mfu_tokens))
    )
    assert cost.dit_train(sd3, samples, 1, tokens, devices=16, micro_batch=1, param_bytes=4) == pytest.approx(
        16 * 2 * fastvideo_pass(cal, train, fp32, sd3.params, casts=2)
    )
    gather = fsdp_gather(16, sd3.params * 2, sd3.layers)
    forward = CostModel.dit_forward_flops(sd3, tokens) / (
        h100.peak_flops * cal.dit_logprob_mfu * tokens / (tokens + cal.dit_half_mfu_tokens)
    )
    assert cost.dit_logprob(sd3, samples, 3, tokens, devices=16, micro_batch=1) == pytest.approx(
        3 * 16 * 2 * max(forward, gather)
    )


def test_a_sharded_trainer_that_samples_gathers_the_weights_every_denoising_forward():
    """DanceGRPO samples with its FSDP trainer: one SD3.5-M image per pass over 16 H100s, each of the 10 denoising
    forwards all-gathering the fp32 weights and casting them under autocast (`fastvideo_pass`; traffic-bound at
    256x256), against a replicated engine's compute alone."""
    cal = Calibration()
    cost = CostModel("H100", cal)
    sd3 = diffusion_model("SD3.5-M")
    replicated = cost.generate(sd3, 4, 256, 256, 10, batch=1)
    sharded = cost.generate(sd3, 4, 256, 256, 10, batch=1, sharded_over=16, param_bytes=4)
    encode_decode = cost.text_encode_seconds(sd3, 4) + cost.vae_decode_seconds(sd3, 4, 256, 256)
    tokens = sd3.latent_tokens(256, 256)
    compute = CostModel.dit_forward_flops(sd3, tokens) / (
        device("H100").peak_flops * cal.dit_inference_mfu * tokens / (tokens + cal.dit_half_mfu_tokens)
    )
    gather = fsdp_gather(16, sd3.params * 4, sd3.layers)
    assert sharded == pytest.approx(encode_decode + 4 * 10 * fastvideo_pass(cal, compute, gather, sd3.params, 1))
    assert sharded > replicated


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
    # Where every pass is traffic-bound (small SD3.5-M images across nodes), ten passes of it against one.
    sd3 = diffusion_model("SD3.5-M")
    small = sd3.latent_tokens(256, 256)
    assert 10 * cost.dit_train(sd3, 16, 1, small, devices=16, micro_batch=1) > 2 * cost.dit_train(
        sd3, 16, 10, small, devices=16, micro_batch=1
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
