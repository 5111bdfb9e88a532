"""Vision towers of CLIP and SigLIP (standalone, the vision half of a dual encoder, or LLaVA's
``vision_tower``) -> `EncoderSpec`, and their tensor names.

Both families share the block layout (``encoder.layers.{i}.self_attn.*``, ``layer_norm1/2``,
``mlp.fc1/fc2``). CLIP adds a class token, a bias-free patch embedding and a pre-norm
(``pre_layrnorm``); its ``last_hidden_state`` is *not* post-normed (``post_layernorm`` only feeds
the pooled output), while SigLIP's is. A multimodal model that picks hidden states
(``vision_feature_layer``) reads raw block outputs of either, never the post-norm.
"""

from __future__ import annotations

from harmonia.errors import ConfigError
from harmonia.model.hf.io import Table, find_prefix, rename
from harmonia.model.spec import EncoderSpec, TransformerSpec

BLOCKS: Table = [
    *[(f"encoder.layers.{{i}}.self_attn.{p}.", f"layers.{{i}}.attn.{q}.")
      for p, q in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj"))],
    ("encoder.layers.{i}.layer_norm1.", "layers.{i}.attn_norm."),
    ("encoder.layers.{i}.layer_norm2.", "layers.{i}.mlp_norm."),
    ("encoder.layers.{i}.mlp.fc1.", "layers.{i}.mlp.fc1."),
    ("encoder.layers.{i}.mlp.fc2.", "layers.{i}.mlp.fc2."),
]
TABLES: dict[str, Table] = {
    "clip": [
        ("embeddings.patch_embedding.", "patch_embed."),
        ("embeddings.class_embedding", "cls_token"),
        ("embeddings.position_embedding.weight", "pos_embed"),
        ("pre_layrnorm.", "pre_norm."),
        *BLOCKS,
        ("post_layernorm.", "post_norm."),
    ],
    "siglip": [
        ("embeddings.patch_embedding.", "patch_embed."),
        ("embeddings.position_embedding.weight", "pos_embed"),
        *BLOCKS,
        ("post_layernorm.", "post_norm."),
    ],
}
ANCHOR = "embeddings.patch_embedding.weight"
MODEL_TYPES = {"clip": ("clip_vision_model", "clip"), "siglip": ("siglip_vision_model", "siglip")}
ACTS = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "quick_gelu": "quick"}
STRATEGIES = ("default", "full")


def vision_family(config: dict) -> str:
    """``clip`` or ``siglip`` from a config's ``model_type``; `ConfigError` for anything else."""
    kind = config.get("model_type")
    for family, kinds in MODEL_TYPES.items():
        if kind in kinds:
            return family
    raise ConfigError(
        f"config model_type={kind!r} is not a CLIP or SigLIP vision model (expected one of "
        f"{[k for ks in MODEL_TYPES.values() for k in ks]}); a whole multimodal checkpoint (llava, ...) is read "
        "with harmonia.model.hf.mllm.mllm_spec_from_hf"
    )


def vision_config(config: dict, family: str | None = None) -> dict:
    """The vision part of a CLIP / SigLIP config (the config itself, or a dual encoder's ``vision_config``)."""
    found = vision_family(config)
    if family is not None and found != family:
        raise ConfigError(f"config model_type={config.get('model_type')!r} is a {found} model, not {family}")
    return config["vision_config"] if config["model_type"] in ("clip", "siglip") else config


def _check_math(vc: dict, family: str) -> None:
    if vc.get("hidden_act") not in ACTS:
        raise ConfigError(f"{family} vision hidden_act={vc.get('hidden_act')!r} is not implemented; "
                          f"expected one of {sorted(ACTS)}")
    if vc.get("attention_dropout", 0.0):
        raise ConfigError(f"{family} vision attention_dropout={vc['attention_dropout']} is not implemented "
                          "(harmonia trains without dropout); set it to 0.0")


def feature_blocks(layer: int | list[int], n_layers: int) -> tuple[int, ...]:
    """Block counts of LLaVA's ``vision_feature_layer`` (hidden state ``-2`` of 24 blocks -> 23; 0 is the
    embeddings output, allowed beside a block)."""
    indices = [layer] if isinstance(layer, int) else list(layer)
    if not indices or any(not isinstance(i, int) or isinstance(i, bool) for i in indices):
        raise ConfigError(f"vision_feature_layer={layer!r} must be an int or a non-empty list of ints")
    blocks = tuple(i if i >= 0 else n_layers + 1 + i for i in indices)
    if any(not 0 <= k <= n_layers for k in blocks) or max(blocks) == 0:
        raise ConfigError(
            f"vision_feature_layer={layer!r} selects hidden states {blocks} of a {n_layers}-block tower; "
            f"expected hidden states 0..{n_layers} with at least one block output (the embeddings alone, "
            "hidden state 0 by itself, is not implemented: an encoder runs at least one block; select it "
            "beside a block, e.g. [0, -1])"
        )
    return blocks


def vision_spec_from_hf(config: dict, name: str, family: str | None = None,
                        feature_layer: int | list[int] | None = None, strategy: str | None = None,
                        token_merge: int = 1) -> EncoderSpec:
    """An `EncoderSpec` of a CLIP or SigLIP vision tower.

    Args:
        config: the tower's config (or a dual encoder's, whose ``vision_config`` is read).
        name: the encoder's name.
        family: ``clip`` or ``siglip`` to insist on one; None accepts either.
        feature_layer: LLaVA's ``vision_feature_layer`` (int or list); None = the tower's own
            ``last_hidden_state`` (CLIP: last block, no post-norm; SigLIP: post-normed).
        strategy: LLaVA's ``vision_feature_select_strategy`` (``default`` drops the first token,
            ``full`` keeps all); None = drop the class token when there is one.
        token_merge: patches merged into one LLM token.
    """
    vc = vision_config(config, family)
    family = vision_family(config)
    _check_math(vc, family)
    n = vc["num_hidden_layers"]
    blocks = (n,) if feature_layer is None else feature_blocks(feature_layer, n)
    if strategy is not None and strategy not in STRATEGIES:
        raise ConfigError(f"vision_feature_select_strategy={strategy!r} is not implemented; expected {STRATEGIES}")
    body = TransformerSpec(
        n_layers=max(blocks), hidden=vc["hidden_size"], n_heads=vc["num_attention_heads"],
        ffn_hidden=vc["intermediate_size"], norm_eps=vc["layer_norm_eps"], gelu_approximate=ACTS[vc["hidden_act"]],
    )
    clip = family == "clip"
    return EncoderSpec(
        name, ("image", "video"), body, patch_size=vc["patch_size"], image_size=vc["image_size"],
        channels=vc["num_channels"], patch_bias=not clip, cls_token=clip, pre_norm=clip,
        post_norm=feature_layer is None and not clip, token_merge=token_merge,
        feature_layers=blocks if isinstance(feature_layer, list) else (),
        dropped_tokens=None if strategy is None else int(strategy == "default"),
    )


def vision_names(keys: list[str], family: str) -> dict[str, str]:
    """Our encoder names -> the checkpoint's names of a CLIP / SigLIP tower (keys only, no tensors)."""
    prefix = find_prefix(dict.fromkeys(keys), ANCHOR, f"{family} vision")
    return rename({k: k for k in keys}, TABLES[family], to_ours=True, src_prefix=prefix)
