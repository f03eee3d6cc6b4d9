"""The cost model has the hardware's structure: links by where a group reaches, a decode floor, devices that differ
by more than their peaks, and LoRA adapters. Closed forms recomputed from the catalogue; two held-out decode checks
against a published vLLM sweep."""

from dataclasses import replace

import planner_scenarios
import pytest

from dovetail.cost.calibration import DEFAULT
from dovetail.cost.catalog import device, diffusion_model, language_model
from dovetail.cost.model import CostModel, lora_params
from dovetail.graph.node import Kind
from dovetail.plan.metrics import summarize
from dovetail.plan.prepare import simulate
from dovetail.plan.scenario import load_scenario, parse_scenario

QWEN8B = language_model("Qwen3-8B")
LLAMA8B = language_model("Llama-3.1-8B")
FLUX = diffusion_model("FLUX.1-12B")
WAN = diffusion_model("Wan2.1-14B")


def test_an_all_reduce_crossing_nodes_pays_the_network_hops():
    """TP 32 on 8-GPU nodes: each of the two per-layer all-reduces is 2 x 31 ring steps of the NIC's hop latency
    plus a 1/32 share of the bytes over a node's eight NICs side by side at the cross-node efficiency."""
    cost, h100 = CostModel("H100"), device("H100")
    nbytes = 64 * QWEN8B.hidden * 2
    step = h100.network_latency_s + nbytes / 32 / (8 * h100.network_bandwidth * DEFAULT.network_collective_efficiency)
    assert cost.allreduce_seconds(nbytes, 32) == pytest.approx(2 * 31 * step)
    inside = cost.allreduce_seconds(nbytes, 8)
    assert inside == pytest.approx(
        2 * 7 * (h100.interconnect_latency_s + nbytes / 8 / (h100.interconnect_bandwidth * 0.8))
    )
    assert cost.allreduce_seconds(nbytes, 32) > 10 * inside


def test_a_wider_tail_engine_is_not_free():
    """One long response: TP 32 across four nodes decodes slower per token than TP 8 inside one."""
    cost = CostModel("A100-80G")
    assert cost.decode(QWEN8B, [1024], [4096], devices=32) > cost.decode(QWEN8B, [1024], [4096], devices=8)


def test_one_group_decodes_no_faster_on_more_devices():
    """One group of two ~900-token responses at TP 1 takes the same time on 4, 8 and 32 H100s (a group decodes on
    one engine, and the engine is one device)."""
    pipeline = planner_scenarios.lm_pipeline(
        name="one",
        model="Qwen3-4B",
        batch=1,
        group=2,
        lengths={"kind": "empirical", "values": [900]},
        max_length=8192,
        micro_batches=1,
    )
    scenario = planner_scenarios.scenario(pipeline, name="one-group", policies=("verl-sync",))
    decode_s = {}
    for devices in (4, 8, 32):
        sized = scenario.model_copy(update={"cluster": scenario.cluster.model_copy(update={"devices": devices})})
        prepared, trace = simulate(sized, "verl-sync")
        decode_nodes = {n.id for n in prepared.graph if n.kind == Kind.DECODE}
        decode_s[devices] = sum({s.node: s.end - s.start for s in trace.spans if s.node in decode_nodes}.values())
    one_engine = CostModel("H100").decode(language_model("Qwen3-4B"), [256, 256], [900, 900])
    assert decode_s[4] == pytest.approx(one_engine, rel=1e-9)
    assert decode_s[8] == pytest.approx(decode_s[4], rel=1e-9)
    assert decode_s[32] == pytest.approx(decode_s[4], rel=1e-9)


def every_cost(cost: CostModel) -> list[float]:
    """One figure of each kind of work: decode (TP 1 and 8), prefill, generation, FSDP training in and across
    nodes, a collective, an engine switch and a publication."""
    tokens = FLUX.latent_tokens(720, 720)
    return [
        cost.decode(QWEN8B, [512] * 64, [1024] * 64),
        cost.decode(QWEN8B, [512] * 64, [1024] * 64, devices=8),
        cost.prefill(QWEN8B, [2048] * 64, devices=8),
        cost.generate(FLUX, 8, 720, 720, 16),
        cost.dit_train(FLUX, 16, 4, tokens, devices=8, micro_batch=1),
        cost.dit_train(FLUX, 32, 4, tokens, devices=16, micro_batch=1),
        cost.collective_seconds(1e9, 8, messages=40),
        cost.switch(40e9),
        cost.publish(FLUX.params),
    ]


