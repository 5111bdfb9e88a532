"""Layouts as text, and a plan from them: what `harmonia simulate --layout` scores.

A module's layout is written as `Layout.describe` prints it: ``tp4 cp2 pp4 v5 dp2 fsdp`` (an axis left
out has degree 1; ``v`` is the virtual stages per pipeline rank; ``fsdp`` shards over ``dp``,
``fsdp reshard`` gathers and frees the weights around every forward and backward), with
an optional stage split as `harmonia plan` prints it, ``split[3, 4, 4, 3]`` (blocks per stage chunk).
A plan's layouts are ``module layout`` entries joined by ``;``, one module after another:
``vision tp1 pp1 dp8; llm tp4 pp2 dp1``. `describe_layouts` writes that form and `parse_layouts`
reads it back.

Ranks follow from the cluster (`plan_from_layouts`): modules whose sizes add up to the world size
own consecutive rank blocks in the order written (``disjoint``); an LLM on every rank with each
encoder on the first ranks, those of the LLM's first pipeline stage when the sizes match
(``colocated``), otherwise. Anything else is a `LayoutError` saying which sizes were given.
"""

from __future__ import annotations

import re
from dataclasses import replace

from harmonia.errors import ConfigError, LayoutError
from harmonia.model.spec import MLLMSpec
from harmonia.schedule.layout import Layout, Placement
from harmonia.schedule.plan import Plan, parse_recompute

_AXIS = re.compile(r"^(tp|cp|pp|v|dp)(\d+)$")
_SPLIT = re.compile(r"split\[([\d,\s]*)\]")
_FIELDS = {"tp": "tp", "cp": "cp", "pp": "pp", "v": "virtual_stages", "dp": "dp"}


def parse_layout(text: str) -> Layout:
    """One module's layout from its `Layout.describe` form (e.g. ``tp4 cp2 pp4 v5 dp2 fsdp``).

    Raises:
        LayoutError: an unknown or repeated word, naming it and the expected form.
    """
    split = None
    found = _SPLIT.search(text)
    if found:
        split = tuple(int(n) for n in found.group(1).replace(",", " ").split())
        text = text[:found.start()] + text[found.end():]
    degrees: dict[str, int] = {}
    fsdp = reshard = False
    for word in text.split():
        match = _AXIS.match(word)
        if word == "fsdp" and not fsdp:
            fsdp = True
        elif word == "reshard" and fsdp and not reshard:
            reshard = True
        elif match and match.group(1) not in degrees:
            degrees[match.group(1)] = int(match.group(2))
        else:
            raise LayoutError(f"layout {text.strip()!r}: {word!r} is unknown or repeated; expected the words "
                              "Layout.describe prints, e.g. 'tp4 cp2 pp4 v5 dp2 fsdp' or '... dp2 fsdp reshard' "
                              "(an axis left out is 1)")
    kwargs = {_FIELDS[axis]: n for axis, n in degrees.items()}
    sharded = fsdp and kwargs.get("dp", 1) > 1
    return Layout(**kwargs, fsdp=sharded, reshard=reshard and sharded, stage_layers=split)


def describe_layouts(layouts: dict[str, Layout]) -> str:
    """``module layout; ...`` in the given order, each layout as `Layout.describe` prints it."""
    return "; ".join(f"{module} {layout.describe()}" for module, layout in layouts.items())


def parse_layouts(text: str) -> dict[str, Layout]:
    """Every module's layout from ``module layout; module layout`` (the order is kept).

    Raises:
        LayoutError: an entry without a module name or layout, or a module named twice.
    """
    out: dict[str, Layout] = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        module, _, rest = entry.partition(" ")
        if not rest.strip() or _AXIS.match(module) or module == "fsdp":
            raise LayoutError(f"layout entry {entry!r}: expected a module name and its layout, e.g. 'llm tp4 pp2 dp1'")
        if module in out:
            raise LayoutError(f"layouts name {module!r} twice; give one layout per module")
        out[module] = parse_layout(rest)
    if not out:
        raise LayoutError(f"layouts {text!r} are empty; expected e.g. 'vision tp1 pp1 dp8; llm tp4 pp2 dp1'")
    return out


