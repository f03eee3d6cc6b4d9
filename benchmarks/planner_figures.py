"""The planner's figures in BENCHMARKS.md (issue 10): published runs against the simulator, per-GPU throughput
scaling curves beside published points, the DigenRL / JigsawRL tables with one ablation per mechanism, and issue 19's
two-device targets on GPUs.

    python benchmarks/planner_figures.py [calibration] [dancegrpo] [scaling] [digen] [digen-thin] [jigsaw] \
        [jigsaw-thin] [pipelines] [two-devices]

Every figure is the simulator's (`dovetail.plan.scenario.simulate`, noise 0) on the shipped scenarios; nothing runs on a
device. Sections print Markdown tables."""

from __future__ import annotations

import sys
import time
from dataclasses import replace

from dovetail.cost.calibration import DEFAULT
from dovetail.cost.model import CostModel
from dovetail.graph.node import Kind
from dovetail.plan.metrics import summarize
from dovetail.plan.prepare import prepare, simulate
from dovetail.plan.scenario import Scenario, list_scenarios, load_scenario, parse_scenario
from dovetail.plan.sim import SimExecutor


def ablated(scenario: Scenario, policy: str, change: dict, options=None):
    """The policy's searched shapes with `change` applied to every pipeline's (one mechanism taken away), simulated."""
    searched = prepare(scenario, policy, options=options).setup.shapes
    shapes = {name: replace(shape, **change) for name, shape in searched.items()}
    prepared = prepare(scenario, policy, shapes=shapes, options=options)
    return SimExecutor(prepared.graph, prepared.setup, slowdown=prepared.setup.slowdown).run(prepared.policy)


def steady_step_s(scenario: Scenario, policy: str, cost: CostModel | None = None) -> float:
    """Commit to commit of the second step: one whole step with its switches and weight sync, under the settings
    the published run's recipe fixed (on `cost`, or the scenario device's analytic cost model)."""
    recipe = scenario.published.shape.model_dump(exclude_none=True) if scenario.published else {}
    _, trace = simulate(scenario, policy, steps=2, cost=cost, **recipe)
    first, second = sorted(record.end for record in trace.steps)
    return second - first


