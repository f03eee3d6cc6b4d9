"""A user's own model, prompts and export: a tiny random-init SD3 pipeline (tests/tiny_pipelines.py: two CLIP text
encoders with a tokenizer made there, an MMDiT, a VAE), saved with save_pretrained, trains through `model.path` under
the reference loop and a Ray policy to the same parameters, with and without LoRA; prompts come from files;
`dovetail export` writes what diffusers' and peft's `from_pretrained` load back."""

import json
import os
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from diffusers import FluxPipeline, SD3Transformer2DModel, StableDiffusion3Pipeline
from peft import PeftModel, get_peft_model_state_dict
from running import train
from safetensors.torch import load_file
from tiny_pipelines import PROMPTS, tiny_flux_pipeline
from typer.testing import CliRunner

from dovetail.cli import app
from dovetail.config.common import ConfigError
from dovetail.config.load import load_config
from dovetail.cost.catalog import diffusion_model
from dovetail.cost.model import CostModel
from dovetail.models.diffusers_flow import (
    DiffusersSource,
    export,
    load_diffusers_checkpoint,
    load_flow_model,
    save_diffusers_checkpoint,
    save_prompt_embeddings,
)
from dovetail.models.flow_rl import generate, group_sample_ids, recompute_log_probs, step_prompts
from dovetail.models.training import weights_of
from dovetail.pipelines.flow.recipe import policy_gradient, sde_settings
from dovetail.pipelines.flow.startup import fitted_cost
from dovetail.plan.prepare import rollout_wake_s, simulate
from dovetail.prompts import prompt_split, read_rows

STEPS = 2

SCORED = "DOVETAIL_TEST_SCORED"
"""The file where `colour_match` appends the prompts of each call, one JSON line each, when this is set: a user's
reward runs in a process of its own."""


def colour_match(images: np.ndarray, prompts) -> np.ndarray:
    """A user's reward of images and prompts: the mean of the colour channel the prompt names, less the others'."""
    if SCORED in os.environ:
        with open(os.environ[SCORED], "a") as calls:
            calls.write(json.dumps(list(prompts)) + "\n")
    channel = [0 if "red" in p else 2 if "blue" in p else 1 for p in prompts]
    means = images.reshape(len(images), -1, 3).mean(axis=1)
    return np.array([2 * m[c] - m.sum() + m[c] for m, c in zip(means, channel)])


def small(model: Path, prompts: Path, *extra: str) -> list[str]:
    return [
        f"model.path={model}",
        "model.max_sequence_length=4",
        f"prompts.path={prompts}",
        "prompts.eval_fraction=0.3",
        "prompts.eval_prompts=2",
        # a random-init model's samples of one prompt differ little (rewards ~1e-4 apart): weighted up, the group std
        # is far above the advantages' epsilon, which would otherwise magnify float noise between policies
        "reward={test_user_model:colour_match: 1000.0}",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "sampling.num_steps=4",
        "sampling.shift=3.0",
        "eval.per_prompt=1",
        "eval.every=100",
        "checkpoint.every=100",
        "train.lr=3e-3",
        "cluster.devices=2",
        "runtime.profile_samples=4",  # the start-up profile only seeds the plan
        *extra,
    ]


