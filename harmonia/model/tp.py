"""Tensor-parallel plans of the reference models, as data.

`plan_tp` walks a built module (whole or one stage, LoRA or not) and returns ``{FQN pattern: style}``
with styles ``colwise``, ``rowwise``, ``embedding``, ``head`` and ``head_norm``, layer indices replaced
by ``*`` (Megatron's split: q/k/v and MLP up-projections column-wise, output and down-projections
row-wise). The LM head's logits stay split over the vocabulary (a DTensor ``Shard(-1)``): the loss
is computed vocabulary-parallel (`harmonia.model.llm.lm_loss` under torch's ``loss_parallel``), so no
rank ever holds a microbatch's whole ``(T, V)`` logits, as the cost model prices it. Per-head q/k
norms (Qwen3) see whole heads on every rank: their weight is replicated and
their input is sharded over the head dimension (``head_norm``: torch's ``SequenceParallel`` on dim 2
of ``(B, T, heads, head_dim)``, torchtitan's Qwen3 plan), so DTensor sums the weight's partial
gradients over the TP group.
`tp_styles` turns the plan into ``torch.distributed.tensor.parallel`` styles for
``parallelize_module(module, mesh, tp_styles(plan))``. Attention reads its local head count from the
sharded weights, so ``n_heads`` and ``n_kv_heads`` must be divisible by ``tp``.
"""

from __future__ import annotations

import re

from torch import nn

from harmonia.errors import LayoutError
from harmonia.model.layers import MLP, Attention
from harmonia.model.lora import LoRALinear

_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1")
_ROWWISE = ("o_proj", "down_proj", "fc2")


def _linear_entries(fqn: str, child: nn.Module, style: str) -> dict[str, str]:
    if not isinstance(child, LoRALinear):
        return {fqn: style}
    # Column-wise: A sees the full input (replicated), B's rows are sharded like the base's.
    # Row-wise: A's columns are sharded like the base's and its output is reduced; B is replicated.
    return {f"{fqn}.base": style, f"{fqn}.lora_b" if style == "colwise" else f"{fqn}.lora_a": style}


def plan_tp(module: nn.Module) -> dict[str, str]:
    """The TP plan of a reference module (LLM, encoder or projector, whole or a stage).

    Raises:
        LayoutError: for blocks with qk-norm over all heads (InternViT-6B), which TP cannot shard.
    """
    plan: dict[str, str] = {}
    for name, sub in module.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(sub, Attention) and sub.q_norm is not None:
            if not sub.qk_norm_per_head:
                raise LayoutError(
                    f"{name}: qk-norm over all heads cannot be tensor-parallel; use tp=1 for this module"
                )
            plan.update({f"{prefix}q_norm": "head_norm", f"{prefix}k_norm": "head_norm"})
        if isinstance(sub, (Attention, MLP)):
            for child_name, child in sub.named_children():
                if child_name in _COLWISE:
                    plan.update(_linear_entries(prefix + child_name, child, "colwise"))
                elif child_name in _ROWWISE:
                    plan.update(_linear_entries(prefix + child_name, child, "rowwise"))
    if getattr(module, "embed", None) is not None and isinstance(module.embed, nn.Embedding):
        plan["embed"] = "embedding"
    if getattr(module, "head", None) is not None:
        plan["head"] = "head"
    linears = getattr(module, "linears", None)
    if isinstance(linears, nn.ModuleList) and len(linears) % 2 == 0:
        for i in range(len(linears)):
            plan[f"linears.{i}"] = "colwise" if i % 2 == 0 else "rowwise"
    return {re.sub(r"layers\.\d+\.", "layers.*.", k): v for k, v in plan.items()}


def check_tp_degree(module: nn.Module, tp: int) -> None:
    """Check that every attention of ``module`` can be split over ``tp`` ranks by whole heads.

    Raises:
        LayoutError: when ``tp`` does not divide an attention's query or key/value head count.
    """
    for name, sub in module.named_modules():
        if not isinstance(sub, Attention):
            continue
        heads = {kind: _out_features(getattr(sub, proj)) // sub.head_dim
                 for kind, proj in (("query", "q_proj"), ("key/value", "k_proj"))}
        if any(n % tp for n in heads.values()):
            raise LayoutError(f"{name or 'attention'}: tp={tp} does not divide its {heads['query']} "
                              f"query and {heads['key/value']} key/value heads; pick a tp that divides both")


def _out_features(linear: nn.Module) -> int:
    return (linear.base if isinstance(linear, LoRALinear) else linear).out_features


def tp_styles(plan: dict[str, str]) -> dict:
    """``torch.distributed.tensor.parallel`` styles for a plan from `plan_tp`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    make = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "embedding": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        # the logits stay split over the vocabulary: `harmonia.model.llm.lm_loss` is vocabulary-parallel
        "head": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        "head_norm": lambda: SequenceParallel(sequence_dim=2, use_local_output=True),  # (B, T, nh, hd)
    }
    unknown = set(plan.values()) - set(make)
    if unknown:
        raise LayoutError(f"unknown TP styles {sorted(unknown)}; expected {sorted(make)}")
    return {fqn: make[style]() for fqn, style in plan.items()}