def test_an_h200_is_never_slower_than_an_h100():
    for h200, h100 in zip(every_cost(CostModel("H200")), every_cost(CostModel("H100"))):
        assert h200 <= h100
    assert every_cost(CostModel("H200"))[0] < every_cost(CostModel("H100"))[0]  # decode: more HBM bandwidth


def test_an_h800_pays_its_cut_nvlink_only_where_a_group_crosses_it():
    h800, h100 = CostModel("H800"), CostModel("H100")
    assert h800.decode(QWEN8B, [512] * 64, [1024] * 64) == h100.decode(QWEN8B, [512] * 64, [1024] * 64)
    assert h800.decode(QWEN8B, [512] * 64, [1024] * 64, devices=8) > h100.decode(QWEN8B, [512] * 64, [1024] * 64, 8)
    assert h800.collective_seconds(10e9, 8) > 2 * h100.collective_seconds(10e9, 8)


@pytest.mark.parametrize("model,frames", [(FLUX, 1), (WAN, 33)])
def test_an_l40s_never_beats_an_a100_at_diffusion_work(model, frames):
    height, width = (720, 720) if frames == 1 else (480, 832)
    tokens = model.latent_tokens(height, width, frames)
    for l40s, a100 in (
        (CostModel(name).generate(model, 4, height, width, 20, frames) for name in ("L40S", "A100-80G")),
        (CostModel(name).dit_train(model, 16, 4, tokens, devices=8, micro_batch=1) for name in ("L40S", "A100-80G")),
    ):
        assert l40s > a100


def test_lora_adapter_parameters_closed_form():
    """rank x (d_in + d_out) per adapted matrix: 4 hidden x hidden projections per layer; all-linear adds an LM's
    three SwiGLU matrices of the intermediate width the layer's remaining parameters imply."""
    hidden, layers, rank = QWEN8B.hidden, QWEN8B.layers, 64
    attention = layers * 4 * rank * 2 * hidden
    assert lora_params(QWEN8B, rank, "attention") == attention
    intermediate = (QWEN8B.params / layers - 4 * hidden**2) / (3 * hidden)
    assert lora_params(QWEN8B, rank, "all-linear") == pytest.approx(
        attention + layers * 3 * rank * (hidden + intermediate)
    )
    wan22 = diffusion_model("Wan2.2-A14B")
    assert lora_params(wan22, 8, "attention") == 2 * lora_params(WAN, 8, "attention")  # an adapter per expert
    with pytest.raises(ValueError, match="attention, all-linear"):
        lora_params(QWEN8B, 8, "mlp")


def test_lora_trains_the_adapter_only():
    """Frozen base weights (bf16, sharded), adapter weights + grads + fp32 master and moments; a backward of one
    forward (activation gradients through the base) instead of two; the adapter's bytes published."""
    cost = CostModel("H100")
    adapter = lora_params(FLUX, 64, "all-linear")
    memory = cost.training_memory(FLUX.params, FLUX.layers, FLUX.hidden, 0, devices=8, trainable=adapter)
    assert memory.weights == pytest.approx((FLUX.params + adapter) * 2 / 8)
    assert memory.grads == pytest.approx(adapter * 2 / 8)
    assert memory.optimizer == pytest.approx(adapter * 12 / 8)
    full = cost.training_memory(FLUX.params, FLUX.layers, FLUX.hidden, 0, devices=8)
    assert memory.total < full.total / 3
    tokens = FLUX.latent_tokens(1024, 1024)  # large passes inside a node: compute-bound
    lora_s = cost.dit_train(FLUX, 16, 4, tokens, devices=8, micro_batch=4, trainable=adapter)
    assert lora_s == pytest.approx(3 / 4 * cost.dit_train(FLUX, 16, 4, tokens, devices=8, micro_batch=4))
    lengths = [1000, 3000]
    assert cost.train(QWEN8B, lengths, lora=True) == pytest.approx(3 / 4 * cost.train(QWEN8B, lengths))
    host = device("H100").host_bandwidth * DEFAULT.host_link_efficiency
    assert cost.publish(adapter) == pytest.approx(
        DEFAULT.publish_fixed_s + adapter * 2 / (host * DEFAULT.publish_bandwidth_efficiency)
    )


def test_a_lora_scenario_builds_a_lighter_trainer():
    full = load_scenario("calib-qwenimage-4xh200")
    data = full.model_dump(mode="python")
    data["pipelines"][0]["lora"] = {"rank": 64}
    lora = parse_scenario(data)
    resident = [simulate(s, "colocated", steps=1)[0].setup.engines["qwenimage"].resident_gb for s in (full, lora)]
    assert resident[1]["trainer"] < resident[0]["trainer"]
    publish = [
        next(n.cost_s for n in simulate(s, "colocated", steps=1)[0].graph if n.kind == Kind.PUBLISH)
        for s in (full, lora)
    ]
    assert publish[1] - DEFAULT.publish_fixed_s < (publish[0] - DEFAULT.publish_fixed_s) / 10  # adapter bytes


