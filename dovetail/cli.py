"""The `dovetail` command: train, pretrain, simulate, plan, export, convert-clip, convert-imagereward.

Bad input (a config, a scenario, a flag) is one line on stderr naming the file, field or flag and the fix, exit
code 2, and nothing written."""

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer
from typer.exceptions import TyperException

from dovetail.config.common import policies_by_kind

if TYPE_CHECKING:  # the command imports what a subcommand needs when it runs
    from dovetail.request import RunRequest

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)


def _refuse(message: str) -> NoReturn:
    typer.echo(message, err=True)
    raise typer.Exit(2)


def _check_count(flag: str, value: int | None, most: int) -> None:
    """A count given on the command line (None: not given) lies in 1..most."""
    if value is not None and not 1 <= value <= most:
        _refuse(f"{flag} {value}: give a number from 1 to {most}")


@app.command()
def train(
    config: Path | None = typer.Argument(None, help="YAML config; omit for the defaults"),
    overrides: list[str] = typer.Argument(None, help="dotted overrides, e.g. train.lr=1e-4"),
    out: Path = typer.Option(
        None, help="run directory (default: runs/latest; with --resume, the resumed run's own directory)"
    ),
    steps: int = typer.Option(None, help="train up to this many steps (default: train.steps)"),
    resume: Path = typer.Option(
        None,
        help="RUN_DIR or RUN_DIR/checkpoints/step_NNNNNN to continue, in place (a different --out continues a copy "
        "there); without a CONFIG, RUN_DIR/config.yaml",
    ),
    policy: str = typer.Option(None, help=f"same as policy=...; by the config's kind: {policies_by_kind()}"),
    devices: int = typer.Option(None, help="devices for the Ray runtime (same as cluster.devices=...)"),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="check the config, checkpoint and devices, print the predicted plan; train nothing"
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="train afresh into an --out holding another run (its checkpoints move to superseded/)",
    ),
    reprofile: bool = typer.Option(
        False, "--reprofile", help="measure the devices again, not what a run of this config measured here before"
    ),
):
    """Post-train the model with RL and write a run directory.

    Ctrl-C, SIGTERM (kill, systemd, Kubernetes, SLURM) and SIGHUP stop after the step in flight and save it, exit
    code 130 / 143 / 129 (a second signal stops at once). A run that fails says why in one line; the traceback is in
    RUN_DIR/error.log."""
    began = time.perf_counter()
    from dovetail.config.load import check_this_machine
    from dovetail.graph.spec import MAX_DEVICES
    from dovetail.request import RunRequest

    if config is not None and "=" in str(config):
        overrides, config = [str(config), *(overrides or [])], None
    _check_count("--devices", devices, MAX_DEVICES)
    if policy is not None and not policy.strip():
        _refuse("--policy '': name a policy, e.g. --policy digen")
    flags = [f"policy={json.dumps(policy)}"] if policy is not None else []
    flags += [f"cluster.devices={devices}"] if devices is not None else []
    if dry_run:  # a dry run plans a run without its directory or this machine's devices: only the config is checked
        from dovetail.request import checked_config

        try:
            run_config = checked_config(config, [*(overrides or []), *flags], steps, flag="--")
        except ValueError as error:
            _refuse(str(error))
        _print_dry_run(run_config, run_config.train.steps)
        return
    try:  # refused at once, before Ray starts: the config, the run directory, the trackers, this machine's devices
        request = RunRequest.build(
            config,
            [*(overrides or []), *flags],
            out=out,
            steps=steps,
            resume=resume,
            overwrite=overwrite,
            reprofile=reprofile,
            began=began,
            flag="--",
        )
        check_this_machine(request.config)
    except (FileNotFoundError, ValueError) as error:  # ConfigError, RunDirInUse, TrackerMissing among them
        _refuse(str(error))
    _report(_run(request), request.out)


