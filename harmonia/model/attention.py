"""One attention entry for packed sequences: kernels by device and mask kind, no ``(T, T)`` tensor.

A microbatch's attention is described once (`PackedAttention`: the queries' and keys' token layouts,
and under context parallelism how the gathered keys map to sequence order) and shared by every
layer; each layer calls `PackedAttention.attend` with its queries, keys, values and sliding window.
The rule is `harmonia.model.attention_mask`'s; the kernels that run it:

- ``segments`` (any device; the CPU's): where every sample is causal text (no window, no CP shard),
  the samples as padded batches (`PaddedGroups`: samples of similar length padded to the longest of
  their group, each group one causal FlashAttention call with no mask at all, as a padded batch of
  HF runs it); packed encoder sequences (`PackedAttention.sequences`) likewise, those of equal
  length as one unpadded batch, unmasked and not causal; otherwise the queries in blocks of at most
  `QUERY_BLOCK` tokens that never straddle a packed sample or an item's start (short samples share a
  block), each block against the one key range its queries may reach (from its sample's start, or
  the window's, to its last query or the end of the last item it attends). The rule keeps an
  interval of keys per query (`PackedAttention.bounds`), so a block's ``(bq, lk)`` mask is two
  comparisons: on CPU through FlashAttention's CPU kernel forward and backward
  (`_SegmentAttention`), elsewhere through SDPA. Work is the kept pairs plus at most a block's width
  per query; memory is linear in the tokens plus one block's mask.
- ``varlen`` (CUDA): FlashAttention over ``cu_seqlens`` (`torch.nn.attention.varlen.varlen_attn`)
  where every token attends causally within its sample (text, and items of models whose items attend
  causally, as HF's LLaVA does), sliding windows and GQA included: each contiguous run of queries of
  one sample against its causal key range, aligned bottom-right; and for packed encoder sequences
  (`PackedAttention.sequences`: images or frames of different sizes in one call, each attending
  its whole self), each sequence against itself with no causal limit.
- ``flex`` (CUDA): compiled ``flex_attention`` with a block mask built once per microbatch and
  window, for masks varlen cannot express (bidirectional items inside causal text).
- ``dense``: the ``(Tq, Tk)`` boolean mask through SDPA; the reference tests compare against, never
  chosen by ``auto``.

`harmonia.model.attention_backend.choose_backend` picks the kernel by device, mask kind and head
width, and refuses one that cannot run them, naming both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from harmonia.errors import ConfigError
from harmonia.model.attention_backend import CAUSAL, SEQUENCES, choose_backend, mask_kind
from harmonia.model.attention_mask import TokenLayout, multimodal_mask

QUERY_BLOCK = 256
"""Queries per block of the ``segments`` kernel: the waste past the kept pairs is at most this many
keys per query; the transient mask is this many rows."""
PADDING_WASTE = 1.5
"""Causal samples padded together compute at most this many times their own causal pairs."""


@dataclass(frozen=True)
class QueryBlock:
    """Local queries ``[q0, q1)`` against keys ``[k0, k1)`` in sequence order."""

    q0: int
    q1: int
    k0: int
    k1: int


@dataclass(eq=False)
class PackedAttention:
    """One microbatch's attention, shared by every layer of the LLM (or of an encoder).

    The plan (query blocks, padded groups, varlen runs) is made on the host from the layout on the
    CPU, where the batch was built: on a GPU, what the kernels take is copied to the device
    (``non_blocking``) and nothing is read back, so building and running it syncs nothing. A layout,
    query index or key order given on a device is read back once, here.

    Attributes:
        keys: layout of every key token, in sequence order ``(T,)`` (best on the CPU).
        query_index: ``(t,)`` ascending sequence index of each local query; None = every token.
        backend: a kernel of `BACKENDS` other than ``auto`` (`choose_backend`).
        gather: under context parallelism, ``(t, *F) -> (T, *F)`` every CP rank's rows in
            gathered order (differentiable); None without.
        key_order: ``(T,)`` sequence index of each gathered row; None without CP.
        device: where the queries, keys and values are; None = where ``keys`` are.
    """

    keys: TokenLayout
    query_index: torch.Tensor | None = None
    backend: str = "segments"
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    key_order: torch.Tensor | None = None
    device: torch.device | str | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.device = torch.device(self.keys.sample.device if self.device is None else self.device)
        host = TokenLayout(*(on_host(t) for t in (self.keys.sample, self.keys.segment, self.keys.is_item,
                                                   self.keys.position)))
        self._host = host  # the keys' layout on the CPU: every plan reads this
        self._host_query = None if self.query_index is None else on_host(self.query_index)
        T = len(host)
        starts = _run_starts(host.sample)  # (T,) first token of each token's sample
        if not torch.equal(host.position, torch.arange(T) - starts):
            raise ConfigError("packed attention needs each sample's tokens in order with positions 0, 1, ... "
                              "(as TokenLayout.from_segments packs them)")
        self._starts = starts
        self._item_end = _item_ends(host)  # (T,) last key + 1 each token may attend
        # (T,) the group a token's query blocks start from: its sample for text, its item for an item's
        # tokens (a block never holds text queries before an item and that item's own tokens)
        self._groups = torch.where(host.is_item, _run_starts(host.segment), starts)
        if self.key_order is not None:  # (T,) gathered row of each sequence index, on the device
            self._to_sequence = _to_device(torch.argsort(on_host(self.key_order)), self.device)
        self.kind = mask_kind(host)

    @classmethod
    def sequences(cls, lengths: list[int], requested: str = "auto", device: torch.device | str = "cpu",
                  head_dim: int | None = None) -> PackedAttention:
        """Packed encoder sequences (images or frames of different sizes in one call): the tokens of
        ``lengths[i]`` follow those of ``lengths[i - 1]``, and each attends its whole sequence.

        Args:
            lengths: tokens of each sequence, in packing order (all positive).
            requested: a kernel of `BACKENDS` (`choose_backend` with the `SEQUENCES` kind).
            device: where the tokens are.
            head_dim: channels per head (`choose_backend`).
        """
        if not lengths or min(lengths) <= 0:
            raise ConfigError(f"packed sequences need positive lengths, got {list(lengths)}")
        layout = TokenLayout.from_segments([[("item", n)] for n in lengths])  # on the CPU, where it plans
        return cls(layout, backend=choose_backend(requested, device, SEQUENCES, head_dim), device=device)

    def for_window(self, window: int | None) -> LayerAttention:
        """What a layer with sliding window ``window`` (None = none) attends with."""
        return LayerAttention(self, window)

    @property
    def queries(self) -> TokenLayout:
        """Layout of the local queries, on the device."""
        keys = self._device_keys()
        if self._host_query is None:
            return keys
        if "query index" not in self._cache:
            self._cache["query index"] = _to_device(self._host_query, self.device)
        return keys.select(self._cache["query index"])

    def _device_keys(self) -> TokenLayout:
        """``keys`` on the device (the ``dense`` and ``flex`` kernels read the layout there)."""
        if "device keys" not in self._cache:
            on = self.keys if self.keys.sample.device == self.device else self._host
            self._cache["device keys"] = TokenLayout(*(_to_device(t, self.device) for t in (
                on.sample, on.segment, on.is_item, on.position)))
        return self._cache["device keys"]

    # -- the plan, once per microbatch and window -----------------------------------------------------
    def blocks(self, window: int | None = None) -> list[QueryBlock]:
        """The ``segments`` kernel's query blocks (cached per window)."""
        key = ("blocks", window)
        if key not in self._cache:
            first, ends = self.bounds(window)
            self._cache[key] = plan_query_blocks(self._local(self._groups), first.tolist(), ends.tolist(),
                                                 QUERY_BLOCK)
        return self._cache[key]

    def computed_pairs(self, window: int | None = None) -> int:
        """(query, key) pairs the ``segments`` kernel computes, masked ones included."""
        padded = self.padded_groups(window)
        if padded is not None:
            if self.kind == SEQUENCES:
                return sum(n * L * L for n, L in padded.shapes)
            return sum(n * L * (L + 1) // 2 for n, L in padded.shapes)
        return sum((b.q1 - b.q0) * (b.k1 - b.k0) for b in self.blocks(window))

    def padded_groups(self, window: int | None = None) -> PaddedGroups | None:
        """The ``segments`` kernel's batches of samples, where no window and no CP shard apply: causal
        samples padded to their group's longest (`PADDING_WASTE`); packed encoder sequences of equal
        length as one batch each, unpadded (each query attends its whole sequence, so it would
        attend padding). None otherwise (blocks)."""
        if self.kind not in (CAUSAL, SEQUENCES) or window is not None or self.query_index is not None:
            return None
        if "padded" not in self._cache:
            T = len(self._host)
            heads = torch.nonzero(self._starts == torch.arange(T)).flatten().tolist()
            lengths = [b - a for a, b in zip(heads, heads[1:] + [T])]  # each sample's tokens, from its first
            waste = PADDING_WASTE if self.kind == CAUSAL else 1.0  # 1.0: equally long samples only
            self._cache["padded"] = PaddedGroups.plan(heads, lengths, waste, self.device)
        return self._cache["padded"]

    def _first_key(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self._starts
        return torch.maximum(self._starts, torch.arange(len(self._host)) - window + 1)

    def _local(self, per_token: torch.Tensor) -> list[int]:
        """A host ``(T,)`` value of each local query, as a list."""
        chosen = per_token if self._host_query is None else per_token[self._host_query]
        return chosen.tolist()

    # -- running it ---------------------------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """Attention of the local queries.

        Args:
            q: ``(B, nh, t, hd)`` local queries (rotated).
            k: ``(B, nkv, t, hd)`` local keys: under CP this rank's, gathered here.
            v: ``(B, nkv, t, hd)`` local values.
            window: the layer's sliding window (transformers' ``sliding_window``); None = none.

        Returns:
            ``(B, nh, t, hd)``.
        """
        if self.gather is not None:
            k, v = self._gathered(k, v)  # (B, nkv, T, hd) in sequence order
        gqa = q.shape[1] != k.shape[1]
        if self.backend == "segments":
            return self._segments(q, k, v, window, gqa)
        if self.backend == "varlen":
            return self._varlen(q, k, v, window, gqa)
        if self.backend == "flex":
            return self._flex(q, k, v, window, gqa)
        mask = multimodal_mask(self.queries, self._device_keys(), window)  # (t, T): the reference only
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=gqa)

    def _gathered(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every CP rank's keys and values, put in sequence order (one collective, one row gather)."""
        kv = torch.cat((k, v), dim=1).permute(2, 0, 1, 3).contiguous()  # (t, B, 2 nkv, hd)
        kv = self.gather(kv)[self._to_sequence]  # (T, B, 2 nkv, hd) in sequence order
        k, v = kv.permute(1, 2, 0, 3).chunk(2, dim=1)  # (B, nkv, T, hd) each
        return k, v

    def _segments(self, q, k, v, window, gqa) -> torch.Tensor:
        if q.device.type == "cpu":
            return _SegmentAttention.apply(q, k, v, self, window)
        out = []  # another device: SDPA per block, its autograd keeping each block's mask
        for b in self.blocks(window):
            out.append(F.scaled_dot_product_attention(q[:, :, b.q0:b.q1], k[:, :, b.k0:b.k1], v[:, :, b.k0:b.k1],
                                                      attn_mask=self.block_bias(b, window, q.dtype), enable_gqa=gqa))
        return torch.cat(out, dim=2)  # (B, nh, t, hd)

    def bounds(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(t,)`` first key and ``(t,)`` one past the last key of each local query (sequence order),
        on the CPU.

        The multimodal rule keeps exactly this interval of keys for every query: a text token
        attends its sample's earlier tokens (items' included) up to itself, an item's token also its
        item's later tokens, and a window only moves the interval's start (module docstring of
        `harmonia.model.attention_mask`; the tests compare with the dense rule)."""
        key = ("bounds", window)
        if key not in self._cache:
            first, ends = self._first_key(window), self._item_end
            if self._host_query is not None:
                first, ends = first[self._host_query], ends[self._host_query]
            self._cache[key] = (first, ends)
        return self._cache[key]

    def block_bias(self, b: QueryBlock, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """``(1, 1, bq, lk)`` additive mask of one block, on the device: 0 where kept, -inf elsewhere."""
        key = ("device bounds", window)
        if key not in self._cache:
            self._cache[key] = tuple(_to_device(t, self.device) for t in self.bounds(window))
        first, ends = self._cache[key]
        keys = torch.arange(b.k0, b.k1, device=first.device)  # (lk,)
        dropped = (keys < first[b.q0:b.q1, None]) | (keys >= ends[b.q0:b.q1, None])  # (bq, lk)
        bias = torch.zeros(dropped.shape, dtype=dtype, device=dropped.device)
        return bias.masked_fill_(dropped, float("-inf"))[None, None]

    def varlen_runs(self, window: int | None = None) -> tuple:
        """``varlen``'s sequences and window: `causal_runs` of the queries, or for `SEQUENCES` each
        packed sequence against itself, unmasked (``k_index`` None: the keys as they are)."""
        key = ("runs", window)
        if key not in self._cache:
            if self.kind == SEQUENCES:
                if window is not None or self.query_index is not None:
                    raise ConfigError("packed encoder sequences attend their whole sequence: no sliding window "
                                      "and no context-parallel shard under the 'varlen' kernel")
                lengths = torch.bincount(self._host.sample)  # (n,) tokens per sequence
                cu = _to_device(torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32), self.device)
                longest = int(lengths.max())
                self._cache[key] = ((None, cu, cu, longest, longest), (-1, -1))
            else:
                first, ends = self.bounds(window)
                runs = causal_runs(self._local(self._starts), first.tolist(), ends.tolist(), self.device)
                self._cache[key] = (runs, (-1 if window is None else window - 1, 0))
        return self._cache[key]

    def _varlen(self, q, k, v, window, gqa) -> torch.Tensor:
        varlen_attn, takes_gqa = _varlen_kernel()
        if gqa and not takes_gqa:  # a torch whose varlen_attn has no enable_gqa: every query head its own keys
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        (k_index, cu_q, cu_k, max_q, max_k), window_size = self.varlen_runs(window)
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(f"attention backend 'varlen' runs in bf16 or fp16, not {q.dtype} (train.precision="
                              "bf16 runs it); use train.attention=flex or segments")
        out = []
        for i in range(q.shape[0]):
            qi = q[i].transpose(0, 1).contiguous()  # (t, nh, hd)
            ki, vi = k[i].transpose(0, 1), v[i].transpose(0, 1)  # (T, nkv, hd)
            if k_index is not None:
                ki, vi = ki[k_index], vi[k_index]  # (sum lk, nkv, hd): each run's key range
            y = varlen_attn(qi, ki.contiguous(), vi.contiguous(), cu_q.to(q.device), cu_k.to(q.device), max_q, max_k,
                            window_size=window_size, **({"enable_gqa": gqa} if takes_gqa else {}))
            out.append(y.transpose(0, 1))  # (nh, t, hd)
        # one sequence (the LLM's packed microbatch): a view, so the output projection keeps no copy
        return out[0][None] if len(out) == 1 else torch.stack(out)

    def _flex(self, q, k, v, window, gqa) -> torch.Tensor:
        mask = self._cache.get(("flex", window))
        if mask is None:
            mask = self._cache[("flex", window)] = flex_mask(self.queries, self._device_keys(), window)
        return _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=gqa)


@dataclass(eq=False)
class PaddedGroups:
    """Causal samples as padded batches: group ``g`` holds ``n_g`` samples of at most ``L_g`` tokens,
    each padded at its end to ``L_g`` (a causal query never reaches the padding after it). Planned
    with a waste of 1.0, a group's samples are equally long: no padding (what packed encoder
    sequences, whose queries attend their whole sequence, need).

    Attributes:
        shapes: ``(n_g, L_g)`` of each group, in slot order.
        index: ``(P,)`` token in each padded slot (``P = sum n_g L_g``; padding slots repeat token 0).
        valid: ``(P,)`` whether a slot holds a token.
    """

    shapes: list[tuple[int, int]]
    index: torch.Tensor
    valid: torch.Tensor

    def __post_init__(self) -> None:  # per group, once: its slots, its filled slots and their tokens
        self._slots, self._filled, self._tokens, self._valid = [], [], [], []
        self._runs: list[tuple[int, int] | None] = []  # a group's tokens [a, b) where its slots are them in order
        at = 0
        for n, L in self.shapes:
            index, valid = self.index[at:at + n * L], self.valid[at:at + n * L]
            filled = torch.nonzero(valid).flatten()
            self._slots.append(index)
            self._filled.append(filled)
            self._tokens.append(index[filled])
            self._valid.append(valid.view(n, L))
            first = int(index[0])
            in_order = bool(valid.all()) and torch.equal(index, torch.arange(first, first + n * L, device=index.device))
            self._runs.append((first, first + n * L) if in_order else None)
            at += n * L

    @classmethod
    def plan(cls, heads: list[int], lengths: list[int], waste: float, device) -> PaddedGroups:
        """Samples longest first, each joining the current group while the group padded to its
        longest computes at most ``waste`` times its samples' own causal pairs ``l (l + 1) / 2``.

        Args:
            heads: first token of each sample.
            lengths: tokens of each sample.
            waste: see `PADDING_WASTE`.
            device: where the index tensors go.
        """
        pairs = [n * (n + 1) // 2 for n in lengths]
        groups: list[list[int]] = []
        own = 0
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            if groups and (len(groups[-1]) + 1) * pairs[groups[-1][0]] <= waste * (own + pairs[i]):
                groups[-1].append(i)
                own += pairs[i]
            else:
                groups.append([i])
                own = pairs[i]
        shapes = [(len(g), lengths[g[0]]) for g in groups]
        order = [i for g in groups for i in g]  # samples in slot order
        width = torch.tensor([L for n, L in shapes for _ in range(n)])  # (S,) each sample's padded length
        own = torch.tensor([lengths[i] for i in order])  # (S,)
        first = torch.tensor([heads[i] for i in order])  # (S,)
        P = sum(n * L for n, L in shapes)
        of_slot = torch.repeat_interleave(torch.arange(len(order)), width, output_size=P)  # (P,) its sample
        offset = torch.arange(P) - (width.cumsum(0) - width)[of_slot]  # (P,) slot within its sample
        valid = offset < own[of_slot]
        index = torch.where(valid, first[of_slot] + offset, 0)  # padding slots: token 0
        return cls(shapes, _to_device(index, device), _to_device(valid, device))

    def pad(self, x: torch.Tensor, group: int) -> torch.Tensor:
        """Group ``group`` of ``(B, h, T, *F)`` in token order: ``(B n_g, h, L_g, *F)``, padding rows
        repeating token 0. Rows are gathered token-major (``(B, T, h, *F)``, as projections lay them
        out)."""
        n, L = self.shapes[group]
        run = self._runs[group]
        if run is not None:  # equally long samples side by side, no padding: a view, no gather
            rows = x.transpose(1, 2)[:, run[0]:run[1]]  # (B, n L, h, *F)
        else:
            rows = x.transpose(1, 2).index_select(1, self._slots[group])  # (B, n L, h, *F)
        return rows.unflatten(1, (n, L)).flatten(0, 1).transpose(1, 2)

    def put(self, dst: torch.Tensor, group: int, part: torch.Tensor) -> None:
        """Write group ``group``'s ``(B n_g, h, L_g, *F)`` rows (padding dropped) into ``dst``
        ``(B, T, h, *F)``, token-major."""
        n, _ = self.shapes[group]
        rows = part.transpose(1, 2).unflatten(0, (-1, n)).flatten(1, 2)  # (B, n L, h, *F)
        run = self._runs[group]
        if run is not None:
            dst[:, run[0]:run[1]] = rows
        else:
            dst.index_copy_(1, self._tokens[group], rows.index_select(1, self._filled[group]))

    def zero_padding(self, part: torch.Tensor, group: int) -> torch.Tensor:
        """Group ``group``'s ``(B n_g, h, L_g, *F)`` rows with the padding rows 0."""
        if self._runs[group] is not None:  # no padding rows
            return part
        n, L = self.shapes[group]
        valid = self._valid[group].view(1, n, 1, L, *([1] * (part.dim() - 3)))
        return part.unflatten(0, (-1, n)).masked_fill(~valid, 0).flatten(0, 1)


