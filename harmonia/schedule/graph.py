"""The multi-module stage graph a schedule runs on, and the data dependencies between actions.

Every encoder is a chain of stages whose last stage feeds the LLM's first stage; the LLM is a chain
that ends in the loss. Several encoders may run on disjoint ranks (in parallel) or on the LLM's
ranks (colocated, one after another). One graph describes one pipeline replica: each stage chunk
sits on one pipeline rank (the representative of its TP x CP group).

A colocated encoder is held by several of the replica's pipeline ranks at once: every LLM rank
holding one of its replicas encodes its own share of each microbatch (the encoder replicas that
feed the replica are the ones on its ranks). Such a stage lists all those ranks as its
``holders``; each holder runs the stage's actions for its share, and a consumer waits for every
holder. ``ranks`` names the primary holder (the LLM's first-stage rank when it holds a share), the
rank messages of the stage are named after.

Frozen-awareness (per stage):

- ``needs_w``: the stage holds trainable parameters, so it computes weight gradients.
- ``needs_b``: some stage strictly upstream trains, so the stage must pass input gradients back.
- A stage with neither runs no backward at all (a frozen encoder with nothing trainable before it);
  a stage with ``needs_w`` only runs W straight from the incoming gradient (a trainable projector
  behind a frozen encoder).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Mapping

from harmonia.errors import ScheduleError
from harmonia.schedule.actions import Action, Kind, StageRef
from harmonia.schedule.costs import CostTable
from harmonia.schedule.layout import Layout

LLM = "llm"

SubFn = Callable[[str, int], list]
"""``subs(module, microbatch)`` -> sub-microbatch indices (``[None]`` when not split)."""
GradKindFn = Callable[[StageRef], Kind]
"""``grad_kind(stage)`` -> the kind (B or BW) producing the stage's input gradient."""


