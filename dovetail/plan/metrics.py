"""Metrics read from a Trace: throughput, efficiency, bubbles, staleness, latency, memory, phases.

Efficiency = the share of the devices' time spent on required work at full speed: per device, the exclusive
device-seconds of the work it did (each node's work as the device would do it alone at full speed: `Span.work`;
interference slowdowns, role switches, a migration's re-prefill delay and idle time excluded), at most the time
something ran on it, summed over devices and divided by devices x makespan. So it is at most 1, and 1.0 means no
device ever waited, switched or was slowed. Co-located nodes that slow each other down by less than their number
(complementary sub-stages under the interference table) do more than one device-second of exclusive work per busy
second: that gain shows in throughput, while efficiency counts such a second once. A device is busy while
anything runs on it, whatever share that node reserved; bubble = neither busy nor switching.

Every figure a training run reports has one name and one meaning; a test holds every key of a run's
metrics.jsonl and summary.json to this table (`<...>` stands for any name).

metrics.jsonl, one line per step (Ray: only under a Ray policy; flow / LM: of that pipeline kind):
  step                  optimizer steps done, this one included
  reward/<name>         mean over the step's samples of each reward; reward/total of their weighted sum (an env
                        run's: reward/env, the environment's, plus the named rewards' weighted sum)
  loss                  the loss the step descends: mean over the trained pairs (flow), the summed token losses over
                        the step's normaliser (LM)
  clip_frac             share of trained pairs / tokens whose ratio the PPO clip cut
  reward_std            LM: standard deviation of the step's total rewards (TRL's name)
  frac_reward_zero_std  LM: share of prompt groups whose rewards are all equal: no GRPO signal, advantage 0 (TRL's)
  approx_kl             mean approximate KL between the behaviour and trained policies
  ratio_mean            mean importance ratio (1 when on-policy)
  ratio_min             smallest importance ratio of the step
  ratio_max             largest importance ratio of the step
  kl_ref                mean KL to the reference (base) model, when algo.beta > 0
  optimality_mean       flow, algorithm diffusion_nft: mean optimality probability r of the trained pairs (1/2 where
                        every advantage is 0)
  old_deviation         flow, algorithm diffusion_nft: mean |v_theta - v_old|^2 of the trained pairs, the trained
                        velocity's distance from the old (sampling) policy's
  entropy               LM: mean token entropy of the responses
  logprob_gap           LM, where old log-probs are recomputed (sampling.engine=vllm; policy areal): mean |engine's
                        log-prob - the trainer's recomputed one| per response token (areal's stale samples: with drift)
  critic/vf_loss        LM PPO (algo.advantage=gae): the critic's clipped value loss, over the step's normaliser
  critic/vf_clipfrac    LM PPO: share of response tokens whose clipped value error was the larger (verl's name)
  critic/vpred_mean     LM PPO: the critic's mean value of a response token (verl's name)
  response_tokens       LM: tokens of the step's responses (an env run's: the tokens its model sampled, which train)
  completions/mean_length  LM: mean tokens of a response (TRL's names, these three)
  completions/min_length   LM: the step's shortest response, in tokens
  completions/max_length   LM: the step's longest response, in tokens
  completions/clipped_ratio  LM, single-turn: share of responses that used all of sampling.max_new_tokens, cut off
                        rather than ended (verl's response_length/clip_ratio)
  env/turns             LM env run: mean model turns per episode (each answered by the environment)
  env/tool_calls        LM env run: mean tool calls per episode (malformed ones included)
  env/tool_errors       LM env run: mean tool results per episode that say "error: ..." (a malformed call, an unknown
                        tool, a bad argument, a tool's limit)
  env/unfinished        LM env run: share of episodes cut by env.max_turns or the token budget before their
                        environment ended them
  env/wait_s            LM env run: seconds the rollout slept with every unfinished trajectory waiting on its
                        environment (its latency), nothing left to decode (on the Ray runtime: summed over its engines)
  dynamic_sampling/draws    LM with algo.dynamic_sampling: batches of B prompts the step drew
  dynamic_sampling/groups   LM with algo.dynamic_sampling: groups whose rewards differ that the step kept, over B
  dynamic_sampling/dropped  LM with algo.dynamic_sampling: groups the step drew whose rewards were all equal
  update_<k>/<name>     with algo.num_iterations: update k's (k >= 2) grad_norm, loss, clip_frac, ratio_mean,
                        ratio_min, ratio_max, approx_kl (the names above are the step's first update's)
  timesteps             flow: the denoising steps the step trained
  grad_norm             the step's gradient norm before clipping
  learning_rate         the lr the step's optimizer step took (train.lr_schedule, train.warmup_steps; TRL's name)
  commit_sync_s         Ray: seconds the step's commit spent adding the trainer devices' gradients together (the
                        all-reduce, the wait for the slowest device included), on the first replica that answered
  commit_optimizer_s    Ray: seconds that commit then spent on the clip and the optimizer step
  <kind>_s              device-seconds of the step's work of that kind (generate, prefill, decode, migrate, score,
                        logprob, train, commit; PPO's critic: values, train_critic): summed over the devices that
                        did it, so under a Ray policy the kinds together can exceed step_s; policy reference: its one
                        device's wall time
  step_s                wall seconds of the step: since the previous step's commit (reference: its phases end to end)
  samples_per_s         samples the step trained per wall second: its samples over step_s
  eval_reward           on evaluation steps, the held-out total (flow: mean reward of ODE samples; LM: success rate)
  eval/<name>           each score of that evaluation (eval/total is eval_reward)
  eval/reward/<name>    LM: each reward's mean over that evaluation's responses (an env run's environment: env)
  eval_s                wall seconds the evaluation took (training waits for it)
  occupancy             Ray: mean over devices of the time-weighted share of each device that running nodes reserved
                        during the step (not efficiency: slowed and overlapping work counts in full)
  occupancy_per_device  Ray: that share, device by device
  staleness             Ray: versions between the weights that generated the step's samples and those that trained them
  publish_bytes         Ray: bytes of one weight publication
  publish_s             Ray: seconds the latest weight publication took (a step's own comes after its commit)
  tag_decisions         Ray, a policy that assists generation (digen): trainer-assisted generation decisions taken
                        since the previous step
  memory_bytes_per_device  per device (reference: its one), the bytes it held by kind, counted from its tensors:
                        parameters (the trainer's weights), gradients (the trainer's and the fp64 train parts a
                        commit adds), optimizer (AdamW's moments and step counts), rollout (the rollout engine's own
                        weights and KV cache), and peak (the process's peak resident set; on a GPU, torch's peak
                        allocation); Ray: the trainer devices' at their commit, the others' after their last work
                        (null: a device that did not answer)
  memory_peak_bytes     the largest peak of the step's devices: what the run's devices must hold

summary.json, once per pipeline (a multiplexed run: under pipelines, and the Ray figures at the top):
  base_eval_reward      the evaluation's total before the run's first step (a resumed run: its run's)
  base_eval             every score of that evaluation
  final_eval_reward     the last evaluation's total
  steps                 the step the run ended at
  samples_per_s         samples the run trained per wall second of its steps: all over the sum of step_s (what the
                        progress display shows after each step, for the steps so far)
  notes                 what summary.json's and metrics.jsonl's less obvious figures count, in words
  startup_s             wall seconds from the command's start (`dovetail train`; from the call, through the API) to
                        the first step's start, apart from every step: imports, checks, model load, the base
                        evaluation; Ray: also the instance, the device workers, their start-up profile
                        (read from the cache when this machine ran the config before), the plan and, under
                        cluster.publication=auto with devices on several nodes, both publication paths timed
  devices_lost          Ray: devices the run went on without (no node for cluster.lost_after_s; docs/cluster.md)
  efficiency            Ray: the trace's efficiency over the run, as defined above (Metrics.efficiency)
  bubble_ratio          Ray: mean over devices of the share of the run neither busy nor switching
  step_time_s           Ray: the trace's makespan over the steps (start-up excluded, the last publish included;
                        `dovetail simulate --from-run` compares the time to the last optimizer step instead)
  max_staleness         Ray: the largest staleness of any trained sample
  restarts              Ray: workers that restarted during the run
  device_engines        Ray: the engines each device held at the end, per pipeline (null: a device was lost after the
                        last step)
  publication           Ray, per pipeline: how published weights reached the rollout devices (cluster.publication):
                        the setting, the path it resolved to, under auto both paths' start-up timings (object_store_s,
                        collective_s: one publication from device 0 to the other nodes' devices; null on one node),
                        and the rollout devices' loads by the path their weights came (loads)
  stopped               a pipeline whose reward failed: what it said
  pipelines             a multiplexed run: each pipeline's summary
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass

from dovetail.plan.trace import Trace

SUMMARY_NOTES = {
    "<kind>_s": "metrics.jsonl's generate_s, train_s...: device-seconds, summed over the devices that did the work, so "
    "under a Ray policy they can add up to more than step_s",
    "samples_per_s": "samples trained per wall second of the steps (all samples over the sum of step_s), as the "
    "progress display shows it for the steps so far; a step's own is in metrics.jsonl",
}
"""summary.json's `notes`: what its figures and metrics.jsonl's count, where a reader meets them."""


@dataclass(frozen=True)
class Metrics:
    makespan_s: float
    steps: int
    step_time_s: float
    """Makespan / steps: the first step's warm-up (nothing to overlap yet) included."""
    first_step_s: float
    """Seconds to the first optimizer step (of the pipeline that commits last)."""
    steady_step_s: float
    """Seconds between optimizer steps after the first: the step time a long run settles to (for a one-step trace,
    the first step's). An asynchronous policy's is below `step_time_s`; compare published runs on this one."""
    samples_per_s: float
    tokens_per_s: float
    efficiency: float
    bubble_ratio: float
    switch_ratio: float
    busy_ratio_per_device: list[float]
    bubble_ratio_per_device: list[float]
    max_staleness: int
    staleness_histogram: dict[int, int]
    """Staleness (versions) -> number of samples trained with it."""
    step_latency_s: dict[str, float]
    """Mean time from a step's first node to its optimizer step, per pipeline."""
    peak_memory_gb: float
    peak_memory_gb_per_device: list[float]
    phase_seconds: dict[str, float]
    """Device-seconds per node kind (and `switch`) divided by devices: wall time when phases don't overlap."""

    def to_json(self) -> dict:
        return asdict(self)


