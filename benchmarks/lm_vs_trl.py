"""dovetail's LM GRPO against TRL's `GRPOTrainer` on the same work, side by side: how `verl-sync` on 2 devices
compares with the plainest competent alternative a user runs today.

    .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install transformers==5.24.0 -e '.[bench]'
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/lm_vs_trl.py --steps 10 --repeats 3 --out runs/lm-vs-trl
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/lm_vs_trl.py --check-gradient   # seconds: the update's one difference

(torch first and pinned: else pip pulls a CUDA build of gigabytes for TRL; HF_HUB_OFFLINE: no hub call or TRL
telemetry, the arrangements' processes get it in any case.) Prints a Markdown table for BENCHMARKS.md.

Arrangements, each in a fresh process (no threads or Ray instance outlive it), `--repeats` rounds of all four, each
round starting one further along so that the machine's drift falls on all alike: dovetail `reference` (one process,
one torch thread); dovetail `verl-sync` on 2 local Ray devices (configs/sort.yaml as shipped); TRL `GRPOTrainer` with
`torch.set_num_threads(1)`; the same with 2 threads. Every process is confined to the same cores, the first
`cluster.devices` (2) the script may use: verl-sync's device workers pin themselves to those two and its driver and
Ray's own processes share them, as TRL's 2 threads do.

The same work: configs/sort.yaml's. The sort task's tiny Llama (TRL loads it as `dovetail export` writes it: a
transformers directory, the character tokenizer as a `PreTrainedTokenizerFast`, transformers' default attention);
B = 32 prompts x G = 8 samples a step at temperature 1, up to the task's max response tokens; one optimizer step per
batch in 2 micro-batches of 128 (`steps_per_generation == gradient_accumulation_steps`, `num_iterations=1`); DAPO's
token-level loss, clip 0.2 / 0.28, beta 0 (no reference model); AdamW with dovetail's lr, betas, eps and weight decay
(read from dovetail's own optimizer), its grad-norm clip, a constant lr; the task's train prompts in dovetail's order
(TRL's dataset is `RunPrompts` of the timed steps, unshuffled, and its reward function checks each batch holds them);
dovetail's reward (`score_text`) as TRL's reward function. TRL runs in fp32 on the CPU with two defaults that would
change the work switched off: bf16, and gradient checkpointing (a recomputed forward to save memory a 1.3 M parameter
model does not need); report_to none, no saving, no evaluation.

What TRL 1.16.0's source says (trl/trainer/grpo_trainer.py), checked: with those settings
`_generate_and_score_completions` runs no old-log-prob pass and `_compute_loss` takes the policy's own detached
log-probs as the old ones, as dovetail does; `loss_type="dapo"` divides each micro-batch's token sum by the whole
batch's tokens, so the two add up to dovetail's token mean over the step (`loss_is_scaled_for_ga`: no further
division). The one difference in the update: TRL's advantages are (r - group mean) / (group std + 1e-4) with the
sample std (n - 1, `nanstd`), dovetail's (`algo.grpo.group_advantages`) with the population std (n), so TRL's are
about sqrt(7/8) of dovetail's at G = 8: a constant scale that Adam undoes but for eps, and for the grad-norm clip
(1.0) where it binds (metrics.jsonl's grad_norm says whether). `--check-gradient` shows it on one batch TRL
generates: with dovetail's advantages TRL's gradient is dovetail's up to fp32 rounding, with its own sqrt(7/8) of it,
the same direction. (dovetail's advantage clip at +-5 never binds at G = 8: at most sqrt(7).) How the same update is
computed differs, and is what is measured: TRL samples the 256 responses with `model.generate`, one left-padded batch
decoding until its longest response ends, dovetail with its own engine (continuous batching); TRL's micro-batches are
shuffled rows padded to their longest, dovetail trains a prompt's group at a time and adds the groups' gradients in
fp64. The two sample the same distribution from different random streams: responses, lengths and rewards differ step
by step, not on average (the table's columns show it).

Outside the steps: dovetail always evaluates before the first step and after the last (one held-out prompt each
here) and saves a checkpoint at the end; verl-sync's start-up starts Ray and profiles its devices, measured on a
machine's first run of this config and read from dovetail's cache (~/.cache/dovetail) after that.

Figures, each the median over the rounds. Step time: the median over the steps after the first (which warms up);
dovetail's is its metrics.jsonl `step_s` (`reference`: its phases end to end; `verl-sync`: commit to commit), TRL's
the time between consecutive `on_step_end` callbacks (all it does between two optimizer steps). A row's JSON also has
dovetail's time between its own step callbacks, bookkeeping included (`step_by_clock_s`, steps 2 to N-1: the last one
evaluates and saves). samples/s: B x G over it, with its range over the rounds; the speedup against TRL on 2 threads,
against dovetail's reference and against the same framework on 1 core beside the physical limit (the cores used).
Start-up: from the process's launch (imports included) to the first step's start. Wall: launch to exit. Response
tokens: the mean length (eos included) over all steps. Reward: the training reward of step 1 and of the last 3.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from runtime_policies import read_steps, steady_figures
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from dovetail import train
from dovetail.algo import group_advantages
from dovetail.config.load import load_config
from dovetail.graph.node import SampleId
from dovetail.models.causal_lm import export_builtin_lm
from dovetail.models.engine import Request
from dovetail.models.lm_rl import policy_gradient
from dovetail.models.training import flat_gradient, make_optimizer
from dovetail.pipelines.lm.model import load_policy
from dovetail.pipelines.lm.prompts import RunPrompts
from dovetail.rewards.text import score_text

SORT_YAML = Path(__file__).resolve().parents[1] / "configs" / "sort.yaml"
ARRANGEMENTS = {  # name: (framework, cores its compute uses)
    "reference": ("dovetail", 1),
    "verl-sync": ("dovetail", 2),
    "trl-1-thread": ("trl", 1),
    "trl-2-threads": ("trl", 2),
}
LAST_STEPS = 3  # the final reward: the mean training reward of this many last steps


def workload(policy: str, steps: int):
    """configs/sort.yaml's run under `policy`: no evaluation or checkpoint before the last step, and one held-out
    prompt in the evaluations dovetail always makes (before the first step, after the last)."""
    return load_config(
        SORT_YAML, [f"policy={policy}", f"eval.every={steps + 1}", "eval.prompts=1", f"checkpoint.every={steps + 1}"]
    )


class Clock(TrainerCallback):
    """Wall-clock time (time.time(), comparable with the launching process's) when the first step starts (TRL) and
    as each step ends (TRL's `on_step_end`, dovetail's `on_step`)."""

    def __init__(self):
        self.begin: float | None = None
        self.ends: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin = self.begin or time.time()

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.time())

    def on_step(self, metrics, pipeline):
        self.ends.append(time.time())


def run_dovetail(policy: str, steps: int, out: Path, launched: float) -> dict:
    """The workload under a dovetail policy; its step figures from its metrics.jsonl (runtime_policies' reading)."""
    config = workload(policy, steps)
    samples = config.algo.prompts_per_step * config.algo.group_size
    clock = Clock()
    called = time.time()
    summary = train(config, out=out / "run", steps=steps, overwrite=True, callbacks=[clock])
    lines = read_steps(out / "run")
    between = [b - a for a, b in zip(clock.ends, clock.ends[1:])][:-1]  # the last step's callback follows its eval
    return {
        **steady_figures(lines[1:], samples),
        "step_by_clock_s": statistics.median(between) if between else None,
        "startup_s": called - launched + summary["startup_s"],
        "response_tokens": statistics.mean(m["response_tokens"] for m in lines) / samples,
        "rewards": [m["reward/total"] for m in lines],
    }


def trl_arguments(config, model, steps: int, out: Path):
    """TRL's GRPOConfig of the workload (module docstring), its AdamW settings read from dovetail's optimizer of
    `model`; fails where the config asks for what these arguments do not map (another loss aggregation or std scope,
    an entropy bonus, a KL)."""
    from trl import GRPOConfig

    algo, samples = config.algo, config.algo.prompts_per_step * config.algo.group_size
    mapped = {"aggregation": "token", "std_scope": "group", "entropy_coef": 0.0, "beta": 0.0}
    if any(getattr(algo, key) != value for key, value in mapped.items()):
        raise SystemExit(f"the TRL arguments here map algo {mapped} only; {SORT_YAML} has {algo}")
    adam = make_optimizer(model, config.train).defaults  # dovetail's AdamW: lr, betas, eps, weight decay
    return GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,  # TRL's default is on (as gradient_checkpointing, its old name)
        seed=config.seed,
        max_steps=steps,
        per_device_train_batch_size=samples // algo.micro_batches,
        gradient_accumulation_steps=algo.micro_batches,
        steps_per_generation=algo.micro_batches,  # one generation of B x G per optimizer step
        num_iterations=1,
        num_generations=algo.group_size,
        max_completion_length=config.max_new_tokens,
        temperature=config.sampling.temperature,
        top_p=config.sampling.top_p,
        learning_rate=adam["lr"],
        lr_scheduler_type="constant",
        optim="adamw_torch",
        adam_beta1=adam["betas"][0],
        adam_beta2=adam["betas"][1],
        adam_epsilon=adam["eps"],
        weight_decay=adam["weight_decay"],
        max_grad_norm=config.train.max_grad_norm,
        loss_type="dapo",
        epsilon=algo.clip_low,
        epsilon_high=algo.clip_high,
        beta=algo.beta,
        scale_rewards="group",
        shuffle_dataset=False,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        dataloader_num_workers=0,
    )


def reward_for_trl(config, batches: list[dict]):
    """dovetail's reward of the task (its weighted total) as TRL calls a reward function, once per generated batch:
    it checks the batch holds dovetail's prompts of that step, in order, and appends the batch's mean reward and
    response length (tokens up to and including eos, as dovetail counts them) to `batches`."""
    prompts_of = RunPrompts(config)

    def dovetail_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **_) -> list:
        if prompts[:: config.algo.group_size] != [row.prompt for row in prompts_of.step(len(batches))]:
            raise RuntimeError(f"TRL's step {len(batches) + 1} has other prompts than dovetail's")
        total = score_text(completions, prompts, config.rewards, config.reward_timeout_s)["total"]
        batches.append({"reward": float(total.mean()), "tokens": statistics.mean(map(len, completion_ids))})
        return total.tolist()

    return dovetail_reward


