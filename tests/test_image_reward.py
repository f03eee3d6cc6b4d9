"""An ImageReward checkpoint converted by `dovetail convert-imagereward` (`dovetail.models.image_reward`) scores, as
the `image_reward` reward, what ImageReward scores.

ImageReward's forward is transcribed here and run on a tiny random checkpoint in its naming: its transform
(ImageReward.py's `_transform`: torchvision's Resize(bicubic), CenterCrop, ToTensor, Normalize with CLIP's mean
and std), BLIP's ViT (models/BLIP/vit.py: `VisionTransformer`, `Block`, `Attention`), med.py's BertModel with
cross-attention to the image tokens (`BertEmbeddings`, `BertSelfAttention`, `BertLayer` in multimodal mode,
`get_extended_attention_mask`'s -10000), and `ImageReward.score`: the MLP of the [CLS] state, minus the mean, over
the std, one image and prompt at a time, the prompt tokenized by BLIP's `init_tokenizer` (BERT with [DEC] and
[ENC] added), padded to 35."""

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from test_reward_models import clip_directory, random_images
from transformers import BertTokenizer
from typer.testing import CliRunner

from dovetail.cli import app
from dovetail.rewards import RewardModel, RewardSources, model_problem, score

torch.set_num_threads(1)
VISION_WIDTH, VISION_LAYERS, PATCH, GRID = 128, 2, 4, 4
TEXT_WIDTH, TEXT_LAYERS, POSITIONS, EMBED = 128, 2, 40, 16
HEAD_SIZES = (TEXT_WIDTH, 24, 12, 8, 4, 1)
WORDS = ["a", "red", "cat", "on", "the", "mat", "blue", "dog", "digit", "3", "of", "long", "line", "text"]
PROMPTS = ["a red cat", "the blue dog on a mat", "digit 3", "a red cat on the mat " * 6, "unknown words here"]
MEAN, STD = 0.16717362830052426, 1.0333394966054072


