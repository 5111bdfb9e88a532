"""Model presets: published architectures and tiny ones for CPU tests.

Each published preset names its source and its published parameter count; a unit test checks that
the spec's count is within 2% of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from harmonia.errors import ConfigError
from harmonia.model.projector_spec import ProjectorSpec
from harmonia.model.spec import EncoderSpec, LLMSpec, MLLMSpec, TransformerSpec
from harmonia.model.training_mode import ModuleTraining


@dataclass(frozen=True)
class Published:
    """A preset with the parameter count its authors publish."""

    spec: EncoderSpec | LLMSpec
    params: float
    source: str


def _vit(name: str, **kw) -> EncoderSpec:
    return EncoderSpec(name=name, modalities=("image", "video"), **kw)


ENCODERS: dict[str, Published] = {
    # google/siglip-so400m-patch14-384 config.json; SiglipVisionModel holds 428.2M incl. the MAP head.
    "siglip-so400m-14-384": Published(
        _vit("siglip-so400m-14-384", body=TransformerSpec(27, 1152, 16, 4304), patch_size=14,
             image_size=384, post_norm=True, token_merge=1,
             head_params=4 * 1152 * 1152 + 4 * 1152 + 1152 + 2 * 1152 + 2 * 1152 * 4304 + 4304 + 1152),
        428.2e6, "Zhai et al. 2023 (SigLIP); HF google/siglip-so400m-patch14-384"),
    # OpenGVLab/InternViT-300M-448px: 24 x 1024, qkv bias, layer scale, class token; 304M.
    "internvit-300m-448": Published(
        _vit("internvit-300m-448", body=TransformerSpec(24, 1024, 16, 4096, layer_scale=True),
             patch_size=14, image_size=448, cls_token=True, post_norm=False, token_merge=4),
        304e6, "Chen et al. 2024 (InternVL 1.5); HF OpenGVLab/InternViT-300M-448px"),
    # OpenGVLab/InternViT-6B-448px-V1-0: 48 x 3200, RMSNorm, qk-norm, no qkv bias; 5.9B.
    "internvit-6b": Published(
        _vit("internvit-6b", body=TransformerSpec(48, 3200, 25, 12800, norm="rmsnorm", qkv_bias=False,
                                                  qk_norm=True, layer_scale=True),
             patch_size=14, image_size=448, cls_token=True, post_norm=False, token_merge=4),
        5.9e9, "Chen et al. 2024 (InternVL, CVPR); HF OpenGVLab/InternViT-6B-448px-V1-0"),
    # openai/clip-vit-large-patch14-336: CLIPVisionModel holds 303.5M (no patch bias, pre/post LN).
    "clip-vit-l-14-336": Published(
        _vit("clip-vit-l-14-336", body=TransformerSpec(24, 1024, 16, 4096), patch_size=14,
             image_size=336, cls_token=True, pre_norm=True, post_norm=True, patch_bias=False),
        303.5e6, "Radford et al. 2021 (CLIP); HF openai/clip-vit-large-patch14-336"),
    # EVA-CLIP-18B: depth 48, width 5120, 40 heads (Sun et al. 2024, Table 1); the MLP width is
    # set so that the vision tower matches the published 17.5B of its 18.1B total.
    "eva-clip-18b": Published(
        _vit("eva-clip-18b", body=TransformerSpec(48, 5120, 40, 25600, layer_scale=True),
             patch_size=14, image_size=224, cls_token=True, post_norm=True),
        17.5e9, "Sun et al. 2024, EVA-CLIP-18B: Scaling CLIP to 18 Billion Parameters"),
    # openai/whisper-large-v3 encoder: 32 x 1280, 128 mels, 1500 positions; 637M of the 1.55B model.
    "whisper-large-v3-encoder": Published(
        EncoderSpec("whisper-large-v3-encoder", ("audio",), TransformerSpec(32, 1280, 20, 5120),
                    n_mels=128, conv_stride=2, chunk_seconds=30.0, max_positions=1500, post_norm=True),
        637e6, "Radford et al. 2022 (Whisper); HF openai/whisper-large-v3"),
}

LLMS: dict[str, Published] = {
    # Llama 3.1 8B / 70B share the Llama 3 architectures (only RoPE scaling and context differ).
    "llama3-8b": Published(
        LLMSpec("llama3-8b", TransformerSpec(32, 4096, 32, 14336, n_kv_heads=8, mlp="swiglu",
                                             norm="rmsnorm", qkv_bias=False, out_bias=False,
                                             mlp_bias=False), vocab_size=128256),
        8.03e9, "Meta 2024 (Llama 3, 3.1); HF meta-llama/Llama-3.1-8B"),
    "llama3-70b": Published(
        LLMSpec("llama3-70b", TransformerSpec(80, 8192, 64, 28672, n_kv_heads=8, mlp="swiglu",
                                              norm="rmsnorm", qkv_bias=False, out_bias=False,
                                              mlp_bias=False), vocab_size=128256),
        70.6e9, "Meta 2024 (Llama 3, 3.1); HF meta-llama/Llama-3.1-70B"),
    "llama3-405b": Published(
        LLMSpec("llama3-405b", TransformerSpec(126, 16384, 128, 53248, n_kv_heads=8, mlp="swiglu",
                                               norm="rmsnorm", qkv_bias=False, out_bias=False,
                                               mlp_bias=False), vocab_size=128256),
        405.9e9, "Meta 2024 (The Llama 3 Herd of Models, Table 3); HF meta-llama/Llama-3.1-405B"),
    "qwen2.5-7b": Published(
        LLMSpec("qwen2.5-7b", TransformerSpec(28, 3584, 28, 18944, n_kv_heads=4, mlp="swiglu",
                                              norm="rmsnorm", qkv_bias=True, out_bias=False,
                                              mlp_bias=False), vocab_size=152064),
        7.61e9, "Qwen Team 2024 (Qwen2.5); HF Qwen/Qwen2.5-7B"),
    "qwen2.5-32b": Published(
        LLMSpec("qwen2.5-32b", TransformerSpec(64, 5120, 40, 27648, n_kv_heads=8, mlp="swiglu",
                                               norm="rmsnorm", qkv_bias=True, out_bias=False,
                                               mlp_bias=False), vocab_size=152064),
        32.5e9, "Qwen Team 2024 (Qwen2.5); HF Qwen/Qwen2.5-32B"),
    "qwen2.5-72b": Published(
        LLMSpec("qwen2.5-72b", TransformerSpec(80, 8192, 64, 29568, n_kv_heads=8, mlp="swiglu",
                                               norm="rmsnorm", qkv_bias=True, out_bias=False,
                                               mlp_bias=False), vocab_size=152064),
        72.7e9, "Qwen Team 2024 (Qwen2.5); HF Qwen/Qwen2.5-72B"),
}

TINY_ENCODERS: dict[str, EncoderSpec] = {
    "tiny-vit": _vit("tiny-vit", body=TransformerSpec(2, 32, 4, 64), patch_size=4, image_size=16,
                     cls_token=True, post_norm=True, token_merge=4),
    "tiny-audio": EncoderSpec("tiny-audio", ("audio",), TransformerSpec(2, 32, 4, 64), n_mels=16,
                              conv_stride=2, chunk_seconds=2.0, max_positions=100, hop_length=320),
}

TINY_LLMS: dict[str, LLMSpec] = {
    "tiny-llm": LLMSpec("tiny-llm", TransformerSpec(4, 48, 4, 96, n_kv_heads=2, mlp="swiglu",
                                                    norm="rmsnorm", qkv_bias=False, out_bias=False,
                                                    mlp_bias=False), vocab_size=256),
}


def encoder_preset(name: str) -> EncoderSpec:
    """An encoder spec by preset name (published or tiny)."""
    if name in ENCODERS:
        return ENCODERS[name].spec
    if name in TINY_ENCODERS:
        return TINY_ENCODERS[name]
    raise ConfigError(f"unknown encoder preset {name!r}; known: {sorted([*ENCODERS, *TINY_ENCODERS])}")


def llm_preset(name: str) -> LLMSpec:
    """An LLM spec by preset name (published or tiny)."""
    if name in LLMS:
        return LLMS[name].spec
    if name in TINY_LLMS:
        return TINY_LLMS[name]
    raise ConfigError(f"unknown LLM preset {name!r}; known: {sorted([*LLMS, *TINY_LLMS])}")


def projector_for(name: str, encoder: EncoderSpec, llm: LLMSpec) -> ProjectorSpec:
    """InternVL-style MLP projector from an encoder (after its token merge) to the LLM width."""
    in_dim = encoder.out_dim * encoder.token_merge
    return ProjectorSpec(name, in_dim=in_dim, out_dim=llm.hidden, hidden=llm.hidden)


def build_mllm(
    name: str,
    llm: str,
    encoders: dict[str, str],
    training: dict[str, str] | None = None,
) -> MLLMSpec:
    """Assemble an MLLM spec from presets.

    Args:
        name: name of the MLLM.
        llm: LLM preset name.
        encoders: module name -> encoder preset name, e.g. ``{"vision": "internvit-300m-448"}``.
        training: module name -> ``full`` / ``frozen`` / ``lora``.
    """
    llm_spec = llm_preset(llm)
    encoder_specs = {module: encoder_preset(preset) for module, preset in encoders.items()}
    projectors = {
        f"{module}_proj": projector_for(f"{module}_proj", enc, llm_spec) for module, enc in encoder_specs.items()
    }
    modes = {m: ModuleTraining(t) for m, t in (training or {}).items()}
    return MLLMSpec(name, encoder_specs, projectors, llm_spec, modes)


MLLM_PRESETS: dict[str, dict] = {
    # InternVL-2.5-8B-like: InternViT-300M + Qwen2.5-7B (InternVL 2.5 pairs InternViT-300M with an 7B LLM).
    "internvl-8b": dict(llm="qwen2.5-7b", encoders={"vision": "internvit-300m-448"}),
    # A vision+audio model: InternViT-300M and Whisper large-v3 encoder with Llama-3-8B.
    "omni-8b": dict(llm="llama3-8b", encoders={"vision": "internvit-300m-448",
                                               "audio": "whisper-large-v3-encoder"}),
    # A large model: InternViT-6B + Llama-3-70B (InternVL 1.5-like scale).
    "internvl-76b": dict(llm="llama3-70b", encoders={"vision": "internvit-6b"}),
    # LLaVA-style: SigLIP-So400m with Llama-3-8B.
    "llava-siglip-8b": dict(llm="llama3-8b", encoders={"vision": "siglip-so400m-14-384"}),
    # LLaVA-1.5-style at 70B: CLIP ViT-L/14-336 with Llama-3-70B.
    "llava-clip-70b": dict(llm="llama3-70b", encoders={"vision": "clip-vit-l-14-336"}),
    # InternVL2.5-38B's vision (InternViT-6B + Qwen2.5-32B) with a Whisper large-v3 audio encoder.
    "omni-38b": dict(llm="qwen2.5-32b", encoders={"vision": "internvit-6b",
                                                  "audio": "whisper-large-v3-encoder"}),
    # A large omni-modal model: InternViT-6B and Whisper large-v3 encoder with Qwen2.5-72B.
    "omni-72b": dict(llm="qwen2.5-72b", encoders={"vision": "internvit-6b",
                                                  "audio": "whisper-large-v3-encoder"}),
    # LLM-only models (no encoders): a published LLM preset as a graph of one module.
    **{name: dict(llm=name, encoders={}) for name in LLMS},
    # Tiny models for CPU tests.
    "tiny-vlm": dict(llm="tiny-llm", encoders={"vision": "tiny-vit"}),
    "tiny-omni": dict(llm="tiny-llm", encoders={"vision": "tiny-vit", "audio": "tiny-audio"}),
}


def mllm_preset(name: str, training: dict[str, str] | None = None) -> MLLMSpec:
    """An MLLM spec by preset name, with optional training modes per module."""
    if name not in MLLM_PRESETS:
        raise ConfigError(f"unknown MLLM preset {name!r}; known: {sorted(MLLM_PRESETS)}")
    return build_mllm(name, training=training, **MLLM_PRESETS[name])