def run_trl(threads: int, steps: int, out: Path, launched: float, model_dir: Path) -> dict:
    """The workload under TRL's GRPOTrainer on `threads` torch threads, timed by its step callbacks."""
    try:
        from datasets import Dataset
        from trl import GRPOTrainer
    except ImportError as error:
        raise SystemExit(f"{error}: install the bench extra, pip install -e '.[bench]'") from None
    torch.set_num_threads(threads)
    config = workload("reference", steps)
    samples = config.algo.prompts_per_step * config.algo.group_size
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = RunPrompts(config)
    batches: list[dict] = []
    clock = Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_for_trl(config, batches),
        args=trl_arguments(config, model, steps, out),
        train_dataset=Dataset.from_dict({"prompt": [row.prompt for s in range(steps) for row in prompts.step(s)]}),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[clock],
    )
    trainer.train()
    assert clock.begin is not None
    steps_s = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    return {
        "samples_per_s": statistics.median(samples / s for s in steps_s),
        "step_s": statistics.median(steps_s),
        "tokens_per_s": statistics.median(b["tokens"] * samples / s for b, s in zip(batches[1:], steps_s)),
        "step_by_clock_s": statistics.median(steps_s),
        "startup_s": clock.begin - launched,
        "response_tokens": statistics.mean(b["tokens"] for b in batches),
        "rewards": [b["reward"] for b in batches],
        "attention": model.config._attn_implementation,
        "threads": torch.get_num_threads(),
        "checkpointing": trainer.model.is_activation_checkpointing,
    }