def calibration() -> None:
    """Two tables: the published runs a factor (or the scenario's cluster network) was fitted to, then the held-out
    ones, each with the simulated steady step and its error, and where its device and network come from."""
    runs = [(name, load_scenario(name)) for name in list_scenarios()]
    runs = [(name, scenario) for name, scenario in runs if scenario.published is not None]
    for held_out in (False, True):
        print(f"\n{'Held out' if held_out else 'Fitted'}:\n")
        print(
            "| scenario | devices | network | published step | simulated step | error | source "
            "| device: assumption and source | network: assumption and source |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for name, scenario in runs:
            published = scenario.published
            if published.held_out != held_out:
                continue
            simulated = steady_step_s(scenario, scenario.schedule.policies[0])
            network = scenario.cluster.network_gbps
            network = "catalogue" if network is None else f"{network:g} Gb/s per GPU"
            print(
                f"| {name} | {scenario.cluster.devices}x {scenario.cluster.device} "
                f"| {network} | {FIGURE_MARK[published.figure]}{published.step_time_s:g} s "
                f"| {simulated:.1f} s | {simulated / published.step_time_s - 1:+.1%} | {published.source} "
                f"| {published.device_assumption} | {published.network_assumption} |"
            )


FIGURE_MARK = {"measured": "", "approximate": "~", "upper_bound": "<= "}
"""How the calibration table marks a published figure: measured, a rounded remark, an upper bound."""

DANCEGRPO_RUNS = (
    "calib-dancegrpo-flux-8xh800",
    "calib-dancegrpo-flux-16xh800",
    "calib-dancegrpo-flux-32xh800",
    "calib-mixgrpo-flux-32xh800",
)


def dancegrpo() -> None:
    """fastvideo's four FLUX runs under each exposed fraction of its FSDP term (`fastvideo_exposed_fraction`) and on
    the two devices the 32-GPU runs could have used: what no single fraction can do on one device. Per image
    and denoising step, the model prices the 8-, 16- and 32-GPU passes alike (FULL_SHARD rings bound by NVLink in all
    three), so their errors move together whatever the fraction (BENCHMARKS.md: what the published figures say per
    image)."""
    print("| exposed fraction | device | " + " | ".join(DANCEGRPO_RUNS) + " |")
    print("|---|---|" + "---|" * len(DANCEGRPO_RUNS))
    for fraction in (0.0, DEFAULT.fastvideo_exposed_fraction, 0.5, 1.0):
        calibration = replace(DEFAULT, fastvideo_exposed_fraction=fraction)
        for device in ("H800", "H100"):
            cells = []
            for name in DANCEGRPO_RUNS:
                scenario = load_scenario(name)
                cluster = scenario.cluster.model_copy(update={"device": device})
                scenario = scenario.model_copy(update={"cluster": cluster})
                simulated = steady_step_s(scenario, "colocated", CostModel(device, calibration))
                cells.append(f"{simulated:.0f} s ({simulated / scenario.published.step_time_s - 1:+.0%})")
            print(f"| {fraction:g} | {device} | " + " | ".join(cells) + " |")


def resized(name: str, devices: int, device: str | None = None, network_gbps: float | None = None) -> Scenario:
    """A shipped scenario on `devices` (of `device`), on the catalogue's network or `network_gbps` per device."""
    data = load_scenario(name).model_dump(mode="python", exclude_none=True)
    data["cluster"] = {"device": device or data["cluster"]["device"], "devices": devices}
    if network_gbps is not None:
        data["cluster"]["network_gbps"] = network_gbps
    data.pop("published", None)
    return parse_scenario(data, f"{name}@{devices}")


THIN_NETWORK_GBPS = 12.5
"""The network fitted to veRL-Omni's 64-GPU run (calib-qwenimage-64xh100: one 100 Gb/s NIC per 8-GPU node): the
cross-node sensitivity of the tables, against the catalogue's one 400 Gb/s NIC per GPU."""

SCALING = (
    ("calib-qwenimage-64xh100", "colocated", None, "Qwen-Image colocated (FULL_SHARD)"),
    ("calib-qwenimage-64xh100", "colocated", THIN_NETWORK_GBPS, "same, thin network"),
    ("calib-qwenimage-64xh100", "colocated-hsdp", None, "colocated-hsdp"),
    ("calib-qwenimage-64xh100", "disaggregated", None, "disaggregated"),
    ("calib-qwenimage-64xh100", "digen", None, "digen"),
    ("calib-nemorl-llama8b-16xh100", "verl-sync", None, "Llama-3.1-8B verl-sync"),
    ("calib-nemorl-llama8b-16xh100", "streamrl", None, "streamrl"),
    ("calib-nemorl-llama8b-16xh100", "areal", None, "areal"),
    ("calib-nemorl-llama8b-16xh100", "jigsaw", None, "jigsaw"),
)


def scaling() -> None:
    """Per-GPU throughput of one diffusion job (veRL-Omni's Qwen-Image FlowGRPO recipe: images/GPU/s) and one LLM job
    (NeMo RL's Llama-3.1-8B GRPO: tokens/GPU/s, prompt and response tokens) from 1 to 256 H100s, the recipe's batch
    kept, under every policy of its kind (the colocated FULL_SHARD one also on the thin network fitted to veRL-Omni's
    64-GPU cluster); the steady step (commit to commit of the second step) beside each."""
    print("| GPUs | " + " | ".join(label for *_, label in SCALING) + " |")
    print("|---|" + "---|" * len(SCALING))
    for devices in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        row = [str(devices)]
        for name, policy, network, _ in SCALING:
            try:
                prepared, trace = simulate(resized(name, devices, "H100", network), policy, steps=2)
            except ValueError as error:
                row.append(f"n/a: {str(error).split(';')[0][:40]}")
                continue
            ends = sorted({record.end for record in trace.steps})
            step = ends[1] - ends[0]
            record = sorted(trace.steps, key=lambda r: r.end)[1]
            if name.startswith("calib-nemorl"):  # NeMo RL's tokens/s/GPU counts every prompt and response token
                decoded = prepared.graph.of(record.pipeline, record.step, Kind.DECODE)
                prompts = record.samples * load_scenario(name).pipelines[0].prompt_length
                tokens = sum(n.tokens for n in decoded) + prompts
                row.append(f"{tokens / step / devices:.0f} ({step:.0f} s)")
            else:
                row.append(f"{record.samples / step / devices:.3f} ({step:.0f} s)")
        print("| " + " | ".join(row) + " |")


DIGEN = ("digen-flux-16", "digen-wan-16", "digen-hunyuan-32", "digen-qwenimage-32")


def digen(network_gbps: float | None = None) -> None:
    """Each policy (colocated: veRL-Omni's default, one FSDP group over the pool; colocated-hsdp: its fsdp_size set
    to a node where that is faster), then the digen search's own shape with one mechanism taken away: TAG (no lending
    of idle trainer devices), TSP (one train node per timestep), GAP against a stage-synchronous trainer (the trainer
    takes the whole mini-batch once it is generated; the search picks the faster, so one of the two is digen's own
    figure), and TCSS (digen+tcss against digen); last, digen over colocated-hsdp, the hybrid-sharded
    baseline. `network_gbps` puts the clusters on that network per device (the cross-node sensitivity: the thin
    network fitted to veRL-Omni's 64-GPU run) instead of the catalogue's."""
    print(
        "| scenario | colocated | colocated-hsdp | disaggregated | digen | digen+tcss | digen, no TAG | digen, no TSP "
        "| digen's shape, GAP | digen's shape, stage-synchronous | digen / colocated-hsdp |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in DIGEN:
        scenario = on_network(load_scenario(name), network_gbps)
        rate = {}
        for label, policy, options, overrides in (
            ("colocated", "colocated", None, {}),
            ("colocated-hsdp", "colocated-hsdp", None, {}),
            ("disaggregated", "disaggregated", None, {}),
            ("digen", "digen", None, {}),
            ("digen+tcss", "digen+tcss", None, {}),
            ("no TAG", "digen", {"tag": False}, {}),
            ("no TSP", "digen", None, {"tsp_chunk": 1}),
            ("GAP", "digen", None, {"staged": False}),
            ("stage-synchronous", "digen", None, {"staged": True}),
        ):
            try:
                trace = (
                    ablated(scenario, policy, overrides, options=options)
                    if overrides
                    else simulate(scenario, policy, options=options)[1]
                )
                rate[label] = summarize(trace).samples_per_s
            except ValueError as error:
                rate[label] = str(error).split(";")[0][:50]
        base = rate["colocated"]
        cells = [
            f"{value:.3f} ({value / base:.2f}x)" if isinstance(value, float) else f"n/a: {value}"
            for value in rate.values()
        ]
        hsdp = rate["colocated-hsdp"]
        cells.append(
            f"{rate['digen'] / hsdp:.2f}x" if isinstance(hsdp, float) and isinstance(rate["digen"], float) else ""
        )
        print(f"| {name} | " + " | ".join(cells) + " |")


JIGSAW = ("jigsaw-qwen3-4b-8xh100", "jigsaw-mixed-0.6b-8b", "jigsaw-64xa100")


def on_network(scenario: Scenario, network_gbps: float | None) -> Scenario:
    """`scenario` with its cluster on `network_gbps` per device (None: as it is)."""
    if network_gbps is None:
        return scenario
    return scenario.model_copy(update={"cluster": scenario.cluster.model_copy(update={"network_gbps": network_gbps})})


def jigsaw(network_gbps: float | None = None) -> None:
    """Each LLM policy, then jigsaw's searched shapes with one mechanism taken away: migration of the long tail,
    streamed micro-batches; jigsaw-greedy is the ablation of the search and the look-ahead. Sharing devices between
    pipelines cannot be taken away alone (jigsaw places shareable nodes only); verl-sync is jigsaw's pool without
    it. `network_gbps` as in `digen`."""
    print(
        "| scenario | verl-sync | streamrl | areal | jigsaw-greedy | jigsaw | jigsaw, no migration "
        "| jigsaw, no streaming |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in JIGSAW:
        scenario = on_network(load_scenario(name), network_gbps)
        rate = {}
        for label, policy, overrides in (
            ("verl-sync", "verl-sync", {}),
            ("streamrl", "streamrl", {}),
            ("areal", "areal", {}),
            ("jigsaw-greedy", "jigsaw-greedy", {}),
            ("jigsaw", "jigsaw", {}),
            ("no migration", "jigsaw", {"migrate_at": None}),
            ("no streaming", "jigsaw", {"stream": False}),
        ):
            try:
                trace = ablated(scenario, policy, overrides) if overrides else simulate(scenario, policy)[1]
                rate[label] = summarize(trace).samples_per_s
            except (ValueError, RuntimeError) as error:
                rate[label] = str(error).split(";")[0][:50]
        base = rate["verl-sync"]
        cells = [
            f"{value:.2f} ({value / base:.2f}x)" if isinstance(value, float) else f"n/a: {value}"
            for value in rate.values()
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


PIPELINES_BASE = "jigsaw-qwen3-0.6b-16xh100"
"""The scenario whose pipeline `pipelines` copies N times on its pool (issue 21's probe)."""


def pipelines() -> None:
    """jigsaw against verl-sync with N = 1..16 pipelines on 16 H100s (3 steps), and how long jigsaw takes to plan and
    simulate them (its search included) on this machine."""
    print(
        "| pipelines | verl-sync samples/s | jigsaw samples/s | jigsaw / verl-sync | jigsaw's arrangement | jigsaw s |"
    )
    print("|---|---|---|---|---|---|")
    base = load_scenario(PIPELINES_BASE).model_dump(mode="python", exclude_none=True)
    (pipeline,) = base["pipelines"]
    for n in range(1, 17):
        scenario = parse_scenario(
            base | {"name": f"qwen3-0.6b-x{n}-16xh100", "pipelines": [pipeline | {"name": f"p{i}"} for i in range(n)]},
            f"{PIPELINES_BASE} x{n}",
        )
        verl = summarize(simulate(scenario, "verl-sync")[1]).samples_per_s
        start = time.perf_counter()
        prepared, trace = simulate(scenario, "jigsaw")
        seconds = time.perf_counter() - start
        jigsaw = summarize(trace).samples_per_s
        pools = sorted({pool for pool in prepared.policy.pool.values()})
        arrangement = (
            "whole pool"
            if len(pools) == 1
            else f"{len(pools)} sub-pools of {'/'.join(sorted({str(len(p)) for p in pools}))} devices"
        )
        print(f"| {n} | {verl:.2f} | {jigsaw:.2f} | {jigsaw / verl:.2f}x | {arrangement} | {seconds:.1f} |")


def short_lm(devices: int, sigma: float) -> Scenario:
    """sort's shape at a GPU model's scale: Qwen3-0.6B, 32 prompts x 8, lognormal lengths around 300 tokens (sigma
    0.3: no tail to speak of; 0.8: the published traces' tail) up to 1024, 4 micro-batches, on `devices` H100s."""
    data = load_scenario("jigsaw-qwen3-0.6b-16xh100").model_dump(mode="python", exclude_none=True)
    data["cluster"] = {"device": "H100", "devices": devices}
    lengths = {"kind": "lognormal", "median": 300, "sigma": sigma}
    data["pipelines"] = [data["pipelines"][0] | {"group": 8, "lengths": lengths, "max_length": 1024}]
    return parse_scenario(data, f"qwen3-0.6b-short@{devices}")


def two_devices() -> None:
    """Issue 19's two-device targets as the simulator sees them on H100s: each policy's steady step on 2 GPUs against
    the one-GPU run its target compares with: the reference's work, every stage on one device and no old-log-prob
    recompute (`digen`'s shape on one GPU for a flow model, `verl-sync` on one for a language model), for Qwen-Image
    (veRL-Omni's FlowGRPO recipe) and a Qwen3-0.6B GRPO job of sort's shape."""
    rows = [
        ("Qwen-Image FlowGRPO", lambda n: resized("calib-qwenimage-64xh100", n, "H100"), "digen", "digen"),
        ("Qwen-Image FlowGRPO", lambda n: resized("calib-qwenimage-64xh100", n, "H100"), "digen", "colocated"),
        ("Qwen-Image FlowGRPO", lambda n: resized("calib-qwenimage-64xh100", n, "H100"), "digen", "disaggregated"),
        ("Qwen3-0.6B GRPO, sigma 0.3", lambda n: short_lm(n, 0.3), "verl-sync", "verl-sync"),
        ("Qwen3-0.6B GRPO, sigma 0.8", lambda n: short_lm(n, 0.8), "verl-sync", "verl-sync"),
    ]
    print("| job | policy on 2 GPUs | step (s) | one GPU (its policy) | step (s) | speedup |")
    print("|---|---|---|---|---|---|")
    for job, scenario, alone, policy in rows:
        one = summarize(simulate(scenario(1), alone, steps=3)[1]).steady_step_s
        two = summarize(simulate(scenario(2), policy, steps=3)[1]).steady_step_s
        print(f"| {job} | {policy} | {two:.1f} | {alone} | {one:.1f} | {one / two:.2f}x |")


SECTIONS = {
    "calibration": calibration,
    "dancegrpo": dancegrpo,
    "scaling": scaling,
    "digen": digen,
    "digen-thin": lambda: digen(network_gbps=THIN_NETWORK_GBPS),
    "jigsaw": jigsaw,
    "jigsaw-thin": lambda: jigsaw(network_gbps=THIN_NETWORK_GBPS),
    "pipelines": pipelines,
    "two-devices": two_devices,
}

if __name__ == "__main__":
    for section in sys.argv[1:] or list(SECTIONS):
        start = time.perf_counter()
        print(f"\n## {section}\n")
        SECTIONS[section]()
        print(f"\n({section}: {time.perf_counter() - start:.1f} s)")