@dataclass(frozen=True)
class LayerAttention:
    """`PackedAttention` as one layer runs it: with that layer's sliding window (None = none)."""

    packed: PackedAttention
    window: int | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``(B, nh, t, hd)`` queries, ``(B, nkv, t, hd)`` local keys and values -> ``(B, nh, t, hd)``.

        Outside compiled regions once `keep_out_of_compiled_graphs` ran (as
        `harmonia.runtime.parallelize.apply_compile` does before it compiles the rest of each block):
        the kernel's plan is data of each microbatch, which must not become guards that recompile
        the block every step (flex attention compiles itself)."""
        return self.packed.attend(q, k, v, self.window)


def keep_out_of_compiled_graphs() -> None:
    """Mark `LayerAttention.attend` as never compiled (``torch.compiler.disable``), once per process.

    Done where a job compiles, not at import: the decorator imports ``torch._dynamo`` (half a second
    of every rank's start, for jobs that never compile)."""
    if not getattr(LayerAttention.attend, "_harmonia_not_compiled", False):
        attend = torch.compiler.disable(LayerAttention.attend)
        attend._harmonia_not_compiled = True
        LayerAttention.attend = attend


class _SegmentAttention(torch.autograd.Function):
    """The ``segments`` kernel on CPU: FlashAttention's CPU kernel per query block, forward and backward.

    Only the queries, keys, values, output and log-sum-exp are kept for backward (linear in the
    tokens); the output is laid out token-major, so the output projection's input is a view of it,
    not a second copy kept for its weight's gradient. Each block's mask is built again in backward
    rather than kept (SDPA's own autograd would keep every block's mask: memory growing with the
    pairs). The kernel takes grouped
    key/value heads as they are, and strided blocks without copies.
    """

    @staticmethod
    def forward(ctx, q, k, v, packed: PackedAttention, window: int | None):
        B, nh, t, hd = q.shape
        ctx.packed, ctx.window = packed, window
        padded = packed.padded_groups(window)
        if padded is not None:  # one call with no mask per group of samples (causal for text)
            causal = packed.kind == CAUSAL
            out, lse = q.new_empty(B, t, nh, hd), q.new_empty(B, t, nh, dtype=torch.float32)  # token-major
            for g in range(len(padded.shapes)):
                o, l = _flash_cpu(padded.pad(q, g), padded.pad(k, g), padded.pad(v, g), None, causal=causal)
                padded.put(out, g, o)
                padded.put(lse, g, l.float())
            out, lse = out.transpose(1, 2), lse.transpose(1, 2)  # (B, nh, t, hd), (B, nh, t)
            ctx.save_for_backward(q, k, v, out, lse)
            return out
        out = q.new_empty(B, t, nh, hd).transpose(1, 2)  # (B, nh, t, hd) laid out as (B, t, nh, hd)
        lse = []
        for b in packed.blocks(window):
            o, l = _flash_cpu(*_block_inputs(q, k, v, b), packed.block_bias(b, window, q.dtype))
            out[:, :, b.q0:b.q1] = o
            lse.append(l)
        lse = torch.cat(lse, dim=2)  # (B, nh, t)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        packed, window = ctx.packed, ctx.window
        padded = packed.padded_groups(window)
        if padded is not None:
            grads = tuple(x.new_empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3]) for x in (q, k, v))
            for g in range(len(padded.shapes)):
                # a padding row's output gradient is 0, so its query adds nothing to any key's gradient
                parts = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    padded.zero_padding(padded.pad(grad, g), g), *(padded.pad(x, g) for x in (q, k, v, out, lse)),
                    0.0, packed.kind == CAUSAL)
                for dst, part in zip(grads, parts):
                    padded.put(dst, g, part)
            return (*(x.transpose(1, 2) for x in grads), None, None)  # (B, h, t, hd) each
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for b in packed.blocks(window):
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad[:, :, b.q0:b.q1], *_block_inputs(q, k, v, b), out[:, :, b.q0:b.q1], lse[:, :, b.q0:b.q1],
                0.0, False, attn_mask=packed.block_bias(b, window, q.dtype))
            dq[:, :, b.q0:b.q1] = gq
            dk[:, :, b.k0:b.k1] += gk
            dv[:, :, b.k0:b.k1] += gv
        return dq, dk, dv, None, None


