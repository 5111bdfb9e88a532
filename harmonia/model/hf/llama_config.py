"""Llama / Mistral / Qwen2 / Qwen3 ``config.json`` <-> `LLMSpec`, strictly.

Every field of a config is in one of three sets: fields that cannot change the forward pass (ids,
dtype, generation settings, ...: `IGNORED`), fields harmonia implements (`IMPLEMENTED`, per
``model_type``), and fields implemented for some values only (``hidden_act=silu``,
``attention_dropout=0``, ``partial_rotary_factor=1``, Qwen2's ``use_mrope=false``). Any other
field, or an unsupported value, is a `ConfigError` naming it: a checkpoint loads with transformers'
exact numbers or not at all.

Missing fields take the defaults of the installed transformers' config classes (`DEFAULTS`; a unit
test compares them). What transformers 5.23 computes, mirrored here:

- RoPE parameters come from ``rope_scaling`` (older files) or ``rope_parameters``; ``rope_theta``
  inside them wins over the top-level one. Types ``default``, ``linear`` and ``llama3`` are
  implemented (`harmonia.model.layers.rope_inv_freq`); ``llama3`` reads
  ``original_max_position_embeddings`` from the RoPE dict, else ``max_position_embeddings``.
- Mistral: ``sliding_window`` (default 4096) applies to every layer; null = none.
- Qwen2 / Qwen3: ``sliding_window`` applies only with ``use_sliding_window``, to the layers that
  ``layer_types`` marks ``sliding_attention``, or when that list is absent to layers
  ``i >= max_window_layers``.
- Qwen2: q/k/v biases, no output bias. Qwen3: RMSNorm over each head of q and k before RoPE,
  ``head_dim`` from the config (default 128). Llama / Qwen3 ``attention_bias`` puts biases on q,
  k, v and the output; Llama ``mlp_bias`` on the MLP.
"""

from __future__ import annotations

from harmonia.errors import ConfigError
from harmonia.model.spec import LLMSpec, RopeScaling, TransformerSpec

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

IGNORED = frozenset({
    # identity, bookkeeping and storage
    "model_type", "architectures", "_name_or_path", "transformers_version", "torch_dtype", "dtype",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation", "_commit_hash",
    "use_bfloat16", "torchscript", "tokenizer_class",
    # special token ids
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    # inference, initialisation and output switches
    "use_cache", "initializer_range", "max_position_embeddings", "pretraining_tp", "output_attentions",
    "output_hidden_states", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder", "pruned_heads",
    "id2label", "label2id", "problem_type", "finetuning_task", "prefix", "task_specific_params",
    "tf_legacy_loss", "output_scores", "return_dict_in_generate",
    # generation settings older transformers stored in config.json
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
})
"""Fields that do not enter the forward pass of a Llama-family model in transformers."""

_COMMON = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "tie_word_embeddings", "rope_theta",
    "rope_scaling", "rope_parameters", "partial_rotary_factor", "attention_dropout",
})
_QWEN_WINDOW = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
IMPLEMENTED = {
    "llama": _COMMON | {"attention_bias", "mlp_bias"},
    "mistral": _COMMON | {"sliding_window"},
    "qwen2": _COMMON | _QWEN_WINDOW | {"use_mrope"},
    "qwen3": _COMMON | _QWEN_WINDOW | {"attention_bias"},
}
"""Fields harmonia implements, per ``model_type`` (some for some values only, see the module)."""

