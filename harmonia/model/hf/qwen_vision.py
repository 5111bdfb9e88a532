"""Qwen-VL vision towers <-> transformers' ``model.visual`` tensor names.

Our blocks keep separate ``q_proj``, ``k_proj``, ``v_proj`` (tensor parallelism and LoRA treat them as
in any block); transformers fuses them in ``attn.qkv``, whose rows are q's, then k's, then v's. Every
other tensor is a rename (`TABLES`), the patch embedding included (a ``Conv3d`` weight on both sides).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from harmonia.errors import ConfigError
from harmonia.model.hf.io import Table, find_prefix, rename
from harmonia.model.qwen_spec import Family, QwenVisionSpec

if TYPE_CHECKING:  # torch loads when tensors are converted, not when names are (planning)
    import torch

def _blocks_table(mlp: dict[str, str]) -> Table:
    """Block names: ``mlp`` maps HF's MLP linears to ours."""
    return [
        ("blocks.{i}.norm1.", "layers.{i}.attn_norm."),
        ("blocks.{i}.norm2.", "layers.{i}.mlp_norm."),
        ("blocks.{i}.attn.qkv.", "layers.{i}.attn.qkv."),  # fused in HF, split in `state_from_hf`
        ("blocks.{i}.attn.proj.", "layers.{i}.attn.o_proj."),
        *[(f"blocks.{{i}}.mlp.{hf}.", f"layers.{{i}}.mlp.{ours}.") for hf, ours in mlp.items()],
    ]


def _merger_table(hf: str, ours: str, parts: dict[str, str]) -> Table:
    return [(f"{hf}.{p}.", f"{ours}.{q}.") for p, q in parts.items()]


_QWEN2_MERGER = {"ln_q": "norm", "mlp.0": "linears.0", "mlp.2": "linears.1"}
_QWEN3_MERGER = {"norm": "norm", "linear_fc1": "linears.0", "linear_fc2": "linears.1"}
TABLES: dict[str, Table] = {  # (HF prefix, our prefix) per family, for `harmonia.model.hf.io.rename`
    "qwen2_vl": [("patch_embed.proj.", "patch_embed."), *_blocks_table({"fc1": "fc1", "fc2": "fc2"}),
                 *_merger_table("merger", "merger", _QWEN2_MERGER)],
    "qwen2_5_vl": [("patch_embed.proj.", "patch_embed."),
                   *_blocks_table({p: p for p in ("gate_proj", "up_proj", "down_proj")}),
                   *_merger_table("merger", "merger", _QWEN2_MERGER)],
    "qwen3_vl": [("patch_embed.proj.", "patch_embed."), ("pos_embed.", "pos_embed."),
                 *_blocks_table({"linear_fc1": "fc1", "linear_fc2": "fc2"}),
                 *_merger_table("merger", "merger", _QWEN3_MERGER),
                 *_merger_table("deepstack_merger_list.{i}", "deepstack.{i}", _QWEN3_MERGER)],
}
_QKV = re.compile(r"\.attn\.[qkv]_proj\.")


def hf_key(name: str, family: Family) -> str:
    """The transformers key (``model.visual``'s ``state_dict``) holding our tensor ``name``.

    ``layers.{i}.attn.{q,k,v}_proj.*`` are the first, second and third thirds (rows) of
    ``blocks.{i}.attn.qkv.*``. Everything else is a rename.
    """
    fused = _QKV.sub(".attn.qkv.", name)
    out = rename({fused: None}, TABLES[family], to_ours=False)
    if len(out) != 1:
        raise ConfigError(f"{name!r} is not a tensor of a {family} vision tower")
    return next(iter(out))


def state_from_hf(state: dict[str, torch.Tensor], spec: QwenVisionSpec) -> dict[str, torch.Tensor]:
    """transformers' ``model.visual`` state dict -> ours (qkv split)."""
    ours = rename(state, TABLES[spec.family], to_ours=True)
    out = {}
    for key, t in ours.items():
        if ".attn.qkv." in key:
            for proj, part in zip("qkv", t.chunk(3, dim=0)):
                out[key.replace(".attn.qkv.", f".attn.{proj}_proj.")] = part
        else:
            out[key] = t
    return out


def state_to_hf(state: dict[str, torch.Tensor], spec: QwenVisionSpec) -> dict[str, torch.Tensor]:
    """Our state dict -> transformers' ``model.visual`` names (qkv fused)."""
    import torch

    out = {}
    for key, t in state.items():
        if _QKV.search(key):
            if ".attn.q_proj." in key:
                parts = [state[key.replace(".attn.q_proj.", f".attn.{p}_proj.")] for p in "qkv"]
                out[hf_key(key, spec.family)] = torch.cat(parts, dim=0)
        else:
            out[hf_key(key, spec.family)] = t
    return out


ANCHOR = "visual.patch_embed.proj.weight"
_PROJECTOR_PARTS = ("merger.", "deepstack.")


def _renamed(keys: list[str], family: Family) -> dict[str, str]:
    """Our tower names (fused ``attn.qkv`` still) -> the checkpoint's, from the checkpoint's keys."""
    prefix = find_prefix(dict.fromkeys(keys), ANCHOR, f"{family} vision tower") + "visual."
    return rename({k: k for k in keys}, TABLES[family], to_ours=True, src_prefix=prefix)


def encoder_names(keys: list[str], spec: QwenVisionSpec) -> tuple[dict[str, str], dict[str, tuple[int, int]]]:
    """A `harmonia.model.qwen_vit.QwenVisionEncoder`'s names -> the checkpoint's (keys only, no tensors).

    Returns:
        ``names``: our name -> checkpoint name; ``parts``: for ``q_proj``, ``k_proj`` and ``v_proj``,
        ``(k, 3)``: the ``k``-th third of the rows of the checkpoint's fused ``attn.qkv``.
    """
    names, parts = {}, {}
    for ours, theirs in _renamed(keys, spec.family).items():
        if ours.startswith(_PROJECTOR_PARTS):
            continue
        if ".attn.qkv." not in ours:
            names[ours] = theirs
            continue
        for k, proj in enumerate("qkv"):
            split = ours.replace(".attn.qkv.", f".attn.{proj}_proj.")
            names[split], parts[split] = theirs, (k, 3)
    return names, parts


def merger_names(keys: list[str]) -> dict[str, str]:
    """The mergers of a Qwen-VL checkpoint, our projector (`harmonia.model.qwen_vit.projector_spec`):
    its names -> the checkpoint's. A plain merger is a `Projector` (``norm``, ``linears``); with
    Qwen3-VL's DeepStack mergers a `DeepStackProjector` (``merger.*``, ``deepstack.{i}.*``)."""
    family = "qwen3_vl" if any(".merger.linear_fc1." in k for k in keys) else "qwen2_vl"
    ours = {o: t for o, t in _renamed(keys, family).items() if o.startswith(_PROJECTOR_PARTS)}
    if any(o.startswith("deepstack.") for o in ours):
        return ours
    return {o.removeprefix("merger."): t for o, t in ours.items()}
