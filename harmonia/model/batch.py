"""Packed microbatches: several samples in one LLM sequence plus each encoder's inputs.

A sample arrives as a `TokenizedSample`: its LLM token ids with placeholder ids where items go, its
labels, its ``(kind, length)`` segments, and one `ItemInputs` per item. `pack_samples` concatenates
samples into one sequence (``B = 1``), builds the `TokenLayout` its attention is made from (`PackedBatch.attention`), and
groups items by encoder so each encoder runs once over all its sequences (tiles, frames, chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from harmonia.errors import SampleError
from harmonia.model.attention import PackedAttention
from harmonia.model.attention_backend import choose_backend, mask_kind
from harmonia.model.attention_mask import TokenLayout, multimodal_mask

HOST = {"host": True}
"""Metadata of a dataclass field that stays on the CPU when its object moves to a device (`PackedBatch.to`,
`harmonia.train.rank.to_device`): what a step plans from on the host (item grids, token layouts, the CP
assignment), so that its actions read no value back from the device."""


def _host_copy(given: object, value: torch.Tensor | TokenLayout) -> object:
    """A host field's value: ``given``, else ``value`` where it is on the CPU (None where it is not)."""
    if given is not None:
        return given
    tensor = value.sample if isinstance(value, TokenLayout) else value
    return value if tensor.device.type == "cpu" else None


@dataclass
class ItemInputs:
    """One modality item's encoder input.

    Attributes:
        module: encoder module name (``vision``, ``audio``).
        inputs: ``(n_seq, C, H, W)`` tiles / frame tiles, or ``(n_seq, n_mels, F)`` audio chunks.
        groups: ``(n_seq,)`` output slot of each sequence; sequences sharing a slot are averaged
            (temporal merge of video frames). Slots are ``0 .. n_groups - 1`` in LLM order.
        order: ``(n_llm_tokens, 2)`` where each LLM token comes from instead of slot order: the
            ``(sequence, feature)`` of the item's projected features, or ``(-1, 0)`` for the
            projector's ``image_newline`` (LLaVA-NeXT anyres, `harmonia.model.anyres.anyres_order`);
            None = slots.
        grid: ``(1, 3)`` the item's patch grid ``(t, h, w)`` for a native-resolution encoder
            (`harmonia.model.qwen_vit`), whose ``inputs`` are then ``(t * h * w, C * tp * p * p)``
            patch rows in the processor's order; the item has no slots (``groups`` and ``order`` None).
        second_per_grid: a native-resolution video's seconds of video per temporal grid step (the
            processor's ``second_per_grid_ts`` entry, which Qwen2.5-VL's rotary positions read);
            None for images.
    """

    module: str
    inputs: torch.Tensor
    groups: torch.Tensor | None = None
    order: torch.Tensor | None = None
    grid: torch.Tensor | None = None
    second_per_grid: float | None = None

    def __post_init__(self) -> None:
        if self.grid is None:
            return
        t, h, w = (int(v) for v in self.grid.reshape(-1))
        if tuple(self.grid.shape) != (1, 3) or self.groups is not None or self.order is not None \
                or self.inputs.dim() != 2 or self.inputs.shape[0] != t * h * w:
            raise SampleError(f"a native-resolution item needs grid (1, 3), no groups or order, and (t*h*w, D) patch "
                              f"rows; got grid {tuple(self.grid.shape)} and inputs {tuple(self.inputs.shape)}")

    @property
    def n_groups(self) -> int:
        if self.grid is not None:
            return 0
        return self.inputs.shape[0] if self.groups is None else int(self.groups.max()) + 1


