"""One module's parallel layout: degrees, stage boundaries, and rank set.

Ranks of a layout are laid out on a grid ``(pp, dp, cp, tp)`` with ``tp`` innermost, so TP peers are
adjacent ranks (same node) and PP stages are the outermost blocks (as Megatron-LM's default order).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import Enum

from harmonia.errors import LayoutError

AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")


class Placement(str, Enum):
    """How modules share ranks."""

    COLOCATED = "colocated"  # modules share ranks and run one after another
    DISJOINT = "disjoint"  # modules own separate ranks and run concurrently


@dataclass(frozen=True)
class Layout:
    """A module's parallel degrees, stage split and ranks.

    Attributes:
        tp: tensor-parallel degree.
        cp: context-parallel degree.
        dp: data-parallel degree (replicas; sharded with FSDP when ``fsdp``).
        pp: pipeline-parallel degree (number of physical stages).
        rank_offset: first global rank when ``ranks`` is not given.
        ranks: explicit global ranks in grid order; default ``range(rank_offset, rank_offset + size)``.
        stage_layers: number of layers per stage chunk (``pp * virtual_stages`` entries); None = even split.
        virtual_stages: stage chunks per pipeline rank (interleaved schedules).
        fsdp: shard parameters, gradients and optimizer states over ``dp``. As the runtime runs it,
            each chunk's weights are gathered once per step and kept, with the gradients they
            accumulate, whole until its last backward reduce-scatters them.
        reshard: with ``fsdp``, gather each block's weights before every forward and backward and
            free them after, reduce-scattering the gradients after every backward (ZeRO-3, FSDP2's
            default): only shards stay between microbatches. For the LLM under schedules with fused
            backward (`harmonia.schedule.plan.Plan` checks it).
    """

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    rank_offset: int = 0
    ranks: tuple[int, ...] | None = None
    stage_layers: tuple[int, ...] | None = None
    virtual_stages: int = 1
    fsdp: bool = False
    reshard: bool = False
    _grid: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for axis in (*AXES, "virtual_stages"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"layout {axis}={value!r} is invalid: expected an integer >= 1")
        if self.reshard and not self.fsdp:
            raise LayoutError("layout reshard=True without fsdp: resharding is a mode of FSDP; set fsdp too")
        if self.rank_offset < 0:
            raise LayoutError(f"layout rank_offset={self.rank_offset} is negative: expected >= 0")
        size = self.tp * self.cp * self.dp * self.pp
        if self.ranks is not None:
            ranks = tuple(int(r) for r in self.ranks)
            if len(ranks) != size:
                raise LayoutError(
                    f"layout lists {len(ranks)} ranks but tp*cp*dp*pp = {size}: list exactly {size} ranks"
                )
            if len(set(ranks)) != size or min(ranks) < 0:
                raise LayoutError(f"layout ranks {ranks} must be distinct non-negative integers")
            object.__setattr__(self, "ranks", ranks)
        if self.stage_layers is not None:
            chunks = self.pp * self.virtual_stages
            if len(self.stage_layers) != chunks or any(n < 0 for n in self.stage_layers):
                raise LayoutError(
                    f"stage_layers {self.stage_layers} must give a non-negative layer count for each "
                    f"of the pp*virtual_stages = {chunks} stage chunks"
                )
        object.__setattr__(self, "_grid", (self.pp, self.dp, self.cp, self.tp))

    @property
    def size(self) -> int:
        """Number of ranks the layout occupies."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def n_stages(self) -> int:
        """Number of stage chunks (``pp * virtual_stages``)."""
        return self.pp * self.virtual_stages

    def describe(self) -> str:
        """Degrees in one line, e.g. ``tp2 pp8 v4 dp4 fsdp`` (cp, virtual stages and FSDP when used;
        ``fsdp reshard`` when it reshards per microbatch)."""
        parts = [f"tp{self.tp}", *([f"cp{self.cp}"] if self.cp > 1 else []), f"pp{self.pp}",
                 *([f"v{self.virtual_stages}"] if self.virtual_stages > 1 else []), f"dp{self.dp}",
                 *(["fsdp"] if self.sharded else []), *(["reshard"] if self.resharded else [])]
        return " ".join(parts)

    @property
    def sharded(self) -> bool:
        """Whether FSDP shards the module (``fsdp`` over more than one replica)."""
        return self.fsdp and self.dp > 1

    @property
    def resharded(self) -> bool:
        """Whether FSDP gathers and frees the weights around every forward and backward."""
        return self.sharded and self.reshard

    def rank_list(self) -> tuple[int, ...]:
        """Global ranks in grid order ``(pp, dp, cp, tp)``, tp fastest."""
        if self.ranks is not None:
            return self.ranks
        return self._offset_ranks

    @functools.cached_property
    def _offset_ranks(self) -> tuple[int, ...]:
        return _rank_range(self.rank_offset, self.size)

    @functools.cached_property
    def _rank_set(self) -> frozenset[int]:
        return frozenset(self.rank_list())

    def holds(self, rank: int) -> bool:
        """Whether a global rank is one of this layout's."""
        if self.ranks is None:
            return self.rank_offset <= rank < self.rank_offset + self.size
        return rank in self._rank_set

    def rank_at(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """Global rank at grid coordinates."""
        if not (0 <= pp < self.pp and 0 <= dp < self.dp and 0 <= cp < self.cp and 0 <= tp < self.tp):
            for axis, c, n in zip(AXES, (pp, dp, cp, tp), self._grid):
                if not 0 <= c < n:
                    raise LayoutError(f"{axis} coordinate {c} is outside 0..{n - 1}")
        index = ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp
        return self.rank_offset + index if self.ranks is None else self.ranks[index]

    def coords(self, rank: int) -> dict[str, int]:
        """Grid coordinates of a global rank; raises if the rank is not in this layout."""
        if self.ranks is None and self.rank_offset <= rank < self.rank_offset + self.size:
            index = rank - self.rank_offset
        else:
            index = self._index_of.get(rank)
            if index is None:
                raise LayoutError(f"rank {rank} is not in this layout (ranks {self.rank_list()})")
        index, tp = divmod(index, self.tp)
        index, cp = divmod(index, self.cp)
        pp, dp = divmod(index, self.dp)
        return {"pp": pp, "dp": dp, "cp": cp, "tp": tp}

    @functools.cached_property
    def _index_of(self) -> dict[int, int]:
        """Grid index of each of the layout's ranks (explicit ``ranks``: a dict instead of a search)."""
        return {r: i for i, r in enumerate(self.rank_list())}

    def group_ranks(self, axis: str) -> list[tuple[int, ...]]:
        """All rank groups along one mesh axis (each group varies ``axis``, others fixed)."""
        if axis not in AXES:
            raise LayoutError(f"unknown axis {axis!r}: expected one of {AXES}")
        groups: dict[tuple, list[int]] = {}
        for rank in self.rank_list():
            c = self.coords(rank)
            key = tuple(c[a] for a in AXES if a != axis)
            groups.setdefault(key, []).append(rank)
        return [tuple(g) for g in groups.values()]

    def stage_split(self, n_layers: int) -> tuple[int, ...]:
        """Layers per stage chunk: ``stage_layers`` if given, else as even as possible (front-heavy)."""
        if self.stage_layers is not None:
            if sum(self.stage_layers) != n_layers:
                raise LayoutError(
                    f"stage_layers {self.stage_layers} sum to {sum(self.stage_layers)}, "
                    f"but the module has {n_layers} layers"
                )
            return self.stage_layers
        return _even_split(n_layers, self.n_stages)


@functools.lru_cache(maxsize=1024)
def _even_split(n_layers: int, chunks: int) -> tuple[int, ...]:
    """``n_layers`` over ``chunks`` as evenly as possible, the first ones one layer longer."""
    base, extra = divmod(n_layers, chunks)
    return tuple(base + (1 if i < extra else 0) for i in range(chunks))


@functools.lru_cache(maxsize=1024)
def _rank_range(offset: int, size: int) -> tuple[int, ...]:
    """The ranks ``offset .. offset + size - 1``, one tuple shared by every layout that spans them (a
    plan search on 4,096 GPUs makes thousands of layouts, each of which kept its own)."""
    return tuple(range(offset, offset + size))