def _run(request: "RunRequest") -> dict:
    """Train `request` (its devices starting on a thread meanwhile); a failure is one line and its exit code."""
    from dovetail.rewards import RewardError
    from dovetail.run_dir import RunInterrupted
    from dovetail.runtime.ray_start import start_devices_in_background

    def start_devices(config):
        from dovetail.runtime.launch import start_devices_early

        return start_devices_early(config)

    try:
        # Ray, then the device workers (each importing its engines), start while this process imports torch and the
        # runner, checks the checkpoint and evaluates the base model: nothing above has imported torch
        devices_starting = start_devices_in_background(request.config, start_devices)
        from dovetail.runner import train as run_training

        return run_training(request, devices_starting=devices_starting)
    except (RewardError, RunInterrupted) as error:  # the message says what was saved and how to go on
        typer.echo(str(error), err=True)
        raise typer.Exit(error.exit_code if isinstance(error, RunInterrupted) else 1) from None
    except (FileNotFoundError, ValueError) as error:  # input the config could not check alone: a checkpoint, a prompt
        _refuse(str(error))
    except (Exception, KeyboardInterrupt) as error:  # any other failure: one line, the traceback in a log
        typer.echo(_failure(error, request.out), err=True)
        raise typer.Exit(130 if isinstance(error, KeyboardInterrupt) else 1) from None


def _report(summary: dict, out: Path) -> None:
    """Each pipeline's result in a line; a pipeline that stopped on its reward (the others went on) fails the run."""
    for name, pipeline in summary.get("pipelines", {"": summary}).items():
        typer.echo(
            f"{name + ': ' if name else ''}eval reward {pipeline['base_eval_reward']:.3f} -> "
            f"{pipeline['final_eval_reward']:.3f} after {pipeline['steps']} steps, "
            f"{pipeline['samples_per_s']:.1f} samples/s after {summary['startup_s']:.1f} s of start-up; "
            f"run in {out / name}"
        )
    for message in summary.get("stopped", {}).values():
        typer.echo(message, err=True)
    if summary.get("stopped"):
        raise typer.Exit(1)


def _failure(error: BaseException, out: Path) -> str:
    """One line for a run that failed: the cause, the fix, how to resume from what is saved; the traceback goes to
    out/error.log."""
    import traceback

    from dovetail.files import one_line
    from dovetail.run_dir import checkpoint_dirs, disk_full
    from dovetail.runtime.recovery import RecoveryTimeout

    log: Path | None = out / "error.log"
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "error.log").write_text("".join(traceback.format_exception(error)))
    except OSError:  # the disk that failed the run may be the one the log would go on
        log = None
    cause = one_line(error) or type(error).__name__
    if isinstance(error, KeyboardInterrupt):
        line = "stopped at once by a second Ctrl-C; the step in flight is lost"
    elif isinstance(error, MemoryError) or "out of memory" in cause.lower():
        line = (
            f"out of memory ({cause}): lower algo.prompts_per_step or algo.group_size, or train.chunk_size "
            "(pairs per forward/backward)"
        )
    elif disk_full(error):
        line = f"no space left on the device ({cause}): free space, or give an --out on another disk"
    elif isinstance(error, RecoveryTimeout):
        line = f"{cause}: workers that keep dying are out of memory or lost their node; check the Ray logs"
    elif type(error).__module__.startswith("ray"):
        line = f"the Ray runtime failed ({type(error).__name__}: {cause}): check the Ray cluster (`ray status`)"
    else:
        line = f"the run failed: {type(error).__name__}: {cause}"
    saved = out.is_dir() and (
        checkpoint_dirs(out / "checkpoints")
        or [found for sub in out.iterdir() if sub.is_dir() for found in checkpoint_dirs(sub / "checkpoints")]
    )
    if saved:
        line += f"; resume from the last saved step with `dovetail train --resume {out}`"
    return f"{line} (traceback in {log})" if log is not None else f"{line} (no room for the traceback)"