def summarize(trace: Trace) -> Metrics:
    if not trace.steps:
        raise ValueError("the trace has no committed step; nothing to measure")
    devices = trace.devices
    makespan = trace.makespan
    intervals: list[list[tuple[float, float]]] = [[] for _ in range(devices)]
    work = [0.0] * devices
    switching = [0.0] * devices
    phases: dict[str, float] = defaultdict(float)
    keep = [device_intervals.append for device_intervals in intervals]
    for span in trace.spans:  # one pass over every device's spans: a large pool's trace holds many
        device, done = span.device, span.work
        keep[device]((span.start, span.end))
        work[device] += done
        phases[span.kind] += done / devices
    for switch in trace.switches:
        switching[switch.device] += switch.end - switch.start
        phases["switch"] += (switch.end - switch.start) / devices
    staleness: Counter[int] = Counter()
    latency: dict[str, list[float]] = {}
    for record in trace.steps:
        staleness[record.step - record.rollout_version] += record.samples
        latency.setdefault(record.pipeline, []).append(record.end - record.start)
    steps_per_pipeline = max(len(values) for values in latency.values())
    commits: dict[str, list[float]] = {}
    for record in trace.steps:
        commits.setdefault(record.pipeline, []).append(record.end)
    first = max(min(ends) for ends in commits.values())
    steady = max((max(ends) - min(ends)) / (len(ends) - 1) if len(ends) > 1 else min(ends) for ends in commits.values())
    busy = [_covered(spans) for spans in intervals]
    busy_ratio = [b / makespan for b in busy]
    bubble = [max(0.0, 1.0 - (b + s) / makespan) for b, s in zip(busy, switching)]
    return Metrics(
        makespan_s=makespan,
        steps=len(trace.steps),
        step_time_s=makespan / steps_per_pipeline,
        first_step_s=first,
        steady_step_s=steady,
        samples_per_s=sum(r.samples for r in trace.steps) / makespan,
        tokens_per_s=sum(r.tokens for r in trace.steps) / makespan,
        efficiency=sum(min(w, b) for w, b in zip(work, busy)) / (devices * makespan),
        bubble_ratio=sum(bubble) / devices,
        switch_ratio=sum(switching) / (devices * makespan),
        busy_ratio_per_device=busy_ratio,
        bubble_ratio_per_device=bubble,
        max_staleness=max(staleness),
        staleness_histogram=dict(sorted(staleness.items())),
        step_latency_s={p: sum(v) / len(v) for p, v in sorted(latency.items())},
        peak_memory_gb=max(trace.peak_memory_gb),
        peak_memory_gb_per_device=list(trace.peak_memory_gb),
        phase_seconds=dict(sorted(phases.items())),
    )


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def time_per_step(trace: Trace) -> float:
    """Seconds from the start to the last optimizer step, per step of a pipeline: what `dovetail simulate --from-run`
    measures and predicts. summary.json's `step_time_s` (the makespan per step) also counts the run's final weight
    publish, after that optimizer step."""
    steps = max(Counter(record.pipeline for record in trace.steps).values())
    return max(record.end for record in trace.steps) / steps