DEFAULTS = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048},
    "mistral": {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 131072,
                "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "use_sliding_window": False,
              "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
              "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
}
"""transformers' defaults of the fields whose absence changes the model (all types: ``hidden_act``
silu, ``rms_norm_eps`` 1e-6, untied embeddings, no biases, ``rope_theta`` 1e4)."""

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_ROPE_KEYS = {"default": set(), "linear": {"factor"},
              "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}}
_SLIDING, _FULL = "sliding_attention", "full_attention"


def _unsupported(kind: str, field: str, value, why: str) -> ConfigError:
    return ConfigError(f"config field {field}={value!r} of model_type {kind} is not supported: {why}")


def check_fields(config: dict, kind: str) -> None:
    """Refuse every field of ``config`` that is neither harmless nor implemented for ``kind``."""
    for field in sorted(config):
        if field not in IGNORED and field not in IMPLEMENTED[kind]:
            raise ConfigError(
                f"config field {field} of model_type {kind} is not supported (value {config[field]!r}): "
                f"harmonia does not know that it leaves the model's numbers unchanged. Implemented fields: "
                f"{sorted(IMPLEMENTED[kind])}; ignored: ids, dtype, generation settings. If the field is a "
                "tool's bookkeeping that does not change the model, remove it from config.json"
            )
    if config.get("hidden_act", "silu") != "silu":
        raise _unsupported(kind, "hidden_act", config["hidden_act"], "Llama-family blocks use silu (SwiGLU)")
    if config.get("use_mrope"):
        raise _unsupported(kind, "use_mrope", config["use_mrope"],
                           "multimodal RoPE is Qwen2-VL's (model_type qwen2_vl)")
    if float(config.get("attention_dropout") or 0.0) != 0.0:
        raise _unsupported(kind, "attention_dropout", config["attention_dropout"],
                           "harmonia has no attention dropout; set it to 0.0")
    missing = [f for f in _REQUIRED if config.get(f) is None]
    if missing:
        raise ConfigError(f"config of model_type {kind} lacks {missing}; an LLM config.json needs {list(_REQUIRED)}")


def rope_from_config(config: dict, kind: str) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` of a config, as transformers standardises its RoPE parameters."""
    scaling, params = config.get("rope_scaling") or {}, config.get("rope_parameters") or {}
    if scaling and params and scaling != params:
        raise ConfigError(f"config of model_type {kind} has both rope_scaling={scaling} and rope_parameters="
                          f"{params}; keep one of them")
    rope = dict(scaling or params)
    field = "rope_scaling" if scaling else "rope_parameters"
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    rope.pop("type", None)
    if rope_type not in _ROPE_KEYS:
        raise _unsupported(kind, f"{field}.rope_type", rope_type,
                           f"implemented RoPE types are {sorted(_ROPE_KEYS)}")
    theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
    partial = rope.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise _unsupported(kind, "partial_rotary_factor", partial, "harmonia rotates every channel of a head")
    extra = sorted(set(rope) - _ROPE_KEYS[rope_type])
    if extra:
        raise _unsupported(kind, f"{field}.{extra[0]}", rope[extra[0]], f"not a parameter of rope_type {rope_type}")
    if rope_type == "default":
        return theta, None
    if "factor" not in rope:
        raise ConfigError(f"config {field} of model_type {kind}: rope_type {rope_type} needs a factor")
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(rope["factor"]))
    original = rope.get("original_max_position_embeddings",
                        config.get("max_position_embeddings", DEFAULTS[kind]["max_position_embeddings"]))
    try:
        return theta, RopeScaling("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                                  float(rope["high_freq_factor"]), int(original))
    except KeyError as e:
        raise ConfigError(f"config {field} of model_type {kind}: rope_type llama3 needs {e.args[0]}") from None


def windows_from_config(config: dict, kind: str, n_layers: int) -> tuple[int | None, tuple[int, ...] | None]:
    """``(sliding_window, window_layers)`` as transformers applies them (see the module docstring)."""
    defaults = DEFAULTS[kind]
    if kind == "llama":
        return None, None
    if kind == "mistral":
        return config.get("sliding_window", defaults["sliding_window"]), None
    window = config.get("sliding_window", defaults["sliding_window"])
    if not config.get("use_sliding_window", defaults["use_sliding_window"]):
        window = None
    types = config.get("layer_types")
    if types is None:
        start = config.get("max_window_layers", defaults["max_window_layers"])
        types = [_SLIDING if window is not None and i >= start else _FULL for i in range(n_layers)]
    if len(types) != n_layers or set(types) - {_SLIDING, _FULL}:
        raise _unsupported(kind, "layer_types", types, f"expected {n_layers} entries of {_FULL!r} / {_SLIDING!r}")
    layers = tuple(i for i, t in enumerate(types) if t == _SLIDING)
    if layers and window is None:
        raise _unsupported(kind, "layer_types", types, "sliding_attention layers need use_sliding_window=true "
                           "and a sliding_window")
    return (window, layers) if layers else (None, None)


def llm_spec_from_hf(config: dict, name: str | None = None) -> LLMSpec:
    """An `LLMSpec` from a Llama / Mistral / Qwen2 / Qwen3 ``config.json``.

    Raises:
        ConfigError: for another ``model_type``, a field that changes the model's numbers and that
            harmonia does not implement (named with its value), or a missing size.
    """
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise ConfigError(f"config model_type={kind!r} is not a supported LLM; supported: {MODEL_TYPES}")
    check_fields(config, kind)
    defaults = DEFAULTS[kind]
    hidden, heads, n_layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    attention_bias = bool(config.get("attention_bias", False))
    qkv_bias = kind == "qwen2" or attention_bias
    window, window_layers = windows_from_config(config, kind, n_layers)
    body = TransformerSpec(
        n_layers=n_layers, hidden=hidden, n_heads=heads, ffn_hidden=config["intermediate_size"],
        n_kv_heads=config.get("num_key_value_heads", defaults["num_key_value_heads"]) or heads,
        mlp="swiglu", norm="rmsnorm", qkv_bias=qkv_bias, out_bias=kind != "qwen2" and attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        head_dim=config.get("head_dim", defaults.get("head_dim")) or hidden // heads,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)), qk_norm=kind == "qwen3", qk_norm_per_head=kind == "qwen3",
        sliding_window=window, window_layers=window_layers,
    )
    theta, scaling = rope_from_config(config, kind)
    return LLMSpec(name or config.get("_name_or_path") or kind, body, config["vocab_size"],
                   tie_embeddings=bool(config.get("tie_word_embeddings", False)), rope_theta=theta,
                   rope_scaling=scaling)


def _model_type(spec: LLMSpec) -> str:
    """The HF model type that holds ``spec`` exactly, or a ConfigError saying why none does."""
    b = spec.body
    if b.mlp != "swiglu" or b.norm != "rmsnorm" or b.layer_scale or (b.qk_norm and not b.qk_norm_per_head):
        raise ConfigError(f"llm {spec.name!r} is not a Llama-family architecture (swiglu, rmsnorm, no layer "
                          "scale, qk-norm only per head)")
    all_layers = b.sliding_window is not None and b.window_layers is None
    if b.qk_norm_per_head:
        kind = "qwen3"
        ok = b.qkv_bias == b.out_bias and not b.mlp_bias
    elif b.qkv_bias and not b.out_bias:
        kind, ok = "qwen2", not b.mlp_bias
    elif b.sliding_window is not None:
        kind, ok = "mistral", all_layers and not (b.qkv_bias or b.out_bias or b.mlp_bias)
    else:
        kind, ok = "llama", b.qkv_bias == b.out_bias
    if not ok:
        raise ConfigError(f"llm {spec.name!r}: no HF model type holds qkv_bias={b.qkv_bias}, out_bias={b.out_bias}, "
                          f"mlp_bias={b.mlp_bias}, qk_norm_per_head={b.qk_norm_per_head}, sliding_window="
                          f"{b.sliding_window} on layers {b.window_layers or 'all'} together")
    return kind


def llm_config_to_hf(spec: LLMSpec) -> dict:
    """A ``config.json`` that transformers loads as the same model (`llm_spec_from_hf` reads it back).

    The type follows the spec: Qwen3 for per-head qk-norm, Qwen2 for q/k/v biases without an output
    bias, Mistral for a sliding window on every layer, else Llama. RoPE is written as ``rope_theta``
    and ``rope_scaling``, which transformers 4 and 5 both read.
    """
    b = spec.body
    kind = _model_type(spec)
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[kind]
    config = {
        "model_type": kind, "architectures": [arch],
        "hidden_size": b.hidden, "intermediate_size": b.ffn_hidden, "num_hidden_layers": b.n_layers,
        "num_attention_heads": b.n_heads, "num_key_value_heads": b.kv_heads, "head_dim": b.dim_head,
        "rms_norm_eps": b.norm_eps, "vocab_size": spec.vocab_size, "tie_word_embeddings": spec.tie_embeddings,
        "rope_theta": spec.rope_theta, "hidden_act": "silu", "torch_dtype": "float32",
    }
    if kind in ("llama", "qwen3"):
        config["attention_bias"] = b.qkv_bias
    if kind == "llama":
        config["mlp_bias"] = b.mlp_bias
    if kind == "mistral":
        config["sliding_window"] = b.sliding_window
    if kind in ("qwen2", "qwen3"):
        config["use_sliding_window"] = b.sliding_window is not None
        config["sliding_window"] = b.sliding_window
        config["layer_types"] = [_SLIDING if b.window_of(i) is not None else _FULL for i in range(b.n_layers)]
        sliding = [i for i in range(b.n_layers) if b.window_of(i) is not None]
        if sliding and sliding == list(range(sliding[0], b.n_layers)):
            config["max_window_layers"] = sliding[0]  # the same layers for readers without layer_types
    s = spec.rope_scaling
    if s is not None:
        config["rope_scaling"] = {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            config["rope_scaling"].update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                                          original_max_position_embeddings=s.original_max_positions)
    return config
