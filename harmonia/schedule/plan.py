"""A plan: every module's layout, the placement, and the schedule family; JSON in and out.

Encoders own a layout each; a projector runs on its encoder's last pipeline stage, so the boundary
carries LLM-width rows. With ``colocated`` placement encoders share the LLM's ranks (their layouts
list the same ranks, factorised their own way); with ``disjoint`` each module owns its ranks.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harmonia.errors import ConfigError, LayoutError
from harmonia.model.spec import MLLMSpec
from harmonia.schedule.generators import FAMILIES as SCHEDULES
from harmonia.schedule.layout import Layout, Placement


def parse_recompute(entries: list[str] | tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, float]]:
    """``["llm:0.5", "vision"]`` -> the plan's ``recompute`` and ``recompute_fraction``.

    Raises:
        ConfigError: a share that is not a number in (0, 1].
    """
    modules, shares = [], {}
    for entry in entries:
        module, _, share = entry.partition(":")
        modules.append(module)
        if share:
            try:
                shares[module] = float(share)
            except ValueError:
                raise ConfigError(f"recompute {entry!r}: the share after ':' must be a number in (0, 1], "
                                  "e.g. llm:0.5") from None
    return tuple(modules), shares


@dataclass(frozen=True)
class Plan:
    """All modules' layouts, placement and schedule.

    Attributes:
        model: MLLM preset name, HF checkpoint directory, or a composition (``{"llm": DIR, "encoders":
            {...}}``, as ``model.source`` gives it).
        layouts: module -> layout, for every encoder and ``llm`` (projectors ride with encoders).
        placement: ``colocated`` or ``disjoint``.
        schedule: pipeline schedule family: ``gpipe``, ``1f1b``, ``interleaved``, ``zb``.
        n_microbatches: microbatches per LLM DP replica per iteration.
        global_batch: samples per iteration.
        training: module -> ``full`` / ``frozen`` / ``lora``.
        recompute: modules whose activations are recomputed in backward.
        recompute_fraction: module -> share of each stage chunk's blocks with a backward that
            recompute, the first ones of the chunk (Megatron-LM's ``--recompute-method block``
            with ``--recompute-num-layers``); a module of ``recompute`` not named here recomputes
            every block.
    """

    model: str | dict[str, object]
    layouts: dict[str, Layout]
    placement: Placement = Placement.DISJOINT
    schedule: str = "1f1b"
    n_microbatches: int = 8
    global_batch: int = 256
    training: dict[str, str] = field(default_factory=dict)
    recompute: tuple[str, ...] = ()
    recompute_fraction: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", Placement(self.placement))
        for module, share in self.recompute_fraction.items():
            if module not in self.recompute or not 0.0 < share <= 1.0:
                raise ConfigError(f"plan recompute_fraction {module}={share}: give a share in (0, 1] of a module "
                                  f"listed in recompute {list(self.recompute)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"plan schedule {self.schedule!r} unknown; expected one of {SCHEDULES}")
        if "llm" not in self.layouts:
            raise ConfigError("plan has no layout for 'llm'; every plan lays out the LLM")
        self._check_reshard()
        if self.n_microbatches < 1 or self.global_batch < 1:
            raise ConfigError(
                f"plan n_microbatches={self.n_microbatches}, global_batch={self.global_batch} must be >= 1"
            )
        llm = self.layouts["llm"]
        if self.global_batch < llm.dp * self.n_microbatches:
            raise ConfigError(
                f"global_batch={self.global_batch} is smaller than llm dp x n_microbatches = "
                f"{llm.dp * self.n_microbatches}; raise the batch or lower dp / n_microbatches"
            )

    def _check_reshard(self) -> None:
        """FSDP that reshards per microbatch needs every DP rank of a chunk to run every forward and
        backward (its gathers and reduce-scatters are collectives), which only the LLM's replicas do
        (an encoder replica without items in a unit skips it), and fused backward (a split
        backward's W needs the weights its B freed)."""
        for module, layout in self.layouts.items():
            if not layout.resharded:
                continue
            if module != "llm":
                raise LayoutError(f"{module}: fsdp reshard is for the LLM only (an encoder replica with no items "
                                  "in a microbatch skips it, and its peers' gathers would wait); use fsdp "
                                  "without reshard for encoders")
            if self.schedule == "zb":
                raise LayoutError("llm fsdp reshard with the zb schedule: zero bubble splits the backward, and "
                                  "its W needs the weights B freed; use 1f1b, gpipe or interleaved, or fsdp "
                                  "without reshard")

    def recompute_share(self, module: str) -> float:
        """The share of ``module``'s blocks with a backward that recompute: 0 (none) to 1 (all)."""
        if module not in self.recompute:
            return 0.0
        return float(self.recompute_fraction.get(module, 1.0))

    def recompute_text(self) -> list[str]:
        """What recomputes as `parse_recompute` reads it: ``["llm:0.5", "vision"]``."""
        return [m if self.recompute_share(m) == 1.0 else f"{m}:{self.recompute_share(m):g}" for m in self.recompute]

    @property
    def recompute_key(self) -> tuple:
        """What recomputes, hashable (modules and their shares), for caches keyed by plan."""
        return tuple((m, self.recompute_share(m)) for m in self.recompute)

    @functools.cached_property
    def world_size(self) -> int:
        """Ranks the plan spans (the highest rank any module holds, plus one; computed once)."""
        return max(r for layout in self.layouts.values() for r in layout.rank_list()) + 1

    @property
    def encoders(self) -> list[str]:
        return [m for m in self.layouts if m != "llm"]

    def ranks_of(self, module: str) -> tuple[int, ...]:
        return self.layouts[module].rank_list()

    def validate(self, mllm: MLLMSpec) -> None:
        """Check the plan against a model: every encoder laid out, ranks consistent with placement."""
        missing = set(mllm.encoders) - set(self.layouts)
        extra = set(self.layouts) - set(mllm.encoders) - {"llm"}
        if missing or extra:
            raise ConfigError(
                f"plan lays out {sorted(self.layouts)} but the model has encoders {sorted(mllm.encoders)} "
                "and llm; give exactly one layout per encoder plus llm"
            )
        llm_ranks = set(self.ranks_of("llm"))
        for enc in self.encoders:
            ranks = set(self.ranks_of(enc))
            if self.placement is Placement.COLOCATED and not ranks <= llm_ranks:
                raise LayoutError(
                    f"colocated plan: {enc} ranks {sorted(ranks)} are not all LLM ranks; colocated "
                    "encoders must run on LLM ranks"
                )
            if self.placement is Placement.DISJOINT:
                for other in ["llm", *self.encoders]:
                    if other != enc and ranks & set(self.ranks_of(other)):
                        raise LayoutError(
                            f"disjoint plan: {enc} and {other} share ranks "
                            f"{sorted(ranks & set(self.ranks_of(other)))}; give each module its own ranks"
                        )
        used = set().union(*(set(self.ranks_of(m)) for m in self.layouts))
        if used != set(range(self.world_size)):
            raise LayoutError(
                f"plan leaves ranks {sorted(set(range(self.world_size)) - used)} idle; every rank "
                "below the world size must hold a module"
            )
        for module, layout in self.layouts.items():
            n_layers = self._n_layers(mllm, module)
            if layout.n_stages > n_layers:
                raise LayoutError(
                    f"{module}: {layout.n_stages} stage chunks for {n_layers} layers; lower pp or virtual_stages"
                )
            layout.stage_split(n_layers)
            body = mllm.llm.body if module == "llm" else mllm.encoders[module].body
            if body.n_heads % layout.tp or body.kv_heads % layout.tp:
                raise LayoutError(f"{module}: tp={layout.tp} does not divide its {body.n_heads} query and "
                                  f"{body.kv_heads} key/value heads; pick a tp that divides both")

    @staticmethod
    def _n_layers(mllm: MLLMSpec, module: str) -> int:
        """Blocks of a module (the unit a stage split counts)."""
        if module == "llm":
            return mllm.llm.body.n_layers
        return mllm.encoders[module].body.n_layers

    def to_json(self) -> str:
        raw = asdict(self)
        raw["placement"] = self.placement.value
        raw["layouts"] = {m: {k: v for k, v in asdict(lay).items() if k != "_grid"}
                          for m, lay in self.layouts.items()}
        raw["recompute"] = list(self.recompute)
        return json.dumps(raw, indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def from_json(text: str) -> Plan:
        try:
            raw = json.loads(text)
            layouts = {}
            for module, lay in raw.pop("layouts").items():
                for key in ("ranks", "stage_layers"):
                    if lay.get(key) is not None:
                        lay[key] = tuple(lay[key])
                layouts[module] = Layout(**lay)
            raw["recompute"] = tuple(raw.get("recompute", ()))
            return Plan(layouts=layouts, **raw)
        except (KeyError, TypeError, json.JSONDecodeError) as err:
            raise ConfigError(f"plan JSON is malformed ({err}); write it with `harmonia plan`") from None

    @staticmethod
    def load(path: str | Path) -> Plan:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"plan file {path} does not exist; create one with `harmonia plan`")
        try:
            return Plan.from_json(path.read_text())
        except (ConfigError, LayoutError) as err:
            raise type(err)(f"plan file {path}: {err}") from None