def trained(out: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / f"step_{step:06d}" / "model.safetensors")


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_a_diffusers_directory_given_as_the_checkpoint_is_one_line_naming_it(sd3_pipeline_dir, tmp_path):
    with pytest.raises(ConfigError) as refused:
        load_config(None, [f"model.checkpoint={sd3_pipeline_dir}"])
    expected = f"invalid config: model.checkpoint: {sd3_pipeline_dir} is a diffusers directory: give it as model.path"
    assert str(refused.value) == expected
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text('{"_class_name": "UNet2DConditionModel"}')
    for path, lacks in (
        (tmp_path / "nowhere", "is not a directory"),
        (sd3_pipeline_dir / "vae", "has no transformer/config.json"),
        (tmp_path, "holds a 'UNet2DConditionModel'; model.path loads SD3Transformer2DModel"),
    ):
        with pytest.raises(ConfigError) as refused:
            load_config(None, [f"model.path={path}"])
        assert "\n" not in str(refused.value) and str(path) in str(refused.value) and lacks in str(refused.value)
    result = CliRunner().invoke(app, ["train", f"model.checkpoint={sd3_pipeline_dir}", "--dry-run"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    with pytest.raises(ConfigError, match="reward.digit_match judges the built-in model's 8x8 digits"):
        load_config(None, [f"model.path={sd3_pipeline_dir}"])  # the default reward


@pytest.fixture(scope="module")
def reference_run(sd3_pipeline_dir, tiny_prompts_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "reference"
    train(load_config(None, small(sd3_pipeline_dir, tiny_prompts_file, "policy=reference")), out, steps=STEPS)
    return out


@pytest.mark.slow
def test_a_saved_pipeline_trains_through_model_path_and_a_ray_policy_matches_the_reference(
    reference_run, sd3_pipeline_dir, tiny_prompts_file, local_ray, tmp_path
):
    start = load_file(sd3_pipeline_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    assert max_difference(trained(reference_run), start) > 1e-4  # it trained the whole transformer
    train(load_config(None, small(sd3_pipeline_dir, tiny_prompts_file, "policy=colocated")), tmp_path, steps=STEPS)
    assert max_difference(trained(tmp_path), trained(reference_run)) <= 1e-5
    assert json.loads((tmp_path / "ledger.json").read_text())["problems"] == []


@pytest.mark.slow
def test_a_sharded_transformer_matches_the_reference_holds_half_and_exports_to_diffusers(
    reference_run, sd3_pipeline_dir, tiny_prompts_file, local_ray, tmp_path
):
    """`train.sharding: fsdp` over both devices (FSDP per SD3 block): the reference's weights within the flow bound,
    each device half the transformer's parameters and moments, and the run exports as an unsharded one does."""
    config = small(sd3_pipeline_dir, tiny_prompts_file, "policy=colocated", "train.sharding=fsdp")
    train(load_config(None, config), tmp_path / "run", steps=STEPS)
    assert max_difference(trained(tmp_path / "run"), trained(reference_run)) <= 1e-5
    whole = SD3Transformer2DModel.from_pretrained(sd3_pipeline_dir / "transformer")
    parameters = sum(p.numel() * p.element_size() for p in whole.parameters())
    (last,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1:]
    for device in last["memory_bytes_per_device"]:
        assert device["parameters"] < 0.51 * parameters and device["optimizer"] < 1.02 * parameters
    result = CliRunner().invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    pipeline = StableDiffusion3Pipeline.from_pretrained(tmp_path / "out", text_encoder_3=None, tokenizer_3=None)
    assert max_difference(pipeline.transformer.state_dict(), trained(tmp_path / "run")) == 0.0


LORA = ["model.lora.rank=4", "model.lora.alpha=8.0"]


@pytest.fixture(scope="module")
def lora_reference_run(sd3_pipeline_dir, tiny_prompts_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "lora-reference"
    train(load_config(None, small(sd3_pipeline_dir, tiny_prompts_file, "policy=reference", *LORA)), out, steps=STEPS)
    return out


@pytest.mark.slow
def test_lora_trains_publishes_and_checkpoints_the_adapter_alone_and_a_ray_policy_matches_the_reference(
    lora_reference_run, sd3_pipeline_dir, tiny_prompts_file, local_ray, tmp_path
):
    adapter = trained(lora_reference_run)
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert max(v.abs().max().item() for k, v in adapter.items() if ".lora_B." in k) > 1e-4  # B starts at 0: it trained
    model = load_diffusers_checkpoint(lora_reference_run / "checkpoints" / f"step_{STEPS:06d}")
    base = load_file(sd3_pipeline_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    frozen = model.transformer.get_base_model().state_dict()
    for name, weight in base.items():  # the base never moved (an adapted layer's weight is now its base_layer's)
        wrapped = name.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        assert torch.equal(frozen[wrapped if wrapped in frozen else name], weight)
    published = sum(a.nbytes for a in weights_of(model).values())
    assert published == sum(v.nbytes for v in adapter.values()) < sum(v.nbytes for v in base.values()) / 4
    optimizer = torch.load(lora_reference_run / "checkpoints" / f"step_{STEPS:06d}" / "optimizer.pt")
    assert len(optimizer["state"]) == len(adapter)  # Adam's moments of the adapter alone

    train(
        load_config(None, small(sd3_pipeline_dir, tiny_prompts_file, "policy=colocated", *LORA)), tmp_path, steps=STEPS
    )
    assert max_difference(trained(tmp_path), adapter) <= 1e-5
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {s["publish_bytes"] for s in steps} == {published}


@pytest.mark.parametrize(
    ("left_out", "written", "says"),
    [
        ("diffusers_path", {}, "diffusers_path"),  # a field the source needs
        (None, {"frames": "many"}, "frames"),  # of the wrong type
        (None, {"seed": 3}, "seed"),  # no field of a source
    ],
)
def test_a_checkpoint_builds_its_model_from_the_source_its_config_json_holds(
    sd3_pipeline_dir, tiny_prompts_file, tmp_path, left_out, written, says
):
    """A checkpoint's config.json is its model's `source` (`DiffusersSource`): the directory resolved and the sample
    size the model took, the LoRA settings and guidance as the config gave them; the checkpoint loads back the same
    model. One written by an older dovetail, without the fields added since, means their defaults; a damaged one is
    one line naming the file and the field."""
    config = load_config(None, small(sd3_pipeline_dir, tiny_prompts_file, "sampling.guidance_scale=2.0", *LORA))
    model = load_flow_model(config)
    source = model.source
    assert source.diffusers_path == str(sd3_pipeline_dir.resolve())
    assert source.sample_size == model.transformer_config.sample_size
    assert (source.lora, source.guidance_scale) == (config.model.lora.model_dump(), 2.0)
    save_diffusers_checkpoint(model, tmp_path / "checkpoint")
    again = load_diffusers_checkpoint(tmp_path / "checkpoint")
    assert again.source == source and max_difference(again.trained_state_dict(), model.trained_state_dict()) == 0.0

    older = json.loads((tmp_path / "checkpoint" / "config.json").read_text())
    for added in ("guidance", "frames", "guidance_scale", "negative_prompt"):
        del older[added]
    (tmp_path / "checkpoint" / "config.json").write_text(json.dumps(older))
    assert load_diffusers_checkpoint(tmp_path / "checkpoint").source == DiffusersSource(**older)

    damaged = {key: value for key, value in older.items() if key != left_out} | written
    (tmp_path / "checkpoint" / "config.json").write_text(json.dumps(damaged))
    with pytest.raises(ValueError, match=f"unreadable {tmp_path / 'checkpoint' / 'config.json'}: .*{says}") as error:
        load_diffusers_checkpoint(tmp_path / "checkpoint")
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_lora_under_digen_with_trainer_assisted_generation_matches_the_reference(
    lora_reference_run, sd3_pipeline_dir, tiny_prompts_file, local_ray, tmp_path
):
    """digen publishes the adapter from its trainer device to its rollout device, and TAG lends the trainer's
    rollout copy fragments too: the adapter still ends where the reference's does."""
    digen = ["policy=digen", "runtime.fragments=2", "runtime.tag=force", *LORA]
    train(load_config(None, small(sd3_pipeline_dir, tiny_prompts_file, *digen)), tmp_path, steps=STEPS)
    assert max_difference(trained(tmp_path), trained(lora_reference_run)) <= 1e-5
    assert json.loads((tmp_path / "ledger.json").read_text())["problems"] == []


def test_export_writes_what_diffusers_and_peft_load_back_with_the_trained_weights(
    lora_reference_run, reference_run, sd3_pipeline_dir, tmp_path
):
    runner = CliRunner()
    out = tmp_path / "lora-export"
    result = runner.invoke(app, ["export", str(lora_reference_run), "--step", str(STEPS), str(out)])
    assert result.exit_code == 0, result.output
    pipeline = StableDiffusion3Pipeline.from_pretrained(out, text_encoder_3=None, tokenizer_3=None)
    adapter = trained(lora_reference_run)
    base = load_file(sd3_pipeline_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    scale = 8.0 / 4  # alpha / rank
    merged = dict(base)
    for name in {k.split(".lora_A.")[0] for k in adapter if ".lora_A." in k}:
        layer = name.removeprefix("base_model.model.")
        lora_a, lora_b = adapter[f"{name}.lora_A.weight"], adapter[f"{name}.lora_B.weight"]
        merged[f"{layer}.weight"] = base[f"{layer}.weight"] + scale * lora_b @ lora_a
    assert max_difference(pipeline.transformer.state_dict(), merged) <= 1e-6
    assert max_difference(pipeline.transformer.state_dict(), base) > 1e-4
    images = pipeline(
        ["a red cat"], num_inference_steps=2, height=16, width=16, max_sequence_length=4, output_type="np"
    )
    assert images.images.shape == (1, 16, 16, 3)

    reloaded = PeftModel.from_pretrained(
        SD3Transformer2DModel.from_pretrained(sd3_pipeline_dir / "transformer"), out / "lora"
    )
    assert max_difference(get_peft_model_state_dict(reloaded), adapter) == 0.0

    full = tmp_path / "full-export"
    assert runner.invoke(app, ["export", str(reference_run), str(full)]).exit_code == 0  # the newest step
    transformer = SD3Transformer2DModel.from_pretrained(full / "transformer")
    assert max_difference(transformer.state_dict(), trained(reference_run)) == 0.0
    assert not (full / "lora").exists()

    for args, names in (
        ([str(tmp_path / "nowhere"), str(tmp_path / "a")], "no config.yaml"),
        ([str(reference_run), "--step", "1", str(tmp_path / "b")], "no checkpoint of step 1; --step one of [2]"),
        ([str(reference_run), str(full)], "exists and is not an empty directory"),
    ):
        result = runner.invoke(app, ["export", *args])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1 and names in result.output


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_diffusers_own_lora_loader_reads_the_exported_adapter_as_the_merged_export(
    kind, sd3_pipeline_dir, tiny_prompts_file, tmp_path
):
    """`pipe.load_lora_weights(OUT/lora)` and the transformer's `load_lora_adapter` on a LoRA run's export sample
    what the merged export samples (the pipeline's latents, before a random VAE's clipping could hide a difference);
    they loaded nothing before, without an error."""
    if kind == "sd3":
        source, pipeline_class, transformer_class = sd3_pipeline_dir, StableDiffusion3Pipeline, SD3Transformer2DModel
        sizes, options = [], {"text_encoder_3": None, "tokenizer_3": None}
    else:
        source, pipeline_class, transformer_class = tiny_flux_pipeline(tmp_path / "flux"), FluxPipeline, None
        sizes, options = ["model.sample_size=8", "model.max_sequence_length=8"], {}
    model = load_flow_model(load_config(None, small(source, tiny_prompts_file, *LORA, *sizes)))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained adapter: its B matrices start at 0, where merged or not is all one
        for name, parameter in model.transformer.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    out = tmp_path / "export"
    export(model, out)

    def latents(pipeline) -> torch.Tensor:
        length = 4 if kind == "sd3" else 8
        return pipeline(
            [PROMPTS[0]],
            num_inference_steps=2,
            height=16,
            width=16,
            max_sequence_length=length,
            output_type="latent",
            generator=torch.Generator().manual_seed(1),
        ).images

    merged = latents(pipeline_class.from_pretrained(out, **options))
    base = pipeline_class.from_pretrained(source, **options)
    assert (latents(base) - merged).abs().max() > 1e-3  # the adapter changes what is sampled
    base.load_lora_weights(out / "lora")
    assert (latents(base) - merged).abs().max() <= 1e-5
    if transformer_class is not None:
        base = pipeline_class.from_pretrained(source, **options)
        base.transformer = transformer_class.from_pretrained(source / "transformer")
        base.transformer.load_lora_adapter(out / "lora", weight_name="pytorch_lora_weights.safetensors")
        assert (latents(base) - merged).abs().max() <= 1e-5


def test_prompts_read_alike_from_text_jsonl_json_and_parquet_and_split_by_their_hash(tmp_path):
    records = [{"text": p, "id": i} for i, p in enumerate(PROMPTS)]
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS) + "\n\n")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "p.json").write_text(json.dumps(records))
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "p.parquet"))
    for name in ("p.txt", "p.jsonl", "p.json", "p.parquet"):
        assert [row.prompt for row in read_rows(tmp_path / name, "text")] == PROMPTS

    parquet = [f"prompts.path={tmp_path / 'p.parquet'}", "prompts.field=text", "prompts.eval_fraction=0.3"]
    config = load_config(None, parquet)
    split = prompt_split(config)
    assert set(split.train) | set(split.eval) == set(PROMPTS) and not set(split.train) & set(split.eval)
    reordered = tmp_path / "reordered.txt"
    reordered.write_text("\n".join(reversed(PROMPTS)))
    again = prompt_split(load_config(None, [f"prompts.path={reordered}", "prompts.eval_fraction=0.3"]))
    assert set(again.eval) == set(split.eval)  # a prompt's side is its text's, whatever the file's order
    (tmp_path / "eval.txt").write_text("green dog\n")
    own_eval = prompt_split(
        load_config(None, [f"prompts.path={reordered}", f"prompts.eval_path={tmp_path / 'eval.txt'}"])
    )
    assert own_eval.train == tuple(reversed(PROMPTS)) and own_eval.eval == ("green dog",)

    drawn = step_prompts(7, 3, 64, split.train)
    assert drawn == step_prompts(7, 3, 64, split.train) != step_prompts(7, 4, 64, split.train)  # (seed, step) alone
    assert set(drawn) == set(split.train)


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["prompts.path=/nowhere.txt"], "prompts.path: no prompts file /nowhere.txt"),
        (
            ["prompts.path={d}/p.jsonl", "prompts.field=prompt"],
            "record 1 has no text in 'prompt'; set prompts.field",
        ),
        (["prompts.path={d}/p.parquet", "prompts.field=prompt"], "has no column 'prompt' (columns: ['text']); set"),
        (["prompts.path={d}/p.csv.gz"], "unknown format .gz; use .txt, .jsonl, .json, .parquet, .csv, .arrow"),
        (["prompts.path={d}/one.txt"], "leave no train prompt; change prompts.eval_fraction or give prompts.eval_path"),
        (["prompts.path={d}/p.jsonl", "prompts.eval_path={d}/one.txt", "prompts.eval_fraction=0.2"], "not both"),
    ],
)
def test_a_prompts_file_that_cannot_give_prompts_is_one_line_naming_it(overrides, says, tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": "a red cat"}) + "\n")
    datasets.Dataset.from_list([{"text": "a red cat"}]).to_parquet(str(tmp_path / "p.parquet"))
    (tmp_path / "p.csv.gz").write_text("")
    (tmp_path / "one.txt").write_text("blue cat\n")  # its hash puts it in eval at eval_fraction 0.999
    overrides = [o.format(d=tmp_path) for o in overrides]
    overrides += ["prompts.eval_fraction=0.999"] if overrides[0].endswith("one.txt") else []
    result = CliRunner().invoke(app, ["train", *overrides, "--dry-run"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert says in result.output


def test_the_reward_scores_the_steps_prompts_from_the_train_split_and_evaluates_the_eval_split(
    sd3_pipeline_dir, tiny_prompts_file, tmp_path, monkeypatch
):
    config = load_config(None, small(sd3_pipeline_dir, tiny_prompts_file, "policy=reference"))
    split = prompt_split(config)
    calls = tmp_path / "scored.jsonl"
    monkeypatch.setenv(SCORED, str(calls))
    train(config, tmp_path / "run", steps=STEPS)
    base_eval, *steps, final_eval = [json.loads(line) for line in calls.read_text().splitlines()]
    assert base_eval == final_eval == list(split.eval[:2])  # prompts.eval_prompts=2, eval.per_prompt=1
    for step, scored in enumerate(steps):
        drawn = step_prompts(config.seed, step, 2, split.train)
        assert scored == [p for p in drawn for _ in range(2)]  # each prompt's group of 2


def test_a_transformer_with_precomputed_prompt_embeddings_generates_what_its_pipeline_does(
    sd3_pipeline_dir, tiny_prompts_file, tmp_path
):
    embedded = tmp_path / "embedded"
    for part in ("transformer", "scheduler", "vae"):
        shutil.copytree(sd3_pipeline_dir / part, embedded / part)
    text = StableDiffusion3Pipeline.from_pretrained(sd3_pipeline_dir, text_encoder_3=None, tokenizer_3=None)
    embeds, _, pooled, _ = text.encode_prompt(
        PROMPTS, None, None, do_classifier_free_guidance=False, max_sequence_length=4
    )
    save_prompt_embeddings(embedded / "prompt_embeds.safetensors", PROMPTS, embeds, pooled)

    models = []
    for path in (sd3_pipeline_dir, embedded):
        config = load_config(None, small(path, tiny_prompts_file))
        models.append(load_flow_model(config))
    ids = group_sample_ids(0, [0, 1, 2], 2)
    prompts = [PROMPTS[s.prompt] for s in ids]
    from_pipeline, from_table = (
        generate(m, prompts, ids, sde_settings(config), seed=0, shared_group_noise=False) for m in models
    )
    assert torch.equal(from_table.prompt_ids, from_pipeline.prompt_ids)
    assert torch.equal(from_table.latents, from_pipeline.latents)
    with pytest.raises(
        ValueError, match="prompt 'green dog' has no precomputed encoding in .*prompt_embeds.safetensors"
    ):
        models[1].encode_prompts(["green dog"])
    unencoded = tmp_path / "unencoded.txt"
    unencoded.write_text("\n".join([*PROMPTS, "green dog"]))
    result = CliRunner().invoke(app, ["train", *small(embedded, unencoded), "--dry-run"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "prompt 'green dog' (1 of the run's prompts in all) has no precomputed encoding in" in result.output
    guided = ["sampling.guidance_scale=4.5", "sampling.negative_prompt=blurry"]  # guidance's prompt needs one too
    result = CliRunner().invoke(app, ["train", *small(embedded, tiny_prompts_file, *guided), "--dry-run"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "prompt 'blurry' (1 of the run's prompts in all) has no precomputed encoding in" in result.output


def test_a_run_of_a_diffusers_model_resumes_to_the_parameters_of_the_uninterrupted_run(
    reference_run, sd3_pipeline_dir, tiny_prompts_file, tmp_path
):
    config = load_config(None, small(sd3_pipeline_dir, tiny_prompts_file, "policy=reference", "checkpoint.every=1"))
    train(config, tmp_path, steps=1)
    train(config, tmp_path, steps=STEPS, resume=tmp_path)
    assert max_difference(trained(tmp_path), trained(reference_run)) == 0.0


def test_the_planner_sees_a_model_path_run_as_its_cost_model_at_its_image_size_with_its_adapter(
    sd3_pipeline_dir, tiny_prompts_file
):
    lora = load_config(
        None, small(sd3_pipeline_dir, tiny_prompts_file, "policy=digen", "model.cost_model=SD3.5-M", *LORA)
    )
    spec = lora.scenario(3).pipelines[0]
    # 8 latent pixels a side, a VAE of two blocks (one 2x upsampling): 16-pixel images
    assert (spec.model, spec.height, spec.width, spec.lora.rank, spec.lora.targets) == (
        "SD3.5-M",
        16,
        16,
        4,
        "attention",
    )
    full = load_config(None, small(sd3_pipeline_dir, tiny_prompts_file, "policy=digen"))
    assert full.scenario(3).pipelines[0].lora is None and full.scenario(3).pipelines[0].model == "digits-t2i"


def test_an_unnamed_pipeline_of_a_model_path_is_named_after_the_model_directory(sd3_pipeline_dir, tiny_prompts_file):
    """Its run sub-directory, node ids and trace lanes say which model it is, not the built-in `digits`."""
    unnamed = load_config(None, small(sd3_pipeline_dir, tiny_prompts_file))
    assert unnamed.pipeline_name == sd3_pipeline_dir.name != "digits"
    assert load_config(None, small(sd3_pipeline_dir, tiny_prompts_file, "name=mine")).pipeline_name == "mine"
    assert load_config(None, []).pipeline_name == "digits"


def test_a_flux_pipeline_moves_as_flux_pipeline_drives_it_trains_and_exports(tiny_prompts_file, tmp_path):
    flux = tiny_flux_pipeline(tmp_path / "flux")
    run = small(flux, tiny_prompts_file, "policy=reference", "model.sample_size=8", "model.max_sequence_length=8")
    config = load_config(None, run)
    model = load_flow_model(config)
    pipeline = FluxPipeline.from_pretrained(flux)
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    embeds, pooled, text_ids = pipeline.encode_prompt(PROMPTS[:2], None, max_sequence_length=8)
    expected = pipeline.transformer(  # FluxPipeline's own step: packed latents, their ids, timestep / 1000
        hidden_states=pipeline._pack_latents(latents, 2, 4, 8, 8),
        timestep=torch.full((2,), 0.7),
        guidance=torch.full((2,), 3.5),
        pooled_projections=pooled,
        encoder_hidden_states=embeds,
        txt_ids=text_ids,
        img_ids=pipeline._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32),
    ).sample
    velocity = model(latents, torch.tensor(0.7), model.encode_prompts(PROMPTS[:2]))
    assert (velocity - pipeline._unpack_latents(expected, 16, 16, 2)).abs().max() <= 1e-5

    out = tmp_path / "run"
    train(config, out, steps=STEPS)
    start = load_file(flux / "transformer" / "diffusion_pytorch_model.safetensors")
    assert max_difference(trained(out), start) > 1e-4
    assert CliRunner().invoke(app, ["export", str(out), str(tmp_path / "export")]).exit_code == 0
    reloaded = FluxPipeline.from_pretrained(tmp_path / "export")
    assert max_difference(reloaded.transformer.state_dict(), trained(out)) == 0.0


GUIDED = ["sampling.guidance_scale=4.5", "sampling.negative_prompt=green mat"]


def test_a_guided_velocity_is_the_negative_plus_scale_times_the_difference_of_two_unguided_transformer_passes(
    sd3_pipeline_dir, tiny_prompts_file
):
    pipeline = StableDiffusion3Pipeline.from_pretrained(sd3_pipeline_dir, text_encoder_3=None, tokenizer_3=None)
    embeds, negative_embeds, pooled, negative_pooled = pipeline.encode_prompt(
        PROMPTS[:2], None, None, negative_prompt="green mat", do_classifier_free_guidance=True, max_sequence_length=4
    )
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.4])  # a training chunk's pairs sit at different timesteps

    def transformer(embeds, pooled):
        return pipeline.transformer(
            hidden_states=latents, encoder_hidden_states=embeds, pooled_projections=pooled, timestep=sigma * 1000
        ).sample

    conditional, unconditional = transformer(embeds, pooled), transformer(negative_embeds, negative_pooled)
    guided = load_flow_model(load_config(None, small(sd3_pipeline_dir, tiny_prompts_file, *GUIDED)))
    velocity = guided(latents, sigma, guided.encode_prompts(PROMPTS[:2]))
    assert (velocity - (unconditional + 4.5 * (conditional - unconditional))).abs().max() <= 1e-5
    assert (velocity - conditional).abs().max() > 1e-3  # the guidance moved it

    unguided = load_flow_model(load_config(None, small(sd3_pipeline_dir, tiny_prompts_file)))
    assert torch.equal(
        unguided(latents, sigma, unguided.encode_prompts(PROMPTS[:2])), conditional
    )  # one pass, as before


def test_a_guided_rollout_is_on_policy_in_training_ratio_one_and_the_planner_prices_the_second_pass(
    sd3_pipeline_dir, tiny_prompts_file
):
    config = load_config(None, small(sd3_pipeline_dir, tiny_prompts_file, *GUIDED))
    model, sde = load_flow_model(config), sde_settings(config)
    ids = group_sample_ids(0, [0, 1], 2)
    rollout = generate(model, [PROMPTS[s.prompt] for s in ids], ids, sde, seed=0, shared_group_noise=False)
    timesteps = [0, 1, 2]
    recomputed = recompute_log_probs(model, rollout, timesteps, sde)
    assert (recomputed - rollout.log_probs)[:, timesteps].abs().max() <= 1e-4
    stats = policy_gradient(model, rollout, torch.ones(4), timesteps, sde, config, total_pairs=12)
    assert abs(stats["ratio_min"] - 1) <= 1e-4 and abs(stats["ratio_max"] - 1) <= 1e-4
    # the same trajectories scored without guidance are off-policy: the check above can fail
    unguided = load_flow_model(load_config(None, small(sd3_pipeline_dir, tiny_prompts_file)))
    assert (recompute_log_probs(unguided, rollout, timesteps, sde) - rollout.log_probs).abs().max() > 1e-2

    def planned(*guidance: str) -> tuple[float, dict[str, float]]:
        """The predicted step time and each kind of work's device-seconds of an SD3.5-M run of 512-pixel images."""
        shape = ["model.cost_model=SD3.5-M", "cluster.device=H100", "model.sample_size=64", "algo.group_size=8"]
        config = load_config(None, small(sd3_pipeline_dir, tiny_prompts_file, *shape, *guidance))
        prepared, trace = simulate(config.scenario(2), "colocated")
        seconds: dict[str, float] = {}
        for node in prepared.graph.nodes.values():
            seconds[node.kind.value] = seconds.get(node.kind.value, 0.0) + node.cost_s
        return trace.makespan / 2, seconds

    (plain_s, plain), (guided_s, guided) = planned(), planned(*GUIDED)
    assert guided_s > plain_s
    assert "logprob" not in plain  # a run trains on its rollout's log-probs: no recompute pass to price
    for kind in ("generate", "train"):  # twice the passes, each at least as efficient (larger)
        assert 1.3 * plain[kind] < guided[kind] <= 2 * plain[kind], kind
    assert guided["publish"] == plain["publish"]


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("sampling.guidance_scale=-1", "sampling.guidance_scale"),
        ("sampling.guidance_scale=strong", "sampling.guidance_scale"),
        ("sampling.negative_prompt=blue", "sampling.negative_prompt applies to classifier-free guidance only"),
    ],
)
def test_a_bad_guidance_is_one_line_naming_the_field(sd3_pipeline_dir, tiny_prompts_file, override, says):
    result = CliRunner().invoke(app, ["train", *small(sd3_pipeline_dir, tiny_prompts_file), override, "--dry-run"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert says in result.output


def test_guidance_of_the_built_in_digits_model_is_one_line():
    result = CliRunner().invoke(app, ["train", "sampling.guidance_scale=4.5", "--dry-run"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "sampling.guidance_scale=4.5: the built-in digits model has no unconditional prompt" in result.output


def test_a_guided_start_up_profile_is_fitted_against_guided_passes(sd3_pipeline_dir, tiny_prompts_file):
    """A profile measures the guided forward; priced against unguided passes, its doubling would land in the
    corrections, and the graph, which prices guidance itself, would count it twice."""
    config = load_config(
        None, small(sd3_pipeline_dir, tiny_prompts_file, "model.cost_model=SD3.5-M", "cluster.device=H100", *GUIDED)
    )
    scenario, samples = config.scenario(2), config.runtime.profile_samples
    spec, analytic = scenario.pipelines[0], CostModel("H100")
    model = diffusion_model("SD3.5-M")
    tokens = model.latent_tokens(spec.height, spec.width)
    generate_s = analytic.generate(model, samples, spec.height, spec.width, spec.denoising_steps, cfg=True)
    measured = {  # what a device that runs exactly as the cost model says would measure
        "generate": generate_s,
        "generate_fastest": generate_s,
        "generate_small_fastest": generate_s,  # no small-pass information: the default half point
        "score": analytic.rule_score(samples),
        "logprob": analytic.dit_logprob(model, samples, 1, tokens, cfg=True),
        "train": analytic.dit_train(model, samples, 1, tokens, cfg=True),
        "optimizer": analytic.optimizer_step(model.params),
        "publish": analytic.publish(model.params),
        "switch": rollout_wake_s(scenario, analytic),
    }
    corrections = fitted_cost(config, scenario, measured).corrections()
    assert all(abs(scale - 1) <= 1e-9 for scale in corrections.values()), corrections


@pytest.mark.slow
def test_a_guided_run_under_a_ray_policy_ends_at_the_reference_parameters(
    reference_run, sd3_pipeline_dir, tiny_prompts_file, local_ray, tmp_path
):
    for policy in ("reference", "colocated"):
        config = load_config(None, small(sd3_pipeline_dir, tiny_prompts_file, f"policy={policy}", *GUIDED))
        train(config, tmp_path / policy, steps=STEPS)
    guided = trained(tmp_path / "reference")
    assert max_difference(guided, trained(reference_run)) > 1e-4  # guidance changed what trained
    assert max_difference(trained(tmp_path / "colocated"), guided) <= 1e-5