def _print_dry_run(config, steps: int) -> None:
    from dovetail.runtime.launch import dry_run

    try:
        plan = dry_run(config, steps)
    except (FileNotFoundError, ValueError) as error:
        _refuse(str(error))
    if plan["policy"] == "reference":
        typer.echo(
            "config and checkpoint OK; policy reference trains in this process, one stage after "
            "another (nothing to schedule)"
        )
        return
    if "shapes" in plan:  # several pipelines share every device
        cut = "; ".join(f"{name}: {_shape_line(shape)}" for name, shape in plan["shapes"].items())
        pools = "shared by every pipeline"
    else:
        cut = _shape_line(plan["shape"])
        pools = (
            f"{plan['rollout_devices']} rollout + {plan['trainer_devices']} trainer"
            if plan["rollout_devices"]
            else f"{plan['trainer_devices']} shared"
        )
        pools += f" + {plan['reward_devices']} reward" if plan["reward_devices"] else ""
    if plan["auto"] is not None:
        typer.echo(plan["auto"]["line"])
    typer.echo(
        f"policy {plan['policy']} on {plan['devices']}x {plan['device']} ({pools}): {cut}\n"
        f"predicted {plan['steady_step_s']:.3f} s/step steady (first step {plan['first_step_s']:.3f} s), "
        f"{plan['samples_per_s']:.1f} samples/s, "
        f"efficiency {plan['efficiency']:.3f}, "
        f"bubble {100 * plan['bubble_ratio']:.1f}%; {steps} steps in about {plan['run_s'] / 60:.1f} min of training\n"
        + (
            "(costs profiled on one core of this machine in this process; the run adds Ray's "
            "dispatch and object-store hops)"
            if plan["costs"] == "profiled"
            else "(analytic costs of the device catalogue; the run profiles its GPUs at start-up and plans again)"
        )
    )


def _shape_line(shape: dict) -> str:
    if "fragments" in shape:
        old = "recomputed" if shape["recompute_logprob"] else "from the rollout"
        return f"{shape['fragments']} fragments, TSP chunk {shape['tsp_chunk']}, old log-probs {old}"
    return f"{shape['shards']} rollout engines" + (", streaming micro-batches" if shape["stream"] else "")


@app.command()
def pretrain(
    dataset: str = typer.Argument(
        "digits", help="digits (the flow model) or a text task: sort, arithmetic, countdown, copy, calc, lookup"
    ),
    out: Path = typer.Option(None, help="checkpoint directory (default: the shipped base model)"),
    steps: int = typer.Option(None, help="optimizer steps (default: the shipped model's; short so RL has room)"),
    seed: int = typer.Option(0),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace the model already in --out"),
):
    """Pretrain a tiny base model from random init: the text-to-image flow model, or a task's language model."""
    import torch

    from dovetail.config.common import DEFAULT_CHECKPOINT, MAX_STEPS
    from dovetail.models.lm import checkpoint_dir
    from dovetail.tasks import TASKS

    _check_count("--steps", steps, MAX_STEPS)
    if dataset not in TASKS and dataset != "digits":
        _refuse(f"unknown dataset {dataset!r}; known: ['digits', {', '.join(map(repr, sorted(TASKS)))}]")
    out = out or (checkpoint_dir(dataset) if dataset in TASKS else DEFAULT_CHECKPOINT)
    if out.exists() and not out.is_dir():
        _refuse(f"--out {out}: is a file; give a directory for the model")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        _refuse(f"--out {out} already holds a model: give another --out, or --overwrite to replace it")
    torch.set_num_threads(1)
    if dataset in TASKS:
        from dovetail.models.lm_pretrain import pretrain_lm

        pretrain_lm(dataset, out, steps=steps, seed=seed)
        return
    from dovetail.models.pretrain import pretrain_digits

    pretrain_digits(out, steps=110 if steps is None else steps, seed=seed)


