"""An open_clip (or OpenAI CLIP) checkpoint as a transformers `CLIPModel`: how a user brings HPS v2
(`HPS_v2_compressed.pt`, open_clip's ViT-H-14 fine-tuned) to the `hps_v2` reward, which loads a CLIPModel directory
as the other CLIP rewards do (`dovetail convert-clip`).

open_clip's CLIP (open_clip/model.py, transformer.py) and transformers' CLIPModel compute the same function under
other names: the vision tower's `conv1` is the patch embedding (no bias), `class_embedding` and
`positional_embedding` the embeddings, `ln_pre` the pre-layernorm, each residual block's `ln_1`, fused
`attn.in_proj_weight` / `in_proj_bias` (q, k and v stacked), `attn.out_proj`, `ln_2`, `mlp.c_fc`, `mlp.c_proj` a
CLIP encoder layer's `layer_norm1`, `q_proj` / `k_proj` / `v_proj`, `out_proj`, `layer_norm2`, `mlp.fc1`, `mlp.fc2`;
`ln_post` the post-layernorm of the class token, and `proj` (width x embed) the visual projection's transposed
weight. The text tower (the checkpoint's top level) has `token_embedding`, `positional_embedding`, the blocks,
`ln_final` and `text_projection` (width x embed); it pools at the end-of-text token, the vocabulary's largest id,
which transformers finds as the first `eos_token_id`. The sizes are read off the tensors' shapes, the heads as
width / 64 (open_clip's head width); the activation is GELU, or QuickGELU for OpenAI's own weights
(`quick_gelu`)."""

import re

import torch
from transformers import CLIPConfig, CLIPModel

HEAD_WIDTH = 64
"""open_clip's width of an attention head (`VisionCfg.head_width`; the text tower's heads are width / 64 too)."""

END_OF_TEXT = 49407
"""CLIP's BPE vocabulary's end-of-text token, its largest id (open_clip's tokenizer, transformers' CLIPTokenizer)."""


def checkpoint_state(loaded: object) -> dict[str, torch.Tensor]:
    """The state dict of a loaded open_clip checkpoint: the object itself, or its `state_dict` entry (as open_clip's
    training and HPS v2 save it), without DistributedDataParallel's `module.` prefix."""
    state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else None
    if not isinstance(state, dict) or "visual.conv1.weight" not in {k.removeprefix("module.") for k in state}:
        raise ValueError("is not an open_clip ViT checkpoint (no visual.conv1.weight in its state dict)")
    return {key.removeprefix("module."): value for key, value in state.items()}


def clip_config(state: dict[str, torch.Tensor], quick_gelu: bool = False) -> CLIPConfig:
    """The CLIPConfig of an open_clip ViT checkpoint, its sizes read from the tensors."""

    def layers(prefix: str) -> int:
        found = {int(m[1]) for key in state if (m := re.match(rf"{re.escape(prefix)}resblocks\.(\d+)\.", key))}
        return len(found)

    vision_width, _, patch, _ = state["visual.conv1.weight"].shape
    grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    vocabulary, text_width = state["token_embedding.weight"].shape
    act = "quick_gelu" if quick_gelu else "gelu"
    vision = {
        "hidden_size": vision_width,
        "intermediate_size": state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
        "num_hidden_layers": layers("visual.transformer."),
        "num_attention_heads": vision_width // HEAD_WIDTH,
        "patch_size": patch,
        "image_size": grid * patch,
        "hidden_act": act,
        "layer_norm_eps": 1e-5,
    }
    text = {
        "vocab_size": vocabulary,
        "hidden_size": text_width,
        "intermediate_size": state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
        "num_hidden_layers": layers("transformer."),
        "num_attention_heads": text_width // HEAD_WIDTH,
        "max_position_embeddings": state["positional_embedding"].shape[0],
        "hidden_act": act,
        "layer_norm_eps": 1e-5,
        "eos_token_id": END_OF_TEXT,
        "bos_token_id": END_OF_TEXT - 1,
        "pad_token_id": 0,
    }
    return CLIPConfig(
        text_config=text,
        vision_config=vision,
        projection_dim=state["text_projection"].shape[1],
        logit_scale_init_value=2.6592,
    )


def _blocks(state: dict[str, torch.Tensor], source: str, target: str, count: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for layer in range(count):
        theirs, ours = f"{source}resblocks.{layer}.", f"{target}encoder.layers.{layer}."
        for name in ("weight", "bias"):
            q, k, v = state[f"{theirs}attn.in_proj_{name}"].chunk(3)
            out |= {f"{ours}self_attn.q_proj.{name}": q, f"{ours}self_attn.k_proj.{name}": k}
            out |= {f"{ours}self_attn.v_proj.{name}": v}
            out[f"{ours}self_attn.out_proj.{name}"] = state[f"{theirs}attn.out_proj.{name}"]
            out[f"{ours}layer_norm1.{name}"] = state[f"{theirs}ln_1.{name}"]
            out[f"{ours}layer_norm2.{name}"] = state[f"{theirs}ln_2.{name}"]
            out[f"{ours}mlp.fc1.{name}"] = state[f"{theirs}mlp.c_fc.{name}"]
            out[f"{ours}mlp.fc2.{name}"] = state[f"{theirs}mlp.c_proj.{name}"]
    return out


def clip_model(state: dict[str, torch.Tensor], quick_gelu: bool = False) -> CLIPModel:
    """A transformers CLIPModel computing what the open_clip checkpoint `state` computes (fp32)."""
    config = clip_config(state, quick_gelu)
    vision, text = config.vision_config, config.text_config
    weights = {
        "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
        "vision_model.embeddings.patch_embedding.weight": state["visual.conv1.weight"],
        "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
        "vision_model.pre_layrnorm.weight": state["visual.ln_pre.weight"],
        "vision_model.pre_layrnorm.bias": state["visual.ln_pre.bias"],
        "vision_model.post_layernorm.weight": state["visual.ln_post.weight"],
        "vision_model.post_layernorm.bias": state["visual.ln_post.bias"],
        "visual_projection.weight": state["visual.proj"].T,
        "text_model.embeddings.token_embedding.weight": state["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": state["positional_embedding"],
        "text_model.final_layer_norm.weight": state["ln_final.weight"],
        "text_model.final_layer_norm.bias": state["ln_final.bias"],
        "text_projection.weight": state["text_projection"].T,
        "logit_scale": state["logit_scale"].reshape(()),
    }
    weights |= _blocks(state, "visual.transformer.", "vision_model.", vision.num_hidden_layers)
    weights |= _blocks(state, "transformer.", "text_model.", text.num_hidden_layers)
    model = CLIPModel(config).eval()
    expected = {k for k in model.state_dict() if not k.endswith("position_ids")}
    if missing := sorted(expected - weights.keys()):
        raise ValueError(f"has no tensor for {missing[0]} of transformers' CLIPModel")
    model.load_state_dict({k: v.float().contiguous() for k, v in weights.items()}, strict=False)
    return model
