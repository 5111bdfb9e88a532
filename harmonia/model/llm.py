"""Decoder LLM (Llama / Qwen2 family): token embedding, RoPE blocks with GQA, final norm, LM head.

A `DecoderLM` can hold any contiguous range of blocks ``[a, b)``: the first stage (``a == 0``) owns
the embedding and splices modality-item embeddings into the sequence at their placeholder positions;
the last stage (``b == n_layers``) owns the final norm and the head. Blocks are keyed by their global
index, so a stage's parameter names are those of the whole model.

With tied embeddings the head is the embedding matrix. A last stage without the embedding holds its
own copy under the same name (``embed.weight``, used only as the head), so it loads from the whole
model's state dict; the runtime sums the two copies' gradients (Megatron-LM's embedding group,
`harmonia.runtime.grads.sum_tied_grads`), which keeps them equal.

Sliding-window blocks (``TransformerSpec.sliding_window``) attend with the stage's attention
restricted to their window (`harmonia.model.layers.restrict_to_window`): a `PackedAttention` takes
the window as an argument of its kernel; a dense reference mask is built once per distinct window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harmonia.errors import ConfigError
from harmonia.model.dtensors import is_dtensor
from harmonia.model.attention import PackedAttention
from harmonia.model.layers import (
    build_blocks,
    build_norm,
    init_weights,
    layer_range,
    restrict_to_window,
    rope_cos_sin,
)
from harmonia.model.mrope import mrope_cos_sin
from harmonia.model.spec import LLMSpec

IGNORE_INDEX = -100


class DecoderLM(nn.Module):
    """Blocks ``[a, b)`` of a decoder LLM (all of it by default).

    Args:
        spec: the LLM's architecture.
        layers: ``(a, b)`` global block range of this stage; None = all blocks.
    """

    def __init__(self, spec: LLMSpec, layers: tuple[int, int] | None = None) -> None:
        super().__init__()
        body = spec.body
        self.spec = spec
        self.indices = layer_range(body.n_layers, layers, f"llm {spec.name!r}")
        self.is_first = self.indices.start == 0
        self.is_last = self.indices.stop == body.n_layers
        if self.is_first and self.indices.stop < spec.deepstack:
            raise ConfigError(f"llm {spec.name!r}: its first pipeline stage holds blocks {list(self.indices)} but "
                              f"DeepStack adds item features after each of the first {spec.deepstack}; give it more "
                              "blocks (fewer pipeline stages)")
        tied_head = self.is_last and spec.tie_embeddings
        self.embed = nn.Embedding(spec.vocab_size, body.hidden) if self.is_first or tied_head else None
        self.layers = build_blocks(body, self.indices)
        self.norm = build_norm(body.norm, body.hidden, body.norm_eps) if self.is_last else None
        self.head = nn.Linear(body.hidden, spec.vocab_size, bias=False) if self.is_last and not tied_head else None
        init_weights(self)

    def tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of a tied embedding matrix that another stage also holds, else None.

        The first stage's input embedding and the last stage's head when tied embeddings are split
        over stages; their gradients must be summed (`harmonia.runtime.grads.sum_tied_grads`). None
        on a stage holding both uses (the whole model) or neither.
        """
        if self.spec.tie_embeddings and self.is_first != self.is_last and self.embed is not None:
            return self.embed.weight
        return None

    def embed_inputs(
        self,
        input_ids: torch.Tensor,
        item_embeds: torch.Tensor | None = None,
        item_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings with modality items spliced in at their placeholder positions.

        Args:
            input_ids: ``(B, T)`` token ids; ids at item positions are placeholders and are ignored.
            item_embeds: ``(n, h)`` projected item tokens, in the order of ``item_index``.
            item_index: ``(n,)`` positions in the flattened ``B * T`` sequence that receive them.

        Returns:
            ``(B, T, h)``.
        """
        h = self.embed(input_ids)  # (B, T, h)
        if item_embeds is None or item_index is None or item_index.numel() == 0:
            return h
        B, T, D = h.shape
        flat = h.reshape(B * T, D).index_put((item_index,), item_embeds.to(h.dtype))
        return flat.view(B, T, D)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        item_embeds: torch.Tensor | None = None,
        item_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this stage.

        Args:
            x: ``(B, T)`` token ids on the first stage, ``(B, T, h)`` hidden states otherwise.
            positions: ``(T,)`` or ``(B, T)`` position of each token within its sample (RoPE), or
                ``(3, B, T)`` its temporal, height and width positions under multimodal RoPE.
            mask: the microbatch's `harmonia.model.attention.PackedAttention` (any kernel; under
                context parallelism ``x`` is this rank's shard, ``T`` its tokens, ``positions``
                theirs), or a dense boolean ``(T, T)`` / ``(B, 1, T, T)`` reference mask from
                `multimodal_mask` (tests); without a window either way: sliding-window blocks
                restrict it themselves.
            item_embeds: first stage only, see `embed_inputs`; with DeepStack ``(n, h (1 + k))``,
                the item tokens then the features added after each of the first ``k`` blocks.
            item_index: first stage only, see `embed_inputs`.

        Returns:
            ``(B, T, vocab)`` logits on the last stage, ``(B, T, h)`` hidden states otherwise.
        """
        stack = None  # (n, k, h) DeepStack features, added after the first k blocks
        if self.is_first:
            if self.spec.deepstack and item_embeds is not None:
                h = self.spec.body.hidden
                item_embeds, stack = item_embeds[:, :h], item_embeds[:, h:].unflatten(1, (self.spec.deepstack, h))
            x = self.embed_inputs(x, item_embeds, item_index)
        body = self.spec.body
        if self.spec.multimodal_rope:  # positions (3, B, T): temporal, height, width
            rope = mrope_cos_sin(positions, body.dim_head, self.spec.rope_theta, self.spec.mrope_section,
                                 self.spec.mrope_interleaved, self.spec.rope_scaling)
        else:
            rope = rope_cos_sin(positions, body.dim_head, self.spec.rope_theta, self.spec.rope_scaling)
        masks = {None: mask.for_window(None) if isinstance(mask, PackedAttention) else mask}  # window -> attention
        for i, block in self.layers.items():
            window = body.window_of(int(i))
            if window not in masks:
                masks[window] = restrict_to_window(mask, positions, window)
            x = block(x, masks[window], rope)
            if stack is not None and int(i) < self.spec.deepstack and item_index.numel():
                x = _add_at(x, item_index, stack[:, int(i)])
        if not self.is_last:
            return x
        x = self.norm(x)
        return self.head(x) if self.head is not None else self._tied_head(x)

    def _tied_head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, V)`` from the embedding matrix, vocab-sharded under tensor parallelism."""
        w = self.embed.weight  # (V, h)
        if not is_dtensor(w):
            return x @ w.t()
        from torch.distributed.tensor import DTensor, Replicate  # already imported: w is one

        x = DTensor.from_local(x, w.device_mesh, [Replicate()] * w.device_mesh.ndim, run_check=False)
        return (x @ w.t()).redistribute(placements=[Replicate()] * w.device_mesh.ndim).to_local()


def _add_at(x: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, T, h)`` with ``rows`` ``(n, h)`` added at flat positions ``index`` of ``B * T``; not a
    view (a stage's output is detached in place after its backward)."""
    B, T, D = x.shape
    if B == 1:
        return x.index_add(1, index, rows[None].to(x.dtype))
    return x.reshape(B * T, D).index_add(0, index, rows.to(x.dtype)).reshape(B, T, D).clone()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
    """Summed next-token cross entropy divided by ``normalizer``.

    Labels are already aligned with the logits (the collator shifts them); positions with
    ``IGNORE_INDEX`` (prompt, items, padding) do not count. Pass the global count of target tokens as
    ``normalizer`` so that every DP rank and microbatch scales its gradients alike; None = mean.
    Logits split over the vocabulary (a tensor-parallel head's DTensor) need torch's
    ``loss_parallel`` context around this call and its backward (`harmonia.runtime.mllm_executor`).

    Args:
        logits: ``(B, T, V)``, or a DTensor sharded over ``V``.
        labels: ``(B, T)``.
        normalizer: divisor of the summed loss.
    """
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    if hasattr(loss, "to_local"):  # vocabulary-parallel: a DTensor replicated over the TP group
        loss = loss.to_local()
    n = normalizer if normalizer is not None else max(int((labels != IGNORE_INDEX).sum()), 1)
    return loss / n


def build_llm(spec: LLMSpec, layers: tuple[int, int] | None = None) -> DecoderLM:
    """A decoder LLM, or the stage holding blocks ``[a, b)`` of it."""
    return DecoderLM(spec, layers)