@app.command()
def simulate(
    scenario: str = typer.Argument(None, help="shipped scenario name or YAML path (see --list)"),
    policies: str = typer.Option(None, help="comma-separated policies; default: the scenario's schedule.policies"),
    steps: int = typer.Option(None, help="RL steps to simulate (default: schedule.steps)"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object instead of the table"),
    trace: Path = typer.Option(None, help="Chrome trace (Perfetto) file; one per policy when several"),
    gantt: Path = typer.Option(None, help="Gantt PNG; one per policy when several"),
    list_: bool = typer.Option(False, "--list", help="list the shipped scenarios"),
    from_run: Path = typer.Option(None, help="replay a `dovetail train` run with the costs it measured"),
):
    """Simulate policies on a scenario and compare throughput, efficiency, bubbles, staleness, memory."""
    from dovetail.plan.report import compare, render_table
    from dovetail.plan.scenario import MAX_SIMULATED_STEPS, list_scenarios, load_scenario

    if from_run is not None:
        from dovetail.runtime.replay import replay_run

        try:
            result = replay_run(from_run)
        except (FileNotFoundError, ValueError) as error:
            _refuse(str(error))
        if json_out:
            typer.echo(json.dumps(result))
        else:
            if result["resumed_from"]:
                first = result["first_step"]
                typer.echo(
                    f"the run was resumed from step {result['resumed_from']}: this replays steps {first}-"
                    f"{first + result['steps'] - 1} alone, the last --resume's (each writes run_profile.json anew)"
                )
            typer.echo(
                f"{result['policy']} over {result['steps']} steps: measured "
                f"{result['measured_step_time_s']:.3f} s/step to the last optimizer step (summary.json's "
                "step_time_s also counts the final weight publish), "
                f"simulated {result['predicted_step_time_s']:.3f} s/step ({result['relative_error']:+.1%}); "
                f"device pace {', '.join(f'{p:.2f}' for p in result['device_pace'])}"
            )
            if result["measured_steady_step_s"] is not None:
                typer.echo(
                    f"steady (commit to commit after the first step): measured {result['measured_steady_step_s']:.3f}"
                    f" s/step, simulated {result['predicted_steady_step_s']:.3f} s/step"
                )
            if auto := result.get("auto"):
                chosen, runner_up = auto["chosen"], auto["runner_up"]
                typer.echo(
                    f"policy auto chose {chosen['policy']}: predicted {chosen['predicted_samples_per_s']:.3g} "
                    f"samples/s, measured {chosen['measured']:.3g}"
                    + (
                        f"; runner-up {runner_up['policy']}: predicted {runner_up['predicted_samples_per_s']:.3g}, "
                        f"{runner_up['on_measured_costs']:.3g} on the costs this run measured"
                        if runner_up
                        else ""
                    )
                )
        return
    if list_:
        for name, description in list_scenarios().items():
            typer.echo(f"{name:28s} {description}")
        return
    if scenario is None:
        _refuse("give a SCENARIO (a shipped name or a YAML path) or --list")
    _check_count("--steps", steps, MAX_SIMULATED_STEPS)
    names = None if policies is None else [name.strip() for name in policies.split(",")]
    if names is not None and not all(names):
        _refuse(f"--policies {policies!r}: name policies separated by commas, e.g. --policies colocated,digen")
    for flag, path, example in (("--trace", trace, "trace.json"), ("--gantt", gantt, "gantt.png")):
        if path is not None and path.is_dir():
            _refuse(f"{flag} {path}: is a directory; give a file to write, e.g. {flag} {path / example}")
        if path is not None and not path.parent.is_dir():
            _refuse(f"{flag} {path}: no directory {path.parent} to write it in")
    try:
        result = compare(load_scenario(scenario), names, steps=steps, trace=trace, gantt=gantt)
    except ValueError as error:
        _refuse(str(error))
    typer.echo(json.dumps(result) if json_out else render_table(result))
    if all("error" in row for row in result["policies"].values()):  # each row says why; nothing was simulated
        raise typer.Exit(2)


@app.command()
def plan(
    scenario: str = typer.Argument(..., help="shipped scenario name or YAML path"),
    devices: int = typer.Option(..., help="devices to plan for"),
    policies: str = typer.Option(
        None,
        help="comma-separated policies; default: every policy of the scenario's schedule.policies",
    ),
):
    """Show every shape the policies' searches simulated (digen: pool split, FSDP groups, GAP fragments, TSP chunk,
    TAG, TCSS; jigsaw: the tail's edge and engine width), the one each chose, and the best."""
    from dovetail.graph.spec import MAX_DEVICES
    from dovetail.plan.report import plan as plan_policies
    from dovetail.plan.scenario import load_scenario

    _check_count("--devices", devices, MAX_DEVICES)
    names = None if policies is None else [name.strip() for name in policies.split(",")]
    if names is not None and not all(names):
        _refuse(f"--policies {policies!r}: name policies separated by commas, e.g. --policies digen,digen+tcss")
    try:
        typer.echo(plan_policies(load_scenario(scenario), devices, names))
    except ValueError as error:
        _refuse(str(error))


@app.command()
def export(
    run: Path = typer.Argument(
        ..., help="run directory of `dovetail train`: a language-model run, or a flow run with model.path"
    ),
    out: Path = typer.Argument(..., help="new directory for the transformers model or the diffusers pipeline"),
    step: int = typer.Option(None, help="the checkpoint's step (default: the newest)"),
):
    """Write a run's checkpoint as its library's directory that from_pretrained loads (save_pretrained layout): a
    language-model run's as a transformers model with its tokenizer (AutoModelForCausalLM), a flow run's as a
    diffusers pipeline (the trained transformer in transformer/); a LoRA run's adapter also in peft's layout in
    OUT/lora."""
    from dovetail.export import export_run

    try:
        checkpoint = export_run(run, step, out)
    except (FileNotFoundError, ValueError) as error:
        _refuse(str(error))
    typer.echo(f"exported {checkpoint} to {out}")


@app.command("convert-clip")
def convert_clip(
    checkpoint: Path = typer.Argument(..., help="an open_clip ViT checkpoint (HPS_v2_compressed.pt, a .pt state dict)"),
    processor: Path = typer.Argument(
        ..., help="a CLIPProcessor's directory for it (ViT-H-14's: laion/CLIP-ViT-H-14-laion2B-s32B-b79K's files)"
    ),
    out: Path = typer.Argument(..., help="new directory for the transformers CLIPModel and its processor"),
    quick_gelu: bool = typer.Option(False, help="OpenAI's own CLIP weights (QuickGELU); open_clip's LAION ones: no"),
):
    """Write an open_clip checkpoint as a transformers CLIPModel directory (save_pretrained layout) with the
    processor beside it: what the hps_v2, pickscore and clip_score rewards load."""
    import pickle

    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from transformers import CLIPProcessor

    from dovetail.models.open_clip import checkpoint_state, clip_model

    if out.exists():
        _refuse(f"{out} exists; name a new directory")
    unreadable = (OSError, ValueError, RuntimeError, KeyError, EOFError, SafetensorError)
    try:
        if checkpoint.suffix == ".safetensors":
            loaded: object = load_file(checkpoint)
        else:
            loaded = torch.load(checkpoint, map_location="cpu", weights_only=True)
        model = clip_model(checkpoint_state(loaded), quick_gelu)
    except pickle.UnpicklingError:
        _refuse(
            f"{checkpoint}: not a torch checkpoint of tensors; give an open_clip ViT checkpoint (.pt or .safetensors)"
        )
    except unreadable as error:
        _refuse(f"{checkpoint}: {_first_line(error)}; give an open_clip ViT checkpoint (.pt or .safetensors)")
    try:
        loaded_processor = CLIPProcessor.from_pretrained(processor)
    except unreadable as error:
        _refuse(f"{processor}: {_first_line(error)}; give the directory of a CLIPProcessor saved with save_pretrained")
    model.save_pretrained(out)
    loaded_processor.save_pretrained(out)
    typer.echo(f"converted {checkpoint} to {out}")


@app.command("convert-imagereward")
def convert_imagereward(
    checkpoint: Path = typer.Argument(..., help="ImageReward's checkpoint (ImageReward.pt from THUDM/ImageReward)"),
    tokenizer: Path = typer.Argument(..., help="a BERT tokenizer's directory for it (bert-base-uncased's files)"),
    out: Path = typer.Argument(..., help="new directory for the BLIP model, ImageReward's score head and tokenizer"),
):
    """Write an ImageReward checkpoint as a transformers BlipForImageTextRetrieval directory (save_pretrained
    layout) with ImageReward's score head and the tokenizer beside it: what the image_reward reward loads. The
    tokenizer gets the two tokens ImageReward's BLIP adds to BERT's ([DEC], [ENC]), so it reads prompts as
    ImageReward's does."""
    import pickle

    import torch
    from safetensors.torch import save_file
    from transformers import BertTokenizer

    from dovetail.models.image_reward import blip_model, checkpoint_state, score_head
    from dovetail.rewards.models import IMAGE_REWARD_HEAD

    if out.exists():
        _refuse(f"{out} exists; name a new directory")
    give = "give ImageReward's ImageReward.pt (huggingface.co/THUDM/ImageReward)"
    unreadable = (OSError, ValueError, RuntimeError, KeyError, EOFError)
    try:
        state = checkpoint_state(torch.load(checkpoint, map_location="cpu", weights_only=True))
        model, head = blip_model(state), score_head(state)
    except pickle.UnpicklingError:
        _refuse(f"{checkpoint}: not a torch checkpoint of tensors; {give}")
    except KeyError as error:  # a tensor the sizes are read from
        _refuse(f"{checkpoint}: has no tensor {error.args[0]}; {give}")
    except unreadable as error:
        _refuse(f"{checkpoint}: {_first_line(error)}; {give}")
    bert = "give the directory of bert-base-uncased's tokenizer files"
    if not any((tokenizer / name).is_file() for name in ("vocab.txt", "tokenizer.json")):
        _refuse(f"{tokenizer} has no vocab.txt or tokenizer.json; {bert}")
    try:
        loaded_tokenizer = BertTokenizer.from_pretrained(tokenizer)
    except unreadable as error:
        _refuse(f"{tokenizer}: {_first_line(error)}; {bert}")
    loaded_tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    if len(loaded_tokenizer) != model.config.text_config.vocab_size:
        _refuse(
            f"{tokenizer}: {len(loaded_tokenizer)} tokens with BLIP's [DEC] and [ENC], where {checkpoint} embeds "
            f"{model.config.text_config.vocab_size}; {bert}"
        )
    model.save_pretrained(out)
    save_file(head, str(out / IMAGE_REWARD_HEAD))
    loaded_tokenizer.save_pretrained(out)
    typer.echo(f"converted {checkpoint} to {out}")


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def main() -> None:
    """The console script: the app, with a command-line usage error (an unknown option or command, a missing or
    malformed value) as one line naming it and exit code 2, instead of a usage block."""
    try:
        code = app(sys.argv[1:] or ["--help"], standalone_mode=False)
    except TyperException as error:  # typer's own click raises these for what it cannot parse
        context = getattr(error, "ctx", None)
        command = context.command_path if context is not None else "dovetail"
        typer.echo(f"{command}: {error.format_message()} (see {command} --help)", err=True)
        code = 2
    except typer.Abort:
        code = 130
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