def place_layouts(layouts: dict[str, Layout], world: int) -> tuple[dict[str, Layout], Placement]:
    """Rank sets for layouts on ``world`` ranks (see the module docstring): disjoint blocks in the
    order given when the sizes add up to ``world``, else colocated on an LLM that fills it."""
    if "llm" not in layouts:
        raise LayoutError(f"layouts name {sorted(layouts)} but not 'llm'; every plan lays out the LLM")
    sizes = {m: lay.size for m, lay in layouts.items()}
    if sum(sizes.values()) == world:
        placed, offset = {}, 0
        for module, layout in layouts.items():
            placed[module] = _with_offset(layout, offset)
            offset += layout.size
        placement = Placement.DISJOINT if len(layouts) > 1 else Placement.COLOCATED
        return placed, placement
    if sizes["llm"] == world and all(n <= world for n in sizes.values()):
        return {m: _with_offset(lay, 0) for m, lay in layouts.items()}, Placement.COLOCATED
    raise LayoutError(f"layouts occupy {sizes} ranks on a cluster of {world}: give modules whose sizes add up to "
                      f"{world} (each on its own ranks, in the order written), or an LLM on all {world} ranks with "
                      "encoders on its first ranks")


def _with_offset(layout: Layout, offset: int) -> Layout:
    return replace(layout, rank_offset=offset, ranks=None)


def plan_from_layouts(mllm: MLLMSpec, model: str, layouts: dict[str, Layout], world: int, global_batch: int,
                      microbatch_size: int = 1, schedule: str | None = None, recompute: tuple[str, ...] = (),
                      training: dict[str, str] | None = None) -> Plan:
    """The plan of given layouts on ``world`` ranks, checked against the model.

    Args:
        mllm: the model the plan runs (every encoder and the LLM need a layout).
        model: the model source the plan names.
        layouts: module -> layout (`parse_layouts`); ranks are assigned by `place_layouts`.
        world: ranks of the cluster.
        global_batch: samples per iteration.
        microbatch_size: samples per microbatch of an LLM replica: ``global_batch / (llm dp x
            microbatch_size)`` microbatches per replica (harmonia's balancer then fills them by cost).
        schedule: schedule family; default ``interleaved`` when the LLM has virtual stages, else ``1f1b``.
        recompute: modules whose activations are recomputed in backward, each ``module`` (every
            block) or ``module:share`` (the first ``share`` of each stage's blocks, e.g. ``llm:0.5``).
        training: module -> ``full`` / ``frozen`` / ``lora``.

    Raises:
        ConfigError: a global batch that the LLM replicas and microbatch size do not divide.
        LayoutError: layouts that do not fit the cluster or the model.
    """
    placed, placement = place_layouts(layouts, world)
    llm = placed["llm"]
    if microbatch_size < 1 or global_batch % (llm.dp * microbatch_size):
        raise ConfigError(f"global batch {global_batch} is not a multiple of llm dp {llm.dp} x microbatch size "
                          f"{microbatch_size}; change the batch, the LLM's dp or the microbatch size")
    recompute, fractions = parse_recompute(recompute)
    unknown = set(recompute) - set(mllm.module_names)
    if unknown:
        raise ConfigError(f"recompute names {sorted(unknown)}, which are not modules of {mllm.name!r} "
                          f"({mllm.module_names})")
    family = schedule or ("interleaved" if llm.virtual_stages > 1 else "1f1b")
    plan = Plan(model, placed, placement, family, global_batch // (llm.dp * microbatch_size), global_batch,
                dict(training or {}), recompute, fractions)
    plan.validate(mllm)
    return plan