def frame_groups(frames: int, tiles_per_frame: int, temporal_merge: int) -> torch.Tensor:
    """Slots of a video's sequences (frame-major) when ``temporal_merge`` frames become one."""
    frame = torch.arange(frames).repeat_interleave(tiles_per_frame)
    tile = torch.arange(tiles_per_frame).repeat(frames)
    return (frame // temporal_merge) * tiles_per_frame + tile


@dataclass
class TokenizedSample:
    """One sample ready to pack.

    Attributes:
        input_ids: ``(T,)`` token ids; item positions hold any placeholder id.
        labels: ``(T,)`` next-token targets aligned with ``input_ids`` (``-100`` = no loss).
        segments: ``(kind, length)`` runs, kind ``text`` or ``item``, summing to ``T``.
        items: one `ItemInputs` per ``item`` segment, in order.
        sample_id: dataset identifier, carried for reporting.
        causal_items: the items' tokens attend causally like text (a model whose
            ``MLLMSpec.item_attention`` is ``causal``, LLaVA), not to their whole item.
        rope_positions: ``(3, T)`` multimodal rotary positions (temporal, height, width) where the model
            uses multimodal RoPE (`harmonia.model.mrope.rope_index`); None: the position within the
            sample.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    segments: list[tuple[str, int]]
    items: list[ItemInputs] = field(default_factory=list)
    sample_id: int | str | None = None
    causal_items: bool = False
    rope_positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = sum(length for _, length in self.segments)
        n_items = sum(kind == "item" for kind, _ in self.segments)
        if n != self.input_ids.numel() or n != self.labels.numel() or n_items != len(self.items):
            raise SampleError(
                f"sample {self.sample_id}: segments cover {n} tokens and {n_items} items but input_ids has "
                f"{self.input_ids.numel()}, labels {self.labels.numel()} and there are {len(self.items)} items"
            )
        if self.rope_positions is not None and tuple(self.rope_positions.shape) != (3, n):
            raise SampleError(f"sample {self.sample_id}: multimodal rotary positions of shape "
                              f"{tuple(self.rope_positions.shape)}, expected (3, {n})")
        lengths = [length for kind, length in self.segments if kind == "item"]
        for k, (item, length) in enumerate(zip(self.items, lengths)):
            if item.order is not None and item.order.shape[0] != length:
                raise SampleError(f"sample {self.sample_id}: item {k} orders {item.order.shape[0]} LLM tokens but "
                                  f"its segment has {length}")

    def __len__(self) -> int:
        return self.input_ids.numel()


@dataclass
class MediaInputs:
    """Everything one encoder processes for a microbatch.

    Attributes:
        inputs: ``(N, ...)`` all sequences of the encoder's items, item by item.
        groups: ``(N,)`` global output slot of each sequence (see `ItemInputs.groups`).
        n_groups: number of output slots; slot ``g`` fills LLM tokens ``g*P .. (g+1)*P - 1`` of ``index``.
        index: ``(n_tokens,)`` positions in the packed sequence that receive the encoder's tokens.
        order: ``(n_tokens, 2)`` the items' `ItemInputs.order`, sequence numbers counted over all
            of ``inputs`` (-1 stays the newline); None when no item has one.
        grid: ``(n_items, 3)`` a native-resolution encoder's item grids (`ItemInputs.grid`), kept on
            the CPU (the encoder plans its attention from them); ``inputs`` are then all items' patch
            rows and ``groups`` is empty.
        host_index: ``index`` on the CPU, kept there when the rest moves to a device (a CP rank picks
            its item rows from it); set from ``index`` when that is on the CPU.
    """

    inputs: torch.Tensor
    groups: torch.Tensor
    n_groups: int
    index: torch.Tensor
    order: torch.Tensor | None = None
    grid: torch.Tensor | None = field(default=None, metadata=HOST)
    host_index: torch.Tensor | None = field(default=None, metadata=HOST, repr=False)

    def __post_init__(self) -> None:
        self.host_index = _host_copy(self.host_index, self.index)

    @property
    def plan_index(self) -> torch.Tensor:
        """The item positions plans read: on the CPU where the inputs have them there (`host_index`)."""
        return self.index if self.host_index is None else self.host_index

    def to(self, device: torch.device | str) -> MediaInputs:
        order = None if self.order is None else self.order.to(device)
        return MediaInputs(self.inputs.to(device), self.groups.to(device), self.n_groups, self.index.to(device), order,
                           self.grid, self.host_index)


def gather_items(items: list[ItemInputs], index: torch.Tensor, with_inputs: bool = True) -> MediaInputs:
    """One encoder's inputs for ``items`` encoded together, their LLM tokens at ``index``; without
    ``with_inputs``, no rows of inputs (``(0, ...)``: what the LLM's side of a batch holds, the
    encoders' outputs reaching its positions through the boundary), nothing copied.

    Raises:
        SampleError: native-resolution items mixed with tiles (one encoder takes one kind).
    """
    native = {item.grid is not None for item in items}
    if len(native) > 1:
        raise SampleError(f"encoder {items[0].module!r} got native-resolution items and tiles together")
    first = items[0].inputs
    inputs = torch.cat([item.inputs for item in items]) if with_inputs else first.new_empty((0, *first.shape[1:]))
    if native.pop():
        return MediaInputs(inputs, torch.zeros(0, dtype=torch.long), 0, index, grid=torch.cat([i.grid for i in items]))
    groups, n = [], 0
    for item in items:  # numpy: a few microseconds an operation where torch takes tens
        g = item.groups.numpy() if item.groups is not None else np.arange(item.inputs.shape[0])
        groups.append(g + n)
        n += item.n_groups
    return MediaInputs(inputs, torch.from_numpy(np.concatenate(groups)).long(), n, index, item_order(items))


def item_order(items: list[ItemInputs]) -> torch.Tensor | None:
    """The `MediaInputs.order` of items encoded together (sequence numbers offset past the items
    before), or None when no item has an order.

    Raises:
        SampleError: when some items have an order and others not (one projector, one rule).
    """
    given = [item.order is not None for item in items]
    if not any(given):
        return None
    if not all(given):
        raise SampleError("items of one encoder mix anyres token orders with slot order; one model has one rule")
    out, offset = [], 0
    for item in items:
        seq, feature = item.order.unbind(1)
        out.append(torch.stack([torch.where(seq >= 0, seq + offset, seq), feature], dim=1))
        offset += item.inputs.shape[0]
    return torch.cat(out)


@dataclass
class PackedBatch:
    """A microbatch: samples packed into one sequence of ``T`` tokens.

    Attributes:
        input_ids: ``(1, T)``.
        labels: ``(1, T)``.
        layout: per-token sample / segment / item flag / position.
        media: encoder module name -> its inputs.
        sample_ids: dataset identifiers of the packed samples, in order.
        rope_positions: ``(3, 1, T)`` the samples' multimodal rotary positions, each sample's from
            its own start (None: the model's rotary positions are ``layout.position``).
        host_layout: ``layout`` on the CPU, kept there when the rest moves to a device: the attention
            plans from it (`attention`); set from ``layout`` when that is on the CPU.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    layout: TokenLayout
    media: dict[str, MediaInputs]
    sample_ids: list = field(default_factory=list)
    rope_positions: torch.Tensor | None = None
    host_layout: TokenLayout | None = field(default=None, metadata=HOST, repr=False)

    def __post_init__(self) -> None:
        self.host_layout = _host_copy(self.host_layout, self.layout)

    @property
    def plan_layout(self) -> TokenLayout:
        """The layout plans read: on the CPU where the batch has it there (`host_layout`)."""
        return self.layout if self.host_layout is None else self.host_layout

    @property
    def n_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def n_targets(self) -> int:
        """Tokens that carry a loss (the normaliser's share of this microbatch)."""
        return int((self.labels != -100).sum())

    def attention(self, backend: str = "auto", head_dim: int | None = None) -> PackedAttention:
        """The microbatch's attention, built once and shared by every LLM layer (no ``(T, T)`` tensor).

        Args:
            backend: a kernel of `harmonia.model.attention_backend.BACKENDS`, chosen for the batch's device
                and mask kind (`choose_backend`).
            head_dim: the LLM's channels per head (`choose_backend`).
        """
        kernel = choose_backend(backend, self.input_ids.device, mask_kind(self.plan_layout), head_dim)
        return PackedAttention(self.plan_layout, backend=kernel, device=self.input_ids.device)

    def mask(self) -> torch.Tensor:
        """Boolean ``(T, T)`` multimodal attention mask: the dense reference tests compare against."""
        return multimodal_mask(self.layout)

    def positions(self) -> torch.Tensor:
        """``(1, T)`` rotary positions, or ``(3, 1, T)`` under multimodal RoPE."""
        return self.layout.position[None] if self.rope_positions is None else self.rope_positions

    def to(self, device: torch.device | str) -> PackedBatch:
        lay = self.layout
        media = {k: m.to(device) for k, m in self.media.items()}
        return PackedBatch(
            self.input_ids.to(device), self.labels.to(device),
            TokenLayout(lay.sample.to(device), lay.segment.to(device), lay.is_item.to(device), lay.position.to(device)),
            media, self.sample_ids, None if self.rope_positions is None else self.rope_positions.to(device),
            self.host_layout,
        )


def pack_samples(samples: list[TokenizedSample], with_inputs: bool = True) -> PackedBatch:
    """Concatenate samples into one sequence; group item inputs by encoder (without ``with_inputs``,
    only the items' positions: `gather_items`).

    Raises:
        SampleError: when ``samples`` is empty.
    """
    if not samples:
        raise SampleError("pack_samples got no samples; a microbatch needs at least one")
    if len({s.causal_items for s in samples}) > 1:
        raise SampleError("pack_samples got samples with causal and with bidirectional items; one model has one rule")
    layout = TokenLayout.from_segments([s.segments for s in samples], samples[0].causal_items)
    per_module: dict[str, tuple[list[ItemInputs], list[torch.Tensor]]] = {}
    offset = 0
    for s in samples:
        items = iter(s.items)
        for kind, length in s.segments:
            if kind == "item":
                item = next(items)
                its, index = per_module.setdefault(item.module, ([], []))
                its.append(item)
                index.append(np.arange(offset, offset + length))
            offset += length
    media = {name: gather_items(its, torch.from_numpy(np.concatenate(index)), with_inputs)
             for name, (its, index) in per_module.items()}
    return PackedBatch(
        torch.cat([s.input_ids for s in samples])[None], torch.cat([s.labels for s in samples])[None],
        layout, media, [s.sample_id for s in samples], _packed_rope_positions(samples),
    )


def _packed_rope_positions(samples: list[TokenizedSample]) -> torch.Tensor | None:
    """``(3, 1, T)`` the samples' multimodal rotary positions in packing order (each restarts at its
    sample's start, as `harmonia.model.mrope.rope_index` computes them per sample); None when no
    sample has them."""
    have = [s.rope_positions is not None for s in samples]
    if not any(have):
        return None
    if not all(have):
        raise SampleError("pack_samples got samples with and without multimodal rotary positions; one model has one "
                          "rule")
    return torch.cat([s.rope_positions for s in samples], dim=1)[:, None]