def _block_inputs(q, k, v, b: QueryBlock) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's ``(B, nh, bq, hd)`` queries and ``(B, nkv, lk, hd)`` keys and values (views)."""
    return q[:, :, b.q0:b.q1], k[:, :, b.k0:b.k1], v[:, :, b.k0:b.k1]


def _flash_cpu(q, k, v, bias, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's CPU kernel: ``(B, nh, bq, hd)`` output and ``(B, nh, bq)`` log-sum-exp."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)


def on_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU: itself there (plans are made from the batch's host tensors); from a device,
    a read that waits for it (callers in the step pass host tensors)."""
    return t if t.device.type == "cpu" else t.cpu()


def _to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor copied to ``device`` without waiting for it (``non_blocking``: from pageable
    memory the copy is staged before this returns, so the host tensor may go)."""
    return t.to(device, non_blocking=True)


def _run_starts(ids: torch.Tensor) -> torch.Tensor:
    """``(T,)`` index of the first token of each token's run of equal ``ids`` (runs contiguous)."""
    T = ids.numel()
    index = torch.arange(T, device=ids.device)
    new = torch.ones(T, dtype=torch.bool, device=ids.device)
    new[1:] = ids[1:] != ids[:-1]
    return torch.cummax(torch.where(new, index, torch.zeros_like(index)), 0).values


def _item_ends(layout: TokenLayout) -> torch.Tensor:
    """``(T,)`` one past the last key each token may attend: its own index, or its item's end."""
    T = len(layout)
    index = torch.arange(T, device=layout.sample.device)
    last = torch.ones(T, dtype=torch.bool, device=index.device)
    last[:-1] = layout.segment[1:] != layout.segment[:-1]
    seg_end = torch.flip(torch.cummin(torch.flip(torch.where(last, index, torch.full_like(index, T)), [0]), 0).values,
                         [0]) + 1  # (T,) one past the segment's last token
    return torch.where(layout.is_item, seg_end, index + 1)


def plan_query_blocks(group_of: list[int], first: list[int], ends: list[int], width: int) -> list[QueryBlock]:
    """Blocks of at most ``width`` consecutive local queries and their key ranges.

    Queries come in groups (a sample's text, an item's tokens): a block never straddles two groups,
    except short ones, which join one block while its queries and its key range both stay within
    ``width``; a longer group is cut every ``width`` queries. A text query attends from its sample's
    start (or window) to itself, an item's token to its item's end, so a block's key range exceeds
    what each of its queries attends by at most ``width`` keys.

    Args:
        group_of: per local query, the id of its group (consecutive queries of one id form one).
        first: per local query, the first key it may attend.
        ends: per local query, one past the last key it may attend.
        width: most queries per block.
    """
    groups: list[tuple[int, int]] = []  # local [a, b): one group's queries each
    for i, s in enumerate(group_of):
        if groups and group_of[groups[-1][0]] == s and groups[-1][1] == i:
            groups[-1] = (groups[-1][0], i + 1)
        else:
            groups.append((i, i + 1))
    blocks: list[QueryBlock] = []
    short: QueryBlock | None = None  # whole short samples gathered so far
    for a, b in groups:
        k0, k1 = min(first[a:b]), max(ends[a:b])
        if short is not None and b - short.q0 <= width and max(k1, short.k1) - min(k0, short.k0) <= width:
            short = QueryBlock(short.q0, b, min(k0, short.k0), max(k1, short.k1))
            continue
        if short is not None:
            blocks.append(short)
            short = None
        if b - a <= width and k1 - k0 <= width:
            short = QueryBlock(a, b, k0, k1)
            continue
        for c in range(a, b, width):
            d = min(c + width, b)
            blocks.append(QueryBlock(c, d, min(first[c:d]), max(ends[c:d])))
    return blocks + ([short] if short is not None else [])


def causal_runs(starts: list[int], first: list[int], ends: list[int], device) -> tuple:
    """``varlen``'s sequences: each run of local queries contiguous in one sample against its causal
    key range ``[first key of the run's first query, its last query + 1)``, aligned bottom-right
    (FlashAttention's causal rule where a sequence has more keys than queries).

    Returns:
        ``(k_index, cu_q, cu_k, max_q, max_k)``: the keys of every run one after another, int32
        cumulative query and key lengths, the longest run and key range.
    """
    runs: list[tuple[int, int]] = []
    for i in range(len(starts)):
        if runs and starts[i] == starts[runs[-1][0]] and ends[i] == ends[i - 1] + 1:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    k_parts, cu_q, cu_k = [], [0], [0]
    for a, b in runs:
        k0, k1 = first[a], ends[b - 1]
        k_parts.append(torch.arange(k0, k1))
        cu_q.append(cu_q[-1] + b - a)
        cu_k.append(cu_k[-1] + k1 - k0)
    as_int = functools.partial(torch.tensor, dtype=torch.int32)  # made on the host, then copied
    return (_to_device(torch.cat(k_parts), device), _to_device(as_int(cu_q), device), _to_device(as_int(cu_k), device),
            max(b - a for a, b in runs), max(cu_k[i + 1] - cu_k[i] for i in range(len(runs))))


def flex_mask(queries: TokenLayout, keys: TokenLayout, window: int | None, block: int = 128):
    """A flex_attention ``BlockMask`` of the rule between local queries and keys in sequence order."""
    from torch.nn.attention.flex_attention import create_block_mask

    qs, ks = queries, keys

    def mask_mod(b, h, qi, ki):
        causal = ks.position[ki] <= qs.position[qi]
        own_item = qs.is_item[qi] & (qs.segment[qi] == ks.segment[ki])
        kept = (qs.sample[qi] == ks.sample[ki]) & (causal | own_item)
        if window is not None:
            kept = kept & (qs.position[qi] - ks.position[ki] < window)
        return kept

    return create_block_mask(mask_mod, 1, 1, len(qs), len(ks), device=str(ks.sample.device), BLOCK_SIZE=block)


@functools.cache
def _varlen_kernel() -> tuple[Callable, bool]:
    """torch's ``varlen_attn`` and whether it takes ``enable_gqa`` (torch 2.13 does, 2.11 does not)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)
