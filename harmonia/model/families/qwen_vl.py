"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``, ``Qwen3VLForConditionalGeneration``).

Their math, as transformers computes it: the native-resolution tower (`harmonia.model.qwen_vit`) over
the processor's packed patches and ``grid_thw``, its merger (our projector ``vision_proj``), the
tokens spliced in at the ``image_token_id`` / ``video_token_id`` positions, one causal mask over all
tokens, and the text model with multimodal RoPE: three position rows per token
(`harmonia.model.mrope.rope_index`), restarting with every packed sample.

The checkpoint: ``model.visual.*`` (``visual.*`` in older files) is the tower and its merger,
``model.language_model.*`` (``model.*``) and ``lm_head`` the LLM. The processor's numbers
(``min_pixels`` / ``max_pixels``, patch, merge and temporal patch sizes) come from the
checkpoint's ``preprocessor_config.json``, the video processor's (frame rate and bounds, frame
sizes) from its video processor config (`processor_numbers`).

Qwen3-VL adds its learned position table to the tower, interleaves the LLM's rotary rows and adds
DeepStack: the outputs of some tower blocks, merged by mergers of their own, are added at the item
positions after the LLM's first blocks. Those features cross the boundary beside the item tokens,
as wider rows (`harmonia.model.projector.DeepStackProjector`, `harmonia.model.llm.DecoderLM`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from harmonia.errors import ConfigError
from harmonia.model.families.base import Family
from harmonia.model.hf.llama_config import llm_spec_from_hf
from harmonia.model.hf.qwen_vision import merger_names
from harmonia.model.qwen_spec import MAX_PIXELS, MIN_PIXELS, native_encoder_spec, projector_spec, spec_from_hf
from harmonia.model.spec import MLLMSpec
from harmonia.model.video_spec import VideoNumbers, video_config

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
QWEN3_MROPE = [24, 20, 20]  # transformers' Qwen3-VL default when rope_parameters leaves mrope_section out
_TEXT_ONLY = ("layer_types", "max_window_layers")  # read by the LLM adapter from the text config's own fields


def _text_config(config: dict, name: str) -> tuple[dict, tuple[int, ...]]:
    """The text config as a ``qwen2`` (``qwen3`` for Qwen3-VL) LLM config, and its ``mrope_section``."""
    text = dict(config["text_config"])
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    qwen3 = config.get("model_type") == "qwen3_vl"
    section = rope.pop("mrope_section", QWEN3_MROPE if qwen3 else None)
    if not section:
        raise ConfigError(f"{name}: text_config.rope_parameters has no mrope_section; a Qwen-VL text model turns "
                          "its rotary frequencies by three position rows")
    interleaved = rope.pop("mrope_interleaved", qwen3)
    if bool(interleaved) != qwen3:
        raise ConfigError(f"{name}: text_config.rope_parameters.mrope_interleaved={interleaved} is not implemented for "
                          f"{config.get('model_type')} (Qwen3-VL interleaves its rotary rows, the others do not)")
    rope.pop("type", None)
    text.pop("rope_scaling", None)
    text["rope_parameters"] = rope
    text["model_type"] = "qwen3" if qwen3 else "qwen2"
    text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings")))
    return text, tuple(int(v) for v in section)


def qwen_vl_spec_from_hf(config: dict, name: str = "qwen-vl") -> MLLMSpec:
    """The `MLLMSpec` of a Qwen2-VL or Qwen2.5-VL checkpoint from its completed ``config.json``
    (the processor's pixel bounds at their defaults; `processor_numbers` reads the checkpoint's)."""
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise ConfigError(f"config model_type={kind!r} is not one of {MODEL_TYPES}")
    text, section = _text_config(config, name)
    tower = spec_from_hf(config)
    llm = replace(llm_spec_from_hf(text, name=f"{name}-text"), mrope_section=section,
                  mrope_interleaved=kind == "qwen3_vl", deepstack=len(tower.deepstack_layers))
    if tower.out_dim != llm.hidden:
        raise ConfigError(f"{name}: the vision merger emits {tower.out_dim}-wide tokens but the LLM is {llm.hidden} "
                          "wide (vision_config out_hidden_size / hidden_size)")
    vision = native_encoder_spec(tower, f"{name}-vision")
    tokens = {m: config.get(f"{m}_token_id") for m in ("image", "video")}
    missing = [m for m, t in tokens.items() if t is None]
    if missing:
        raise ConfigError(f"{name}: config.json has no {missing[0]}_token_id")
    return MLLMSpec(name, {"vision": vision}, {"vision_proj": projector_spec(tower, "vision_proj")}, llm,
                    item_attention="causal", item_token_ids={m: int(t) for m, t in tokens.items()})


def processor_numbers(spec: MLLMSpec, root: Path) -> MLLMSpec:
    """``spec`` with the pixel bounds of the checkpoint's ``preprocessor_config.json`` and its video
    processor's numbers (transformers' defaults without them); their patch, merge and temporal
    patch sizes must be the tower's."""
    enc = spec.encoders["vision"]
    enc = replace(enc, video=_video_numbers(root, enc))
    path = Path(root) / "preprocessor_config.json"
    if not path.is_file():
        return replace(spec, encoders={"vision": enc})
    numbers = json.loads(path.read_text())
    size = numbers.get("size") or {}
    low = numbers.get("min_pixels", size.get("shortest_edge", MIN_PIXELS))
    high = numbers.get("max_pixels", size.get("longest_edge", MAX_PIXELS))
    want = {"patch_size": enc.patch_size, "merge_size": enc.native.merge_size,
            "temporal_patch_size": enc.temporal_merge}
    wrong = {k: numbers[k] for k, v in want.items() if k in numbers and numbers[k] != v}
    if wrong:
        raise ConfigError(f"{path}: {wrong} differ from the vision tower's {want} (config.json)")
    return replace(spec, encoders={"vision": replace(enc, min_pixels=int(low), max_pixels=int(high))})


def _video_numbers(root: Path, enc) -> VideoNumbers:
    """The video processor's numbers (`harmonia.model.video_spec.video_config`; Qwen3-VL's read as its
    own processor reads them); its patch, merge and temporal patch sizes must be the tower's."""
    style = "qwen3_vl" if enc.native.family == "qwen3_vl" else "qwen2_vl"
    found = video_config(root)
    if found is None:
        return VideoNumbers.qwen3() if style == "qwen3_vl" else VideoNumbers()
    path, numbers = found
    want = {"patch_size": enc.patch_size, "merge_size": enc.native.merge_size,
            "temporal_patch_size": enc.temporal_merge}
    wrong = {k: numbers[k] for k, v in want.items() if k in numbers and numbers[k] != v}
    if wrong:
        raise ConfigError(f"{path}: {wrong} differ from the vision tower's {want} (config.json)")
    return VideoNumbers.from_config(numbers, enc.patch_size * enc.native.merge_size, str(path), style)


def projector_names(keys: list[str], module: str) -> dict[str, str]:
    """The merger (``visual.merger.*``) as our projector ``vision_proj``."""
    return merger_names(keys)


def tokenized_sample(spec: MLLMSpec, input_ids, pixel_values=None, labels=None, sample_id=None,
                     image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None,
                     second_per_grid_ts: list[float] | None = None, tokens_per_second: float | None = None):
    """`harmonia.model.families.qwen_vl_samples.tokenized_sample` (loaded on first use: reading a
    spec imports no torch)."""
    from harmonia.model.families.qwen_vl_samples import tokenized_sample as build

    return build(spec, input_ids, pixel_values, labels, sample_id, image_grid_thw, pixel_values_videos,
                 video_grid_thw, second_per_grid_ts, tokens_per_second)


QWEN_VL = Family("Qwen-VL", MODEL_TYPES, qwen_vl_spec_from_hf, non_llm_parts=("visual.",),
                 projector_names=projector_names, tokenized_sample=tokenized_sample,
                 processor_numbers=processor_numbers)