def check_gradient(model_dir: Path, out: Path) -> dict:
    """The module docstring's claim on one batch TRL generates: TRL's gradient (its micro-batches through
    `_compute_loss`) against dovetail's (`policy_gradient`) on the same prompts, responses and rewards, with TRL's
    advantages and with dovetail's. Uses TRL's private methods: it checks the pinned TRL version."""
    from datasets import Dataset
    from trl import GRPOTrainer
    from trl.trainer.utils import split_tensor_dict

    torch.set_num_threads(1)
    config = workload("reference", 1)
    algo = config.algo
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows, rewards, score = RunPrompts(config).step(0), [], reward_for_trl(config, [])

    def dovetail_reward(**kwargs) -> list:
        rewards[:] = score(**kwargs)
        return rewards

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=dovetail_reward,
        args=trl_arguments(config, model, 1, out),
        train_dataset=Dataset.from_dict({"prompt": [row.prompt for row in rows]}),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    model.train()
    inputs = [{"prompt": row.prompt} for row in rows for _ in range(algo.group_size)]
    batch = trainer._generate_and_score_completions(inputs)
    ids = [SampleId(0, i // algo.group_size, i % algo.group_size) for i in range(len(rewards))]

    def tokens(kind: str, i: int) -> list[int]:
        return batch[f"{kind}_ids"][i][batch[f"{kind}_mask"][i].bool()].tolist()

    def trl_gradient(advantages: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        trainer.current_gradient_accumulation_steps = algo.micro_batches
        for part in split_tensor_dict(batch | {"advantages": advantages.float()}, algo.micro_batches):
            trainer._compute_loss(model, part).backward()
        return flat_gradient(model).double()

    requests = {s: Request(s, tokens("prompt", i), tokens("completion", i)) for i, s in enumerate(ids)}
    summed, _, normaliser = policy_gradient(
        load_policy(config)[0],
        requests,
        dict(zip(ids, rewards)),
        {},
        {},
        algo=algo,
        temperature=config.sampling.temperature,
        max_new_tokens=config.max_new_tokens,
        stale=False,
    )
    ours = summed / normaliser
    advantages = group_advantages(
        torch.tensor(rewards), torch.tensor([s.prompt for s in ids]), std_scope=algo.std_scope, clip=algo.adv_clip
    )
    theirs, with_ours = trl_gradient(batch["advantages"]), trl_gradient(advantages)
    return {
        "old_log_prob_pass": "old_per_token_logps" in batch,
        "loss_tokens": [normaliser, float(batch["num_items_in_batch"])],
        "relative_difference_with_dovetail_advantages": float((with_ours - ours).norm() / ours.norm()),
        "norm_ratio_with_trl_advantages": float(theirs.norm() / ours.norm()),
        "cosine_with_trl_advantages": float(theirs @ ours / theirs.norm() / ours.norm()),
        "sqrt(7/8)": (7 / 8) ** 0.5,
    }


def launch(name: str, steps: int, out: Path, model_dir: Path) -> dict:
    """Arrangement `name` in a fresh process (its output in out/log.txt): its figures and wall-clock seconds."""
    out.mkdir(parents=True, exist_ok=True)
    launched = time.time()
    command = [sys.executable, __file__, "--child", name, "--steps", str(steps), "--out", str(out)]
    command += ["--model", str(model_dir), "--launched", repr(launched)]
    with open(out / "log.txt", "w") as log:
        env = os.environ | {"HF_HUB_OFFLINE": "1"}
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    wall = time.time() - launched
    if code != 0:
        raise SystemExit(f"{name} exited with {code}; its output is in {out / 'log.txt'}")
    return json.loads((out / "result.json").read_text()) | {"wall_s": wall}


def table(rounds: dict[str, list[dict]]) -> str:
    """The Markdown table: each figure's median over the rounds."""

    def median(name: str, key: str) -> float:
        return statistics.median(row[key] for row in rounds[name])

    def speedup(name: str, base: str) -> str:
        return f"{median(name, 'samples_per_s') / median(base, 'samples_per_s'):.2f}x" if base in rounds else "—"

    one_core = {framework: name for name, (framework, cores) in ARRANGEMENTS.items() if cores == 1}
    lines = [
        "| arrangement | cores | step (s) | samples/s (median, range) | vs TRL 2 threads | vs dovetail reference "
        "| vs its 1-core run | limit | start-up (s) | wall (s) | response tokens "
        f"| reward: step 1 -> last {LAST_STEPS} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in rounds.items():
        framework, cores = ARRANGEMENTS[name]
        scaling = speedup(name, one_core[framework]) if cores > 1 else "—"
        rates = [row["samples_per_s"] for row in rows]
        first = statistics.median(row["rewards"][0] for row in rows)
        last = statistics.median(statistics.mean(row["rewards"][-LAST_STEPS:]) for row in rows)
        lines.append(
            f"| {name} | {cores} | {median(name, 'step_s'):.3f} | {statistics.median(rates):.1f} "
            f"({min(rates):.1f}-{max(rates):.1f}) | {speedup(name, 'trl-2-threads')} | {speedup(name, 'reference')} | "
            f"{scaling} | {cores}x | {median(name, 'startup_s'):.1f} | "
            f"{median(name, 'wall_s'):.1f} | {median(name, 'response_tokens'):.1f} | {first:.3f} -> {last:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (at least 2)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every arrangement")
    parser.add_argument("--out", type=Path, default=Path("runs/lm-vs-trl"))
    parser.add_argument("--arrangements", default=",".join(ARRANGEMENTS), help=f"comma-separated: {list(ARRANGEMENTS)}")
    parser.add_argument(
        "--check-gradient", action="store_true", help="compare TRL's gradient with dovetail's on one batch instead"
    )
    parser.add_argument("--child", choices=ARRANGEMENTS, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the figures are medians over the steps after the first")
    if args.child:  # one arrangement, in the process `launch` started
        framework, cores = ARRANGEMENTS[args.child]
        if framework == "trl":
            result = run_trl(cores, args.steps, args.out, args.launched, args.model)
        else:
            result = run_dovetail(args.child, args.steps, args.out, args.launched)
        (args.out / "result.json").write_text(json.dumps(result))
        return
    names = args.arrangements.split(",")
    unknown = sorted(set(names) - set(ARRANGEMENTS))
    if unknown:
        parser.error(f"unknown arrangements {unknown}; known: {list(ARRANGEMENTS)}")
    config = workload("reference", args.steps)
    if hasattr(os, "sched_setaffinity"):  # every arrangement on the cores verl-sync's devices take
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: config.cluster.devices])
    model_dir = args.out / "sort-lm-transformers"
    export_builtin_lm(*load_policy(config), model_dir)  # what `dovetail export` writes: what TRL loads
    if args.check_gradient:
        print(json.dumps(check_gradient(model_dir, args.out / "check"), indent=2))
        return
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            row = launch(name, args.steps, args.out / str(repeat) / name, model_dir)
            rounds[name].append(row)
            print(json.dumps({"arrangement": name, "round": repeat} | row), flush=True)
    print()
    print(table(rounds))


if __name__ == "__main__":
    main()
