"""The MLLM: encoders -> projectors -> LLM, with item tokens spliced into the packed sequence.

`build_module` builds any one module (or one pipeline stage of it) from an `MLLMSpec`; the executor
uses it per stage. `MLLM` holds all modules in one process and is the single-process reference the
distributed runtime must match.
"""

from __future__ import annotations

import torch
from torch import nn

from harmonia.errors import ConfigError, SampleError
from harmonia.model.audio import build_audio_encoder
from harmonia.model.batch import MediaInputs, PackedBatch
from harmonia.model.llm import build_llm, lm_loss
from harmonia.model.projector import build_projector
from harmonia.model.qwen_vit import build_qwen_vision_encoder
from harmonia.model.spec import MLLMSpec
from harmonia.model.vit import build_vision_encoder


def build_module(spec: MLLMSpec, module: str, layers: tuple[int, int] | None = None) -> nn.Module:
    """One module of the MLLM, or the pipeline stage holding its blocks ``[a, b)``.

    Args:
        spec: the MLLM.
        module: ``llm``, an encoder name (``vision``) or a projector name (``vision_proj``).
        layers: global block range of the stage; None = the whole module. Projectors have no blocks.
    """
    if module == "llm":
        return build_llm(spec.llm, layers)
    if module in spec.encoders:
        enc = spec.encoders[module]
        if enc.native is not None:
            return build_qwen_vision_encoder(enc.native, layers)
        return build_audio_encoder(enc, layers) if enc.is_audio else build_vision_encoder(enc, layers)
    if module in spec.projectors:
        if layers is not None:
            raise ConfigError(f"projector {module!r} has no blocks to split; build it whole (layers=None)")
        return build_projector(spec.projectors[module])
    raise ConfigError(f"unknown module {module!r}; modules of {spec.name!r} are {spec.module_names}")


def state_prefix(spec: MLLMSpec, module: str) -> str:
    """Prefix of a module's names in the whole `MLLM`'s state dict (``llm.``, ``encoders.vision.``,
    ``projectors.vision_proj.``)."""
    if module == "llm":
        return "llm."
    if module in spec.encoders:
        return f"encoders.{module}."
    if module in spec.projectors:
        return f"projectors.{module}."
    raise ConfigError(f"unknown module {module!r}; modules of {spec.name!r} are {spec.module_names}")


def group_mean(x: torch.Tensor, groups: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Average sequences sharing an output slot: ``(N, P, D) -> (n_groups, P, D)``."""
    if n_groups == x.shape[0]:
        return x
    out = torch.zeros(n_groups, *x.shape[1:], dtype=x.dtype, device=x.device).index_add(0, groups, x)
    # (n_groups,) sequences per slot; bincount's, without its read of the largest slot on a GPU
    counts = torch.zeros(n_groups, dtype=torch.long, device=x.device).index_add_(0, groups, torch.ones_like(groups))
    counts = counts.clamp(min=1).to(x.dtype)
    return out / counts[:, None, None]


def run_encoder(encoder: nn.Module, x: torch.Tensor, media: MediaInputs) -> torch.Tensor:
    """An encoder (or one stage of it) over ``x``: a native-resolution one also takes the item grids."""
    return encoder(x) if media.grid is None else encoder(x, media.grid)


def project_items(projector: nn.Module, x: torch.Tensor, media: MediaInputs) -> torch.Tensor:
    """The projector over an encoder's outputs ``(N, P', h)`` -> the items' LLM tokens ``(n_tokens, D)``:
    slots averaged (`group_mean`), or gathered in ``media.order`` (anyres images); a native-resolution
    encoder's ``(n_tokens, m^2 h)`` rows are already one per LLM token."""
    if media.grid is not None:
        return projector(x)  # (n_tokens, D)
    if media.order is not None:
        return projector(x, media.order)  # (n_tokens, D)
    return group_mean(projector(x), media.groups, media.n_groups).flatten(0, 1)  # (n_groups * P, D)


def encode_media(encoder: nn.Module, projector: nn.Module, media: MediaInputs) -> torch.Tensor:
    """Encoder then projector over one encoder's inputs: ``(n_tokens, D)`` in ``media.index`` order."""
    y = project_items(projector, run_encoder(encoder, media.inputs, media), media)
    if y.shape[0] != media.index.numel():
        raise SampleError(
            f"encoder output has {y.shape[0]} tokens but the packed sequence reserves "
            f"{media.index.numel()} placeholder positions; item token counts must follow the encoder spec "
            "(harmonia.workload.shapes.llm_tokens_of_item)"
        )
    return y