@pytest.mark.parametrize(
    "lora,field",
    [({"rank": 0}, "pipelines.0.flow.lora.rank"), ({"rank": 8, "targets": "mlp"}, "pipelines.0.flow.lora.targets")],
)
def test_bad_lora_values_are_one_line_naming_the_field(lora, field):
    data = load_scenario("calib-qwenimage-4xh200").model_dump(mode="python")
    data["pipelines"][0]["lora"] = lora
    with pytest.raises(ValueError) as error:
        parse_scenario(data, "s.yaml")
    assert "\n" not in str(error.value) and field in str(error.value)


def test_published_decode_sweep_held_out():
    """Held out: Llama-3.1-8B on one A100 40GB under `vllm serve` (CUDA graphs: no per-layer launch overhead),
    1024-token prompts, 128 new tokens: ~75 tokens/s alone and 6.6x that at concurrency 8 (J. Musgrave, "vLLM
    throughput-latency sweep on NVIDIA A100", johnmusgrave.com). Within 20 %."""
    cost = CostModel("A100-40G", replace(DEFAULT, decode_layer_overhead_s=0.0))
    alone = 128 / cost.decode(LLAMA8B, [1024], [128])
    eight = 8 * 128 / cost.decode(LLAMA8B, [1024] * 8, [128] * 8)
    assert alone == pytest.approx(75, rel=0.20)
    assert eight / alone == pytest.approx(6.6, rel=0.20)


def test_a_cluster_s_own_network_reaches_the_cost_model():
    """`cluster.network_gbps` replaces the catalogue device's NIC share: veRL-Omni's 64-GPU run on its fitted thin
    network (12.5 Gb/s per GPU) against the same run on the catalogue's HGX node (400 Gb/s per GPU), one FSDP group
    over every GPU as the recipe sets it. Only collectives that cross nodes move: on one node the two agree."""
    fitted = load_scenario("calib-qwenimage-64xh100")
    assert fitted.cluster.catalogue_device().network_bandwidth == pytest.approx(12.5e9 / 8)
    reference = fitted.model_copy(update={"cluster": fitted.cluster.model_copy(update={"network_gbps": None})})

    def step(scenario, devices):
        sized = scenario.model_copy(update={"cluster": scenario.cluster.model_copy(update={"devices": devices})})
        _, trace = simulate(sized, "colocated", steps=2, trainer_group=devices)
        first, second = sorted(r.end for r in trace.steps)
        return second - first

    assert step(fitted, 64) > 2 * step(reference, 64)
    assert step(fitted, 8) == pytest.approx(step(reference, 8))


def test_a_trainer_that_samples_neither_switches_nor_publishes_and_gathers_its_weights_to_generate():
    """DanceGRPO's recipe (calib-dancegrpo-flux-32xh800): the FSDP trainer generates, so a step has no engine switch
    and no publication, every generate node pays the fp32 all-gathers of its denoising forwards, and the same recipe
    on replicated bf16 engines generates faster but switches and publishes."""
    scenario = load_scenario("calib-dancegrpo-flux-32xh800")
    prepared, trace = simulate(scenario, "colocated", steps=2, trainer_group=32)
    summary = summarize(trace)
    assert summary.phase_seconds.get("switch", 0.0) == 0.0 and summary.phase_seconds.get("publish", 0.0) == 0.0
    spec = scenario.pipelines[0]
    engine = spec.model_copy(update={"sampler": "engine", "fsdp_precision": "bf16"})
    on_engines = scenario.model_copy(update={"pipelines": [engine]})
    engines_prepared, engines_trace = simulate(on_engines, "colocated", steps=2, trainer_group=32)
    generate = [n.cost_s for n in prepared.graph if n.kind == Kind.GENERATE]
    engines_generate = [n.cost_s for n in engines_prepared.graph if n.kind == Kind.GENERATE]
    cost, flux = CostModel("H800"), diffusion_model(spec.model)
    gathers = spec.group * spec.denoising_steps * cost.collective_seconds(flux.params * 4, 32, flux.layers)
    assert min(generate) >= gathers > 0 and min(generate) > max(engines_generate)
    engines_summary = summarize(engines_trace)
    assert engines_summary.phase_seconds["switch"] > 0 and engines_summary.phase_seconds["publish"] > 0