def bert_vocabulary(directory) -> str:
    directory.mkdir(parents=True)
    (directory / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return str(directory)


def image_reward_checkpoint(seed: int, vocabulary: int) -> dict[str, torch.Tensor]:
    """A tiny ImageReward state dict in its names: a ViT of width 128 (2 heads of 64), 2 blocks, 16 x 16 images of
    4 x 4 patches; a BERT of width 128 (2 heads), 2 layers each with cross-attention, 40 positions; projections
    of 16; an MLP 128 -> 24 -> 12 -> 8 -> 4 -> 1 in ImageReward's layer indices, scaled so the score varies."""
    generator = torch.Generator().manual_seed(seed)

    def random(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    def norm(name: str, width: int) -> dict[str, torch.Tensor]:
        return {f"{name}.weight": 1 + random(width), f"{name}.bias": random(width)}

    def linear(name: str, out: int, into: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
        return {f"{name}.weight": random(out, into, scale=scale), f"{name}.bias": random(out, scale=scale)}

    vision, text = "blip.visual_encoder.", "blip.text_encoder."
    state = {
        f"{vision}patch_embed.proj.weight": random(VISION_WIDTH, 3, PATCH, PATCH),
        f"{vision}patch_embed.proj.bias": random(VISION_WIDTH),
        f"{vision}cls_token": random(1, 1, VISION_WIDTH),
        f"{vision}pos_embed": random(1, GRID * GRID + 1, VISION_WIDTH),
        f"{text}embeddings.word_embeddings.weight": random(vocabulary, TEXT_WIDTH, scale=1.0),
        f"{text}embeddings.position_embeddings.weight": random(POSITIONS, TEXT_WIDTH),
        f"{text}embeddings.position_ids": torch.arange(POSITIONS)[None],
    }
    state |= norm(f"{vision}norm", VISION_WIDTH) | norm(f"{text}embeddings.LayerNorm", TEXT_WIDTH)
    state |= linear("blip.vision_proj", EMBED, VISION_WIDTH) | linear("blip.text_proj", EMBED, TEXT_WIDTH)
    for block in range(VISION_LAYERS):
        prefix = f"{vision}blocks.{block}."
        state |= norm(f"{prefix}norm1", VISION_WIDTH) | norm(f"{prefix}norm2", VISION_WIDTH)
        state |= linear(f"{prefix}attn.qkv", 3 * VISION_WIDTH, VISION_WIDTH)
        state |= linear(f"{prefix}attn.proj", VISION_WIDTH, VISION_WIDTH)
        state |= linear(f"{prefix}mlp.fc1", 4 * VISION_WIDTH, VISION_WIDTH)
        state |= linear(f"{prefix}mlp.fc2", VISION_WIDTH, 4 * VISION_WIDTH)
    for layer in range(TEXT_LAYERS):
        prefix = f"{text}encoder.layer.{layer}."
        for attention, source in (("attention", TEXT_WIDTH), ("crossattention", VISION_WIDTH)):
            state |= linear(f"{prefix}{attention}.self.query", TEXT_WIDTH, TEXT_WIDTH, scale=0.2)
            state |= linear(f"{prefix}{attention}.self.key", TEXT_WIDTH, source, scale=0.2)
            state |= linear(f"{prefix}{attention}.self.value", TEXT_WIDTH, source)
            state |= linear(f"{prefix}{attention}.output.dense", TEXT_WIDTH, TEXT_WIDTH)
            state |= norm(f"{prefix}{attention}.output.LayerNorm", TEXT_WIDTH)
        state |= linear(f"{prefix}intermediate.dense", 4 * TEXT_WIDTH, TEXT_WIDTH)
        state |= linear(f"{prefix}output.dense", TEXT_WIDTH, 4 * TEXT_WIDTH)
        state |= norm(f"{prefix}output.LayerNorm", TEXT_WIDTH)
    for index, (into, out) in zip((0, 2, 4, 6, 7), zip(HEAD_SIZES, HEAD_SIZES[1:])):
        state |= linear(f"mlp.layers.{index}", out, into, scale=1 / math.sqrt(into))
    return state


# ------------------------------------------------------------------ ImageReward, transcribed


def transform(picture: Image.Image, size: int) -> torch.Tensor:
    """torchvision's Resize(size, BICUBIC) (`_compute_resized_output_size`; PIL's resize, skipped at the same
    size), CenterCrop(size), ToTensor, Normalize(CLIP's mean and std), on an RGB picture."""
    width, height = picture.size
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    new_width, new_height = (new_short, new_long) if width <= height else (new_long, new_short)
    if (new_width, new_height) != (width, height):
        picture = picture.resize((new_width, new_height), Image.Resampling.BICUBIC)
    top, left = int(round((new_height - size) / 2.0)), int(round((new_width - size) / 2.0))
    picture = picture.crop((left, top, left + size, top + size))
    tensor = torch.from_numpy(np.array(picture)).permute(2, 0, 1).contiguous().float().div(255)
    mean = torch.tensor((0.48145466, 0.4578275, 0.40821073))
    std = torch.tensor((0.26862954, 0.26130258, 0.27577711))
    return tensor.sub(mean[:, None, None]).div(std[:, None, None])


def layer_norm(state, name, x, eps):
    return F.layer_norm(x, (x.shape[-1],), state[f"{name}.weight"], state[f"{name}.bias"], eps)


def linear(state, name, x):
    return F.linear(x, state[f"{name}.weight"], state[f"{name}.bias"])


def visual_encoder(state, image):
    """BLIP's VisionTransformer.forward: patches, [cls], + pos_embed, pre-norm blocks, the final norm on every
    token (timm's LayerNorm eps 1e-6)."""
    prefix = "blip.visual_encoder."
    x = F.conv2d(image, state[f"{prefix}patch_embed.proj.weight"], state[f"{prefix}patch_embed.proj.bias"], PATCH)
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([state[f"{prefix}cls_token"].expand(x.shape[0], -1, -1), x], dim=1)
    x = x + state[f"{prefix}pos_embed"][:, : x.shape[1], :]
    heads = VISION_WIDTH // 64
    for block in range(VISION_LAYERS):
        name = f"{prefix}blocks.{block}."
        y = layer_norm(state, f"{name}norm1", x, 1e-6)
        batch, tokens, width = y.shape
        qkv = (
            linear(state, f"{name}attn.qkv", y).reshape(batch, tokens, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
        )
        q, k, v = qkv[0], qkv[1], qkv[2]
        attention = ((q @ k.transpose(-2, -1)) * (width // heads) ** -0.5).softmax(dim=-1)
        x = x + linear(state, f"{name}attn.proj", (attention @ v).transpose(1, 2).reshape(batch, tokens, width))
        y = layer_norm(state, f"{name}norm2", x, 1e-6)
        x = x + linear(state, f"{name}mlp.fc2", F.gelu(linear(state, f"{name}mlp.fc1", y)))
    return layer_norm(state, f"{prefix}norm", x, 1e-6)


def bert_attention(state, name, hidden, source, mask):
    """med.py's BertSelfAttention (keys and values from `source`: the text itself, or the image's tokens) and
    BertSelfOutput."""
    heads = TEXT_WIDTH // 64

    def split(x):
        return x.view(*x.shape[:-1], heads, TEXT_WIDTH // heads).permute(0, 2, 1, 3)

    q = split(linear(state, f"{name}.self.query", hidden))
    k, v = split(linear(state, f"{name}.self.key", source)), split(linear(state, f"{name}.self.value", source))
    scores = q @ k.transpose(-1, -2) / math.sqrt(TEXT_WIDTH // heads) + mask
    context = (scores.softmax(dim=-1) @ v).permute(0, 2, 1, 3).reshape(*hidden.shape)
    return layer_norm(state, f"{name}.output.LayerNorm", linear(state, f"{name}.output.dense", context) + hidden, 1e-12)


def text_encoder(state, input_ids, attention_mask, image_embeds):
    """med.py's BertModel.forward in multimodal mode: word and position embeddings, LayerNorm (eps 1e-12); each
    layer's self-attention under the extended mask (1 - mask) * -10000, cross-attention to every image token (their
    mask all ones: 0), the feed-forward with exact GELU."""
    prefix = "blip.text_encoder."
    x = state[f"{prefix}embeddings.word_embeddings.weight"][input_ids]
    x = x + state[f"{prefix}embeddings.position_embeddings.weight"][: input_ids.shape[1]]
    x = layer_norm(state, f"{prefix}embeddings.LayerNorm", x, 1e-12)
    mask = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
    image_mask = (1.0 - torch.ones(image_embeds.shape[:-1])[:, None, None, :]) * -10000.0
    for layer in range(TEXT_LAYERS):
        name = f"{prefix}encoder.layer.{layer}."
        x = bert_attention(state, f"{name}attention", x, x, mask)
        x = bert_attention(state, f"{name}crossattention", x, image_embeds, image_mask)
        hidden = F.gelu(linear(state, f"{name}intermediate.dense", x))
        x = layer_norm(state, f"{name}output.LayerNorm", linear(state, f"{name}output.dense", hidden) + x, 1e-12)
    return x


def image_reward_score(state, tokenizer, prompt: str, picture: Image.Image) -> float:
    """ImageReward.score(prompt, image)."""
    text = tokenizer(prompt, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    image_embeds = visual_encoder(state, transform(picture, GRID * PATCH)[None])
    features = text_encoder(state, text.input_ids, text.attention_mask, image_embeds)[:, 0, :].float()
    for index in (0, 2, 4, 6, 7):
        features = linear(state, f"mlp.layers.{index}", features)
    return float((features - MEAN) / STD)


def blip_tokenizer(vocabulary_directory: str) -> BertTokenizer:
    """BLIP's init_tokenizer: BERT's, with [DEC] as bos and [ENC] an additional special token."""
    tokenizer = BertTokenizer.from_pretrained(vocabulary_directory)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


# ------------------------------------------------------------------ the tests


def test_a_converted_imagereward_checkpoint_scores_as_imagereward(tmp_path):
    """`dovetail convert-imagereward ImageReward.pt TOKENIZER OUT`, then the `image_reward` reward on OUT, batched
    by 2 (the last batch short): ImageReward's scores of each image and prompt, one by one (<= 1e-5). Grey, RGB,
    wide and tall images (resized and cropped), a prompt past 35 tokens, a word outside the vocabulary. The directory
    passes the config's check; a CLIP directory does not."""
    vocabulary = bert_vocabulary(tmp_path / "bert")
    tokenizer = blip_tokenizer(vocabulary)
    state = image_reward_checkpoint(0, len(tokenizer))
    torch.save(state, tmp_path / "ImageReward.pt")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["convert-imagereward", str(tmp_path / "ImageReward.pt"), vocabulary, str(out)])
    assert result.exit_code == 0, result.output
    assert model_problem("image_reward", out) is None
    assert "not a ...BlipForImageTextRetrieval" in str(
        model_problem("image_reward", Path(clip_directory(tmp_path / "clip", 1.0)))
    )
    sources = RewardSources({"image_reward": RewardModel(str(out), batch_size=2)})
    for seed, shape in enumerate([(20, 12, 3), (12, 26, 3), (40, 30, 3), (16, 16)]):
        images = random_images(seed, len(PROMPTS), shape)
        pixels = (np.clip(images, 0, 1) * 255).round().astype(np.uint8)
        pictures = [Image.fromarray(image).convert("RGB") for image in pixels]
        expected = [image_reward_score(state, tokenizer, p, picture) for p, picture in zip(PROMPTS, pictures)]
        scores = score(images, PROMPTS, {"image_reward": 1.0}, sources=sources)["image_reward"]
        np.testing.assert_allclose(scores, expected, atol=1e-5, rtol=0)
        assert np.ptp(expected) > 0.1  # the scores differ from sample to sample: the match is not a constant's


def test_convert_imagereward_refuses_what_is_not_an_imagereward_checkpoint(tmp_path):
    """A missing file, a file that is no checkpoint, another model's state dict, an ImageReward one without a tensor
    or without its score head, a directory without a tokenizer or with another vocabulary than the checkpoint's, an
    existing OUT: one line naming the file and the fix, exit 2, no traceback, nothing written. A converted directory
    without its score head fails the config's check."""
    vocabulary = bert_vocabulary(tmp_path / "bert")
    state = image_reward_checkpoint(1, len(blip_tokenizer(vocabulary)))
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    torch.save({"visual.conv1.weight": torch.zeros(2, 3, 4, 4)}, tmp_path / "open_clip.pt")
    torch.save({k: v for k, v in state.items() if "crossattention" not in k}, tmp_path / "no_cross.pt")
    torch.save({k: v for k, v in state.items() if not k.startswith("mlp.")}, tmp_path / "no_head.pt")
    torch.save({k: v for k, v in state.items() if "vision_proj" not in k}, tmp_path / "no_projection.pt")
    torch.save(state, tmp_path / "ImageReward.pt")
    (tmp_path / "exists").mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "vocab.txt").write_text((tmp_path / "bert" / "vocab.txt").read_text() + "extra\n")
    cases = [
        ("missing.pt", vocabulary, "out", "missing.pt", "ImageReward.pt"),
        ("notes.txt", vocabulary, "out", "notes.txt", "ImageReward.pt"),
        ("open_clip.pt", vocabulary, "out", "not an ImageReward checkpoint", "ImageReward.pt"),
        ("no_cross.pt", vocabulary, "out", "crossattention", "ImageReward.pt"),
        ("no_head.pt", vocabulary, "out", "score head", "ImageReward.pt"),
        ("no_projection.pt", vocabulary, "out", "has no tensor blip.vision_proj.weight", "ImageReward.pt"),
        ("ImageReward.pt", str(tmp_path / "exists"), "out", "has no vocab.txt", "bert-base-uncased"),
        ("ImageReward.pt", str(other), "out", "embeds", "bert-base-uncased"),
        ("ImageReward.pt", vocabulary, "exists", "exists", "new directory"),
    ]
    for checkpoint, tokenizer, out, names, fix in cases:
        arguments = ["convert-imagereward", str(tmp_path / checkpoint), tokenizer, str(tmp_path / out)]
        result = CliRunner().invoke(app, arguments)
        assert result.exit_code == 2, (checkpoint, result.output)
        assert names in result.output and fix in result.output, (checkpoint, result.output)
        assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()
    converted = tmp_path / "converted"
    result = CliRunner().invoke(
        app, ["convert-imagereward", str(tmp_path / "ImageReward.pt"), vocabulary, str(converted)]
    )
    assert result.exit_code == 0, result.output
    (converted / "image_reward_head.safetensors").unlink()
    assert "has no image_reward_head.safetensors" in str(model_problem("image_reward", converted))
