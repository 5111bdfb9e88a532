"""Real multimodal checkpoints -> `MLLMSpec`: ``LlavaForConditionalGeneration``, or a composition of
an LLM checkpoint with encoder checkpoints (fresh projectors).

LLaVA's math, as transformers computes it: the vision tower's hidden state ``vision_feature_layer``
(an int, or a list whose states are concatenated on the feature dim), the first token dropped under
the ``default`` select strategy (CLIP's class token, SigLIP's first patch) or kept under ``full``,
then ``multi_modal_projector`` (``linear_1 -> projector_hidden_act -> linear_2``) and the text model
with the projected features at the ``image_token_id`` positions, one causal mask over all tokens.
The spec holds exactly that: the encoder has only the blocks the selected states need and no
post-norm, its width is that of the concatenation, and items attend causally.

Loading stage by stage and export live in `harmonia.model.hf.stages` and `harmonia.model.hf.export`
and are re-exported here: `mllm_spec_from_hf`, `load_module_state` and `export_hf` are the whole
interface a training job needs.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from harmonia.errors import ConfigError, SampleError
from harmonia.model.batch import ItemInputs, TokenizedSample
from harmonia.model.hf.clip import vision_spec_from_hf
from harmonia.model.hf.export import export_hf
from harmonia.model.hf.io import read_config, read_full_config
from harmonia.model.hf.llama import MODEL_TYPES as LLM_TYPES
from harmonia.model.hf.llama import llm_spec_from_hf
from harmonia.model.hf.source import HFSource, parse_source
from harmonia.model.hf.stages import load_module_state
from harmonia.model.hf.whisper import whisper_spec_from_hf
from harmonia.model.llm import IGNORE_INDEX
from harmonia.model.presets import projector_for
from harmonia.model.spec import EncoderSpec, MLLMSpec, ProjectorSpec

__all__ = ["export_hf", "llava_spec_from_hf", "load_module_state", "mllm_spec_from_hf", "tokenized_sample"]

MULTIMODAL_TYPES = ("llava",)
NOT_IMPLEMENTED = {
    "llava_next": "LLaVA-NeXT (anyres tiling with image_grid_pinpoints and an image_newline parameter)",
    "llava_onevision": "LLaVA-OneVision (anyres tiling, image_newline, video pooling)",
    "llava_next_video": "LLaVA-NeXT-Video (anyres tiling, video pooling)",
    "vipllava": "VipLLaVA (a layer-normed multi-layer projector)",
}
PROJECTOR_ACTS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                  "quick_gelu": "quick_gelu", "silu": "silu", "swish": "silu", "relu": "relu"}


def mllm_spec_from_hf(source, token_merge: dict[str, int] | None = None) -> MLLMSpec:
    """The `MLLMSpec` of a whole HF multimodal checkpoint or of a composition (see `parse_source`).

    Args:
        source: a ``LlavaForConditionalGeneration`` directory, an LLM directory (Llama, Mistral, Qwen2,
            Qwen3: an MLLM without encoders), or ``{"llm": DIR, "encoders":
            {"vision": DIR, "audio": DIR}}`` (CLIP / SigLIP vision, Whisper), or a directory
            `export_hf` wrote for a composition.
        token_merge: a composition's encoder name -> tokens merged into one LLM token (default 1).

    Raises:
        ConfigError: an unsupported ``model_type`` or a config field harmonia does not implement,
            named in the message.
    """
    src = parse_source(source)
    if src.is_composition:
        return composition_spec(src, token_merge or {})
    if token_merge:
        raise ConfigError("token_merge applies to a composition's fresh projectors, not to a whole checkpoint")
    kind = read_config(src.root).get("model_type")
    if kind in NOT_IMPLEMENTED:
        raise ConfigError(f"{src.root}: model_type={kind!r} ({NOT_IMPLEMENTED[kind]}) is not implemented; "
                          f"supported multimodal checkpoints: {MULTIMODAL_TYPES}")
    if kind in LLM_TYPES:  # an LLM alone: a graph of one module, no encoders or projectors
        return MLLMSpec(src.root.name, {}, {}, llm_spec_from_hf(read_full_config(src.root), name=src.root.name))
    if kind not in MULTIMODAL_TYPES:
        raise ConfigError(
            f"{src.root}: model_type={kind!r} is neither a supported multimodal checkpoint {MULTIMODAL_TYPES} nor "
            f"an LLM {LLM_TYPES}; an encoder alone goes into a composition {{'llm': DIR, 'encoders': {{'vision': DIR}}}}"
        )
    return llava_spec_from_hf(read_full_config(src.root), name=src.root.name)


def llava_spec_from_hf(config: dict, name: str = "llava") -> MLLMSpec:
    """The `MLLMSpec` of a ``LlavaForConditionalGeneration`` from its completed ``config.json``."""
    if config.get("model_type") != "llava":
        raise ConfigError(f"config model_type={config.get('model_type')!r} is not 'llava'")
    text = dict(config["text_config"])
    text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    llm = llm_spec_from_hf(text, name=text.get("_name_or_path") or f"{name}-text")
    vision = vision_spec_from_hf(
        config["vision_config"], f"{name}-vision", feature_layer=config.get("vision_feature_layer", -2),
        strategy=config.get("vision_feature_select_strategy", "default"),
    )
    vision = replace(vision, modalities=("image",), max_tiles=1)  # LlavaProcessor: one crop per image
    act = config.get("projector_hidden_act", "gelu")
    if act not in PROJECTOR_ACTS:
        raise ConfigError(f"projector_hidden_act={act!r} is not implemented; expected one of {sorted(PROJECTOR_ACTS)}")
    projector = ProjectorSpec("vision_proj", in_dim=vision.out_dim, out_dim=llm.hidden, hidden=llm.hidden,
                              n_layers=2, input_norm=False, act=PROJECTOR_ACTS[act],
                              bias=bool(config.get("multimodal_projector_bias", True)))
    image_token = config.get("image_token_id", config.get("image_token_index"))
    if image_token is None:
        raise ConfigError(f"LLaVA config {name!r} has no image_token_index / image_token_id")
    return MLLMSpec(name, {"vision": vision}, {"vision_proj": projector}, llm, item_attention="causal",
                    item_token_ids={"image": int(image_token)})


def _encoder_spec(name: str, path: Path, token_merge: int) -> EncoderSpec:
    config = read_full_config(path)
    if config.get("model_type") == "whisper":
        return whisper_spec_from_hf(config, name=path.name, token_merge=token_merge)
    try:
        return vision_spec_from_hf(config, path.name, token_merge=token_merge)
    except ConfigError as e:
        raise ConfigError(f"composition encoder {name!r} at {path}: {e} (encoders: CLIP or SigLIP vision, "
                          "Whisper)") from e


def composition_spec(src: HFSource, token_merge: dict[str, int]) -> MLLMSpec:
    """LLM + encoders from their own checkpoints; InternVL-style projectors (`projector_for`)."""
    unknown = set(token_merge) - set(src.encoders)
    if unknown:
        raise ConfigError(f"token_merge for unknown encoders {sorted(unknown)}; encoders are {sorted(src.encoders)}")
    llm_config = read_full_config(src.llm)
    if llm_config.get("model_type") in (*MULTIMODAL_TYPES, *NOT_IMPLEMENTED):
        raise ConfigError(f"composition llm {src.llm} is a {llm_config['model_type']!r} multimodal checkpoint; "
                          "give it as the whole source instead")
    llm = llm_spec_from_hf(llm_config, name=src.llm.name)
    encoders = {name: _encoder_spec(name, d, token_merge.get(name, 1)) for name, d in src.encoders.items()}
    projectors = {f"{n}_proj": projector_for(f"{n}_proj", e, llm) for n, e in encoders.items()}
    name = "+".join([src.llm.name, *(d.name for d in src.encoders.values())])
    return MLLMSpec(name, encoders, projectors, llm)


def tokenized_sample(spec: MLLMSpec, input_ids: torch.Tensor, pixel_values: torch.Tensor,
                     labels: torch.Tensor | None = None, sample_id=None) -> TokenizedSample:
    """A `TokenizedSample` from what a LLaVA processor returns for one sample.

    Runs of the image token become item segments of `EncoderSpec.llm_tokens_per_tile` tokens, one
    per image of ``pixel_values``. ``labels`` are transformers' (unshifted: the model shifts them);
    harmonia's are aligned with the logits, so they are shifted here.

    Args:
        spec: a LLaVA spec (``item_token_ids["image"]``).
        input_ids: ``(T,)`` with the image token repeated at each image's positions.
        pixel_values: ``(n_images, C, H, W)``.
        labels: ``(T,)`` transformers-style targets, or None for no loss.
    """
    token, enc = spec.item_token_ids.get("image"), spec.encoders.get(spec.encoder_for("image"))
    if token is None:
        raise ConfigError(f"MLLM {spec.name!r} names no image placeholder token (item_token_ids)")
    per_image = enc.llm_tokens_per_tile()
    is_image = (input_ids == token).tolist()
    segments: list[tuple[str, int]] = []
    for flag in is_image:
        kind = "item" if flag else "text"
        if segments and segments[-1][0] == kind and not (kind == "item" and segments[-1][1] == per_image):
            segments[-1] = (kind, segments[-1][1] + 1)
        else:
            segments.append((kind, 1))
    n_images = sum(kind == "item" for kind, _ in segments)
    if any(kind == "item" and n != per_image for kind, n in segments) or n_images != pixel_values.shape[0]:
        raise SampleError(f"sample {sample_id}: {sum(is_image)} image tokens for {pixel_values.shape[0]} images of "
                          f"{per_image} tokens each; expand each image to {per_image} placeholder tokens")
    shifted = torch.full_like(input_ids, IGNORE_INDEX)
    if labels is not None:
        shifted[:-1] = labels[1:]
    module = spec.encoder_for("image")
    items = [ItemInputs(module, pixel_values[i: i + 1]) for i in range(n_images)]
    return TokenizedSample(input_ids, shifted, segments, items, sample_id=sample_id,
                           causal_items=spec.item_attention == "causal")