def check_item_attention(spec: MLLMSpec, batch: PackedBatch) -> None:
    """Raise `SampleError` when the batch's mask rule for items is not the model's (`MLLMSpec.item_attention`)."""
    n_items = sum(m.index.numel() for m in batch.media.values())
    bidirectional = int(batch.plan_layout.is_item.sum())
    causal = spec.item_attention == "causal"
    if (causal and bidirectional) or (not causal and bidirectional != n_items):
        want = "causal_items=True" if causal else "causal_items=False"
        raise SampleError(
            f"MLLM {spec.name!r} attends to items {spec.item_attention}ly but the batch's samples were built "
            f"for the other rule; build its TokenizedSamples with {want}"
        )


class MLLM(nn.Module):
    """All modules of an MLLM in one process.

    Args:
        spec: the MLLM.
        attention: the LLM's attention kernel (`harmonia.model.attention_backend.BACKENDS`; ``dense`` is the
            reference the tests compare against).

    Attributes:
        encoders: encoder name -> encoder.
        projectors: projector name -> projector.
        llm: the decoder LLM.
    """

    def __init__(self, spec: MLLMSpec, attention: str = "auto") -> None:
        super().__init__()
        self.spec = spec
        self.attention = attention
        self.encoders = nn.ModuleDict({name: build_module(spec, name) for name in spec.encoders})
        self.projectors = nn.ModuleDict({name: build_module(spec, name) for name in spec.projectors})
        self.llm = build_llm(spec.llm)

    def module(self, name: str) -> nn.Module:
        """A module by its MLLM name (``vision``, ``vision_proj``, ``llm``)."""
        if name == "llm":
            return self.llm
        if name in self.encoders:
            return self.encoders[name]
        if name in self.projectors:
            return self.projectors[name]
        raise ConfigError(f"unknown module {name!r}; modules are {self.spec.module_names}")

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Logits ``(1, T, vocab)`` of a packed microbatch."""
        check_item_attention(self.spec, batch)
        embeds, index = [], []
        for name, media in batch.media.items():
            if name not in self.encoders:
                raise SampleError(f"batch has inputs for {name!r} but the model's encoders are {list(self.encoders)}")
            embeds.append(encode_media(self.encoders[name], self.projectors[f"{name}_proj"], media))
            index.append(media.index)
        item_embeds = torch.cat(embeds) if embeds else None
        item_index = torch.cat(index) if index else None
        attention = batch.attention(self.attention, self.spec.llm.body.dim_head)
        return self.llm(batch.input_ids, batch.positions(), attention, item_embeds, item_index)

    def loss(self, batch: PackedBatch, normalizer: float | None = None) -> torch.Tensor:
        """Summed token loss of the batch divided by ``normalizer`` (global target count)."""
        return lm_loss(self(batch), batch.labels, normalizer)


def build_mllm_model(spec: MLLMSpec, apply_training_modes: bool = True) -> MLLM:
    """The whole MLLM; with ``apply_training_modes``, frozen modules are frozen and LoRA attached."""
    model = MLLM(spec)
    if apply_training_modes:
        from harmonia.model.lora import apply_training

        for name in spec.module_names:
            apply_training(model.module(name), spec.training_of(name))
    return model


def trainable_counts(spec) -> dict[str, tuple[int, int]]:
    """Per module of an `MLLMSpec`, ``(trainable, all)`` parameters under its training mode (LoRA's
    adapters counted, a frozen module's 0), from the module built on ``meta`` (no memory).

    Raises:
        ConfigError: a LoRA target that names no linear of its module.
    """
    from harmonia.model.lora import apply_training, check_lora_targets
    from harmonia.model.training_mode import Trainability

    out = {}
    for name in spec.module_names:
        with torch.device("meta"):
            module = build_module(spec, name)
        if spec.training_of(name).mode is Trainability.LORA:
            check_lora_targets(module, spec.training_of(name), name)
        apply_training(module, spec.training_of(name))
        params = list(module.parameters())
        out[name] = (sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params))
    return out
