"""LLaVA and LLaVA-NeXT (``LlavaForConditionalGeneration``, ``LlavaNextForConditionalGeneration``).

LLaVA's math, as transformers computes it: the vision tower's hidden state ``vision_feature_layer``
(an int, or a list whose states are concatenated on the feature dim), the first token dropped under
the ``default`` select strategy (CLIP's class token, SigLIP's first patch) or kept under ``full``,
then ``multi_modal_projector`` (``linear_1 -> projector_hidden_act -> linear_2``) and the text model
with the projected features at the ``image_token_id`` positions, one causal mask over all tokens.
The spec holds exactly that: the encoder has only the blocks the selected states need and no
post-norm, its width is that of the concatenation, and items attend causally.

LLaVA-NeXT is the same model over anyres tiles (``image_grid_pinpoints``: a base tile and a grid per
image, `harmonia.model.anyres`), whose projected features are laid out as transformers'
``pack_image_features`` does, ending each feature row with the ``image_newline`` parameter, which
the projector stage holds (`ProjectorSpec.newline`).
"""

from __future__ import annotations

from dataclasses import replace

from harmonia.errors import ConfigError
from harmonia.model.families.base import Family
from harmonia.model.hf.clip import vision_spec_from_hf
from harmonia.model.hf.io import find_prefix
from harmonia.model.hf.llama_config import llm_spec_from_hf
from harmonia.model.projector_spec import ProjectorSpec
from harmonia.model.spec import MLLMSpec

MODEL_TYPES = ("llava", "llava_next")
PROJECTOR_ACTS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                  "quick_gelu": "quick_gelu", "silu": "silu", "swish": "silu", "relu": "relu"}


def _grid_pinpoints(config: dict, name: str) -> tuple[tuple[int, int], ...]:
    pinpoints = config.get("image_grid_pinpoints")
    pairs = isinstance(pinpoints, list) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, int) for v in p) for p in pinpoints)
    if not pinpoints or not pairs:
        raise ConfigError(f"LLaVA-NeXT config {name!r}: image_grid_pinpoints={pinpoints!r} must be a non-empty list "
                          "of [height, width] pairs")
    return tuple(tuple(p) for p in pinpoints)


def llava_spec_from_hf(config: dict, name: str = "llava") -> MLLMSpec:
    """The `MLLMSpec` of a ``LlavaForConditionalGeneration`` or ``LlavaNextForConditionalGeneration``
    from its completed ``config.json``."""
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise ConfigError(f"config model_type={kind!r} is not one of {MODEL_TYPES}")
    text = dict(config["text_config"])
    # LlavaConfig takes the text config's tying when its own is off; LlavaNextConfig ties by its own flag only.
    tied = config.get("tie_word_embeddings") or (kind == "llava" and text.get("tie_word_embeddings"))
    text["tie_word_embeddings"] = bool(tied)
    llm = llm_spec_from_hf(text, name=text.get("_name_or_path") or f"{name}-text")
    vision = vision_spec_from_hf(
        config["vision_config"], f"{name}-vision", feature_layer=config.get("vision_feature_layer", -2),
        strategy=config.get("vision_feature_select_strategy", "default"),
    )
    if kind == "llava_next":  # anyres: a base tile and a grid of tiles per image
        pinpoints = _grid_pinpoints(config, name)
        most = 1 + max(h // vision.image_size * (w // vision.image_size) for h, w in pinpoints)
        vision = replace(vision, modalities=("image",), max_tiles=most, grid_pinpoints=pinpoints)
    else:
        vision = replace(vision, modalities=("image",), max_tiles=1)  # LlavaProcessor: one crop per image
    act = config.get("projector_hidden_act", "gelu")
    if act not in PROJECTOR_ACTS:
        raise ConfigError(f"projector_hidden_act={act!r} is not implemented; expected one of {sorted(PROJECTOR_ACTS)}")
    projector = ProjectorSpec("vision_proj", in_dim=vision.out_dim, out_dim=llm.hidden, hidden=llm.hidden,
                              n_layers=2, input_norm=False, act=PROJECTOR_ACTS[act],
                              bias=bool(config.get("multimodal_projector_bias", True)), newline=kind == "llava_next")
    image_token = config.get("image_token_id", config.get("image_token_index"))
    if image_token is None:
        raise ConfigError(f"LLaVA config {name!r} has no image_token_index / image_token_id")
    return MLLMSpec(name, {"vision": vision}, {"vision_proj": projector}, llm, item_attention="causal",
                    item_token_ids={"image": int(image_token)})


def projector_names(keys: list[str], module: str) -> dict[str, str]:
    """LLaVA's ``multi_modal_projector.linear_{1,2}`` -> our ``linears.{0,1}``; LLaVA-NeXT's
    ``image_newline`` (beside the projector) -> our ``image_newline``."""
    prefix = find_prefix(dict.fromkeys(keys), "multi_modal_projector.linear_1.weight", "LLaVA projector")
    base = prefix + "multi_modal_projector."
    out = {f"linears.{i}.{p}": f"{base}linear_{i + 1}.{p}" for i in (0, 1) for p in ("weight", "bias")
           if f"{base}linear_{i + 1}.{p}" in keys}
    if prefix + "image_newline" in keys:
        out["image_newline"] = prefix + "image_newline"
    return out


def tokenized_sample(spec: MLLMSpec, input_ids, pixel_values, labels=None, sample_id=None, image_sizes=None):
    """`harmonia.model.families.llava_samples.tokenized_sample` (loaded on first use: reading a spec
    imports no torch)."""
    from harmonia.model.families.llava_samples import tokenized_sample as build

    return build(spec, input_ids, pixel_values, labels, sample_id, image_sizes)


LLAVA = Family("LLaVA", MODEL_TYPES, llava_spec_from_hf,
               non_llm_parts=("vision_tower.", "multi_modal_projector.", "image_newline"),
               projector_names=projector_names, tokenized_sample=tokenized_sample)