@dataclass(frozen=True)
class ModuleStages:
    """One module's stage chunks.

    Attributes:
        name: module name; ``llm`` for the language model, anything else is an encoder.
        ranks: rank holding each stage chunk, in stage order (a rank may hold several chunks).
        trainable: whether each stage chunk has trainable parameters.
        holders: per stage chunk, every rank running a share of its work (the primary rank
            first); None = each chunk on its own rank only.
        fused: per stage chunk, whether its backward stays one BW even where the schedule splits
            B and W (`fused_backward`); None = none.
    """

    name: str
    ranks: tuple[int, ...]
    trainable: tuple[bool, ...]
    holders: tuple[tuple[int, ...], ...] | None = None
    fused: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "trainable", tuple(bool(t) for t in self.trainable))
        holders = self.holders or tuple((r,) for r in self.ranks)
        holders = tuple(tuple(dict.fromkeys(int(r) for r in hs)) for hs in holders)
        object.__setattr__(self, "holders", holders)
        object.__setattr__(self, "fused", tuple(bool(f) for f in self.fused or (False,) * len(self.ranks)))
        if len(self.fused) != len(self.ranks):
            raise ScheduleError(f"module {self.name!r}: {len(self.ranks)} stage ranks but {len(self.fused)} fused "
                                "flags; give one flag per stage")
        if len(holders) != len(self.ranks) or any(not hs or hs[0] != r for hs, r in zip(holders, self.ranks)):
            raise ScheduleError(
                f"module {self.name!r}: holders {holders} must give, for each of the {len(self.ranks)} "
                f"stage chunks, its ranks starting with the chunk's rank ({self.ranks})"
            )
        if not self.ranks:
            raise ScheduleError(f"module {self.name!r} has no stages: give at least one rank")
        if len(self.trainable) != len(self.ranks):
            raise ScheduleError(
                f"module {self.name!r}: {len(self.ranks)} stage ranks but {len(self.trainable)} "
                "trainable flags; give one flag per stage"
            )
        if min(self.ranks) < 0:
            raise ScheduleError(f"module {self.name!r}: ranks {self.ranks} must be >= 0")

    @property
    def n_stages(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class StageGraph:
    """Encoders feeding the LLM's first stage, with ranks and trainability per stage.

    Attributes:
        modules: every module's stages; exactly one is named ``llm``.
    """

    modules: tuple[ModuleStages, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple(self.modules))
        names = [m.name for m in self.modules]
        if names.count(LLM) != 1:
            raise ScheduleError(f"stage graph modules {names} must contain exactly one 'llm'")
        if len(set(names)) != len(names):
            raise ScheduleError(f"stage graph modules {names} repeat a name; names must be unique")
        for name in names:
            Action(name, 0, Kind.F, 0)  # checks the name is a valid identifier
        # lookups the schedulers make per action, computed once (not fields: eq and hash ignore them)
        object.__setattr__(self, "_by_name", {m.name: m for m in self.modules})
        object.__setattr__(self, "_needs_b", {})

    # -- structure ---------------------------------------------------------------------------
    def module(self, name: str) -> ModuleStages:
        found = self._by_name.get(name)
        if found is None:
            raise ScheduleError(f"module {name!r} is not in the stage graph ({self.module_names})")
        return found

    @property
    def module_names(self) -> list[str]:
        return [m.name for m in self.modules]

    @property
    def encoders(self) -> list[str]:
        return [m.name for m in self.modules if m.name != LLM]

    @property
    def llm(self) -> ModuleStages:
        return self.module(LLM)

    def stages(self) -> list[StageRef]:
        """All stage chunks, encoders first, each in stage order."""
        order = [*self.encoders, LLM]
        return [StageRef(n, s) for n in order for s in range(self.module(n).n_stages)]

    def has_stage(self, ref: StageRef) -> bool:
        found = self._by_name.get(ref.module)
        return found is not None and 0 <= ref.stage < found.n_stages

    def rank_of(self, ref: StageRef) -> int:
        if not self.has_stage(ref):
            raise ScheduleError(f"stage {ref} is not in the stage graph")
        return self.module(ref.module).ranks[ref.stage]

    def holders_of(self, ref: StageRef) -> tuple[int, ...]:
        """Every rank running a share of the stage's work, the primary rank (`rank_of`) first."""
        if not self.has_stage(ref):
            raise ScheduleError(f"stage {ref} is not in the stage graph")
        return self.module(ref.module).holders[ref.stage]

    def is_shared(self, ref: StageRef) -> bool:
        """Several ranks each run a share of the stage's work."""
        return len(self.holders_of(ref)) > 1

    def ranks(self) -> list[int]:
        return sorted({r for m in self.modules for hs in m.holders for r in hs})

    def stages_on(self, rank: int) -> list[StageRef]:
        return [s for s in self.stages() if rank in self.holders_of(s)]

    def is_last(self, ref: StageRef) -> bool:
        return ref.stage == self.module(ref.module).n_stages - 1

    def depth_to_end(self, ref: StageRef) -> int:
        """Stages from ``ref`` to the LLM's last stage, both included (the 1F1B warm-up depth)."""
        rest = self.module(ref.module).n_stages - ref.stage
        return rest if ref.module == LLM else rest + self.llm.n_stages

    # -- frozen-awareness ----------------------------------------------------------------------
    def trains(self, ref: StageRef) -> bool:
        return self.module(ref.module).trainable[ref.stage]

    def needs_w(self, ref: StageRef) -> bool:
        """The stage computes weight gradients (it has trainable parameters)."""
        return self.trains(ref)

    def needs_b(self, ref: StageRef) -> bool:
        """The stage passes input gradients back (something strictly upstream trains)."""
        known = self._needs_b.get(ref)
        if known is None:
            own = self.module(ref.module).trainable[: ref.stage]
            known = any(own) or (ref.module == LLM and any(any(self.module(e).trainable) for e in self.encoders))
            self._needs_b[ref] = known
        return known

    def needs_backward(self, ref: StageRef) -> bool:
        return self.needs_b(ref) or self.needs_w(ref)

    def backward_kinds(self, ref: StageRef, split: bool) -> tuple[Kind, ...]:
        """The backward actions of one stage and microbatch, in order (empty when frozen)."""
        b, w = self.needs_b(ref), self.needs_w(ref)
        if b and w:
            return (Kind.B, Kind.W) if split and not self.module(ref.module).fused[ref.stage] else (Kind.BW,)
        return (Kind.B,) if b else (Kind.W,) if w else ()

    # -- data dependencies ----------------------------------------------------------------------
    def producers(self, action: Action, subs: SubFn, grad_kind: GradKindFn) -> list[Action]:
        """Compute actions whose output ``action`` consumes (across stages and on its own stage).

        Args:
            action: a compute action.
            subs: ``subs(module, microbatch)`` -> sub-microbatch indices (``[None]`` if not split).
            grad_kind: ``grad_kind(stage_ref)`` -> the kind (B or BW) that produces the stage's
                input gradient in this schedule.
        """
        ref, mb, sub = action.stage_ref, action.microbatch, action.sub
        if action.kind is Kind.F:
            if ref.stage > 0:
                return [Action(ref.module, ref.stage - 1, Kind.F, mb, sub)]
            if ref.module != LLM:
                return []
            return [Action(e, self.module(e).n_stages - 1, Kind.F, mb, j)
                    for e in self.encoders for j in subs(e, mb)]
        if action.kind is Kind.W and self.needs_b(ref):
            return [Action(ref.module, ref.stage, grad_kind(ref), mb, sub)]
        deps = [Action(ref.module, ref.stage, Kind.F, mb, sub)]
        if not self.is_last(ref):
            nxt = StageRef(ref.module, ref.stage + 1)
            deps.append(Action(nxt.module, nxt.stage, grad_kind(nxt), mb, sub))
        elif ref.module != LLM:
            deps.append(Action(LLM, 0, grad_kind(StageRef(LLM, 0)), mb, None))
        return deps

    # -- constructors ---------------------------------------------------------------------------
    @staticmethod
    def from_layouts(layouts: Mapping[str, Layout], trainable: Mapping[str, bool | tuple[bool, ...]],
                     replica: int = 0, fused: Mapping[str, tuple[bool, ...]] | None = None) -> StageGraph:
        """The graph of one LLM replica from per-module layouts.

        Stage chunk ``c`` of a module sits on pipeline rank ``c % pp`` (round-robin, as interleaved
        schedules expect); its representative rank is the first rank of that stage's TP x CP
        group in DP replica ``replica % dp``. An encoder colocated with the LLM (every replica of
        it inside one LLM replica's ranks) is held instead by the LLM ranks of replica ``replica``
        that hold its replicas (`colocated_holders`), primary the LLM's first-stage rank.

        Args:
            layouts: module -> layout; must include ``llm``.
            trainable: module -> one flag for all its stages, or one flag per stage chunk.
            replica: the LLM DP replica to describe.
            fused: module -> per stage chunk, whether its backward is never split (`fused_backward`).
        """
        modules = []
        for name, layout in layouts.items():
            holders = tuple((layout.rank_at(pp=c % layout.pp, dp=replica % layout.dp),)
                            for c in range(layout.n_stages))
            if name != LLM:
                holders = tuple(_primary_first(tuple(shared), layouts[LLM], replica) if shared else own
                                for own, shared in zip(holders, _shared_holders(layouts, name, replica)))
            flags = trainable.get(name, True)
            if isinstance(flags, bool):
                flags = (flags,) * layout.n_stages
            modules.append(ModuleStages(name, tuple(hs[0] for hs in holders), tuple(flags), holders,
                                        (fused or {}).get(name)))
        return StageGraph(tuple(modules))


def fused_backward(layouts: Mapping[str, Layout], tie_embeddings: bool) -> dict[str, tuple[bool, ...]]:
    """Per module, the stage chunks whose backward is one BW under every schedule, split or not.

    The one owner of this rule, read by the runtime's graph and the planner's alike: an LLM chunk
    holding both uses of tied embeddings (the input embedding and the head: the whole LLM on one
    chunk) reaches the one matrix through two paths, the head's and, through every block, the
    embedding's. A weight-only backward started from the head's saved gradient would run the whole
    chunk's backward again to reach the embedding, so such a chunk computes its weight gradients in
    its backward pass (priced B + W there, W nothing).
    """
    llm = layouts[LLM]
    return {LLM: (tie_embeddings and llm.n_stages == 1,) * llm.n_stages}


@dataclass
class IterationSchedule:
    """One iteration's per-rank ordered action lists: the data every consumer reads.

    Attributes:
        graph: the stage graph the schedule runs on.
        n_microbatches: microbatches in the iteration.
        n_sub: encoder -> number of sub-microbatches of each microbatch (1 = not split).
        orders: rank -> its actions in execution order.
        family: name of the generator that produced it (informational).
    """

    graph: StageGraph
    n_microbatches: int
    n_sub: dict[str, tuple[int, ...]]
    orders: dict[int, list[Action]] = field(default_factory=dict)
    family: str = ""
    producers: tuple[dict, dict] | None = field(default=None, compare=False, repr=False)
    """(stage -> grad kind, compute action -> its producers) the generator derived; `replay` reuses
    them for the same grad kinds instead of deriving them again (None: derive)."""
    costs: CostTable | None = field(default=None, compare=False, repr=False)
    """The durations the generator ordered the actions with (None: uniform). Every rank expands the
    schedule to its own action list by the schedule's timeline under these costs
    (`harmonia.schedule.rank_actions`), so they are part of the schedule."""
    chunk_actions: dict | None = field(default=None, compare=False, repr=False)
    """(schedule rank, stage chunk) -> its compute actions as ``((start, sequence), action)`` on that
    timeline, derived once by `harmonia.schedule.rank_actions` (None: not yet)."""
    placements: dict | None = field(default=None, compare=False, repr=False)
    """LLM group -> each of its ranks' compute list with its encoder work placed by its replicas'
    costs, derived on first use by `harmonia.schedule.rank_actions` (None: not yet)."""

    def subs(self, module: str, microbatch: int) -> list[int | None]:
        """Sub-microbatch indices of a microbatch on a module: ``[None]`` when not split."""
        n = self.n_sub.get(module, ())
        count = n[microbatch] if n else 1
        return [None] if count == 1 else list(range(count))

    @property
    def ranks(self) -> list[int]:
        return sorted(self.orders)

    def compute_orders(self) -> dict[int, list[Action]]:
        """Per-rank compute actions only (what the simulator times)."""
        return {r: [a for a in acts if a.kind.is_compute] for r, acts in self.orders.items()}

    def is_lowered(self) -> bool:
        """Whether communication actions are present."""
        return any(not a.kind.is_compute for acts in self.orders.values() for a in acts)

    def to_text(self) -> dict[int, list[str]]:
        return {r: [str(a) for a in acts] for r, acts in self.orders.items()}



def colocated_holders(layouts: Mapping[str, Layout], encoder: str, chunk: int,
                      replica: int) -> dict[int, list[int]] | None:
    """Where a colocated encoder's chunk runs inside LLM replica ``replica``.

    Returns:
        LLM pipeline rank (the representative of its TP x CP group in ``replica``) -> the encoder
        replicas whose chunk ``chunk`` runs on that group; None when some encoder replica is not
        inside one LLM replica's ranks (the encoder is not colocated).
    """
    every = colocated_holders_by_replica(layouts, encoder, chunk)
    return None if every is None else every.get(replica % layouts[LLM].dp)


def colocated_holders_by_replica(layouts: Mapping[str, Layout], encoder: str,
                                 chunk: int) -> dict[int, dict[int, list[int]]] | None:
    """`colocated_holders` of every LLM replica with a holder, in one pass over the encoder's replicas."""
    return _holders_by_replica(layouts[encoder], layouts[LLM], chunk)


@functools.lru_cache(maxsize=4096)
def _holders_by_replica(enc: Layout, llm: Layout, chunk: int) -> dict[int, dict[int, list[int]]] | None:
    """`colocated_holders_by_replica` of an encoder's and the LLM's layouts (kept: a pure function
    every stage graph of a plan asks again; callers do not change the result)."""
    llm_ranks = set(llm.rank_list())
    out: dict[int, dict[int, list[int]]] = {}
    for e in range(enc.dp):
        coords = []
        for p in range(enc.pp):
            for c in range(enc.cp):
                for t in range(enc.tp):
                    rank = enc.rank_at(pp=p, dp=e, cp=c, tp=t)
                    if rank not in llm_ranks:
                        return None
                    coords.append(llm.coords(rank))
        if len({c["dp"] for c in coords}) != 1:
            return None
        d = coords[0]["dp"]
        mine = coords[(chunk % enc.pp) * enc.cp * enc.tp]
        out.setdefault(d, {}).setdefault(llm.rank_at(pp=mine["pp"], dp=d), []).append(e)
    return out


def _shared_holders(layouts: Mapping[str, Layout], encoder: str, replica: int) -> list[list[int]]:
    """Per stage chunk, the LLM ranks of ``replica`` holding a colocated encoder ([] if disjoint)."""
    out = []
    for chunk in range(layouts[encoder].n_stages):
        held = colocated_holders(layouts, encoder, chunk, replica)
        out.append(sorted(held) if held else [])
    return out


def _primary_first(holders: tuple[int, ...], llm: Layout, replica: int) -> tuple[int, ...]:
    """Holders with the LLM's first-stage rank first when it is one of them."""
    first = llm.rank_at(pp=0, dp=replica % llm.dp)
    return (first, *(r for r in holders if r != first)) if first in holders else holders

