"""The per-rank pipeline executor: runs a lowered schedule's actions for one training iteration.

The schedule decides everything; the executor only interprets actions::

    F    forward of a stage chunk for a microbatch (the last chunk adds the loss)
    B    input gradient only (``torch.autograd.grad`` w.r.t. the stage input), keeping the
         intermediate gradients W needs (torch.distributed.pipelining's ``stage_backward_input``)
    W    weight gradient later, from what B kept (zero-bubble); or straight from the incoming
         gradient on a stage with nothing trainable upstream
    BW   fused backward
    SEND_F/SEND_B, RECV_F/RECV_B   shape-carrying asynchronous P2P (`harmonia.runtime.p2p`)

A chunk with nothing to train and nothing trainable upstream runs its forward without autograd.
Every microbatch's loss is divided by the iteration's global target count, so gradients summed over
microbatches and ``dp`` replicas equal the one-process gradient whatever the layout. After the
actions: gradient reduction over ``dp`` (started per chunk right after its last backward), the
global-norm clip, one optimizer step.

TP ranks of a stage run the same actions as their group's representative (the rank the schedule
names); peers are translated to the rank with the same ``dp``/``cp``/``tp`` coordinates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from harmonia.errors import LayoutError, ScheduleError
from harmonia.model.batch import PackedBatch
from harmonia.model.llm import DecoderLM, lm_loss
from harmonia.runtime.grads import (
    DPGradSync,
    clip_grad_norm,
    finish_fsdp_backward,
    squared_norm_share,
    start_fsdp_backward,
)
from harmonia.runtime.p2p import P2P
from harmonia.runtime.parallelize import ModuleMesh
from harmonia.schedule.actions import Action, IterationSchedule, Kind, StageRef
from harmonia.schedule.graph import LLM, StageGraph

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class StepResult:
    """What one iteration reports (identical on every rank of the module).

    Attributes:
        loss: summed token loss of the global batch divided by its target count.
        grad_norm: global gradient norm before clipping.
        n_targets: the global target count the loss was divided by.
    """

    loss: float
    grad_norm: float
    n_targets: float


def _default_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class PipelineExecutor:
    """Runs one module's stage chunks on one rank, iteration after iteration.

    Args:
        mesh: the module's mesh on this rank (`harmonia.runtime.parallelize.build_module_mesh`).
        chunks: chunk index -> stage module this rank holds, already parallelized.
        optimizer: builds the module's optimizer from its trainable parameters (default AdamW).
        max_norm: clip the global gradient norm to this; None = no clipping.
        norm_group: ranks the gradient norm is global over (default: the module's ranks).
        dtype: dtype of activations and gradients between stages.
    """

    def __init__(self, mesh: ModuleMesh, chunks: dict[int, nn.Module],
                 optimizer: OptimizerFactory | None = None, max_norm: float | None = 1.0,
                 norm_group: dist.ProcessGroup | None = None, dtype: torch.dtype = torch.float32) -> None:
        if mesh.name != LLM:
            raise LayoutError(f"the executor runs the LLM pipeline; module {mesh.name!r} needs the "
                              "boundary communicator")
        pp = mesh.coords["pp"]
        if not chunks or any(c % mesh.layout.pp != pp for c in chunks):
            raise LayoutError(f"rank {mesh.rank} (pp={pp}) must hold chunks c with c % pp == {pp}; "
                              f"got {sorted(chunks)}")
        self.mesh = mesh
        self.name = mesh.name
        self.chunks = dict(sorted(chunks.items()))
        self.params = {c: [p for p in m.parameters() if p.requires_grad] for c, m in self.chunks.items()}
        trainable = self.trainable
        self.optimizer = (optimizer or _default_optimizer)(trainable) if trainable else None
        self.max_norm = max_norm
        self.norm_group = norm_group if norm_group is not None else mesh.group
        device = next(p for m in self.chunks.values() for p in m.parameters()).device
        self.p2p = P2P(dtype=dtype, device=device)
        self.hidden = _stage_width(self.chunks)
        """Width of the activations between stages when every chunk is a `DecoderLM` (the same on
        every rank): messages then carry no shape header, each side knows ``(1, T, hidden)``."""
        layout = mesh.layout
        self.fsdp = layout.fsdp and layout.dp > 1
        self.dp_sync = DPGradSync(mesh.group_of("dp")) if layout.dp > 1 and not self.fsdp else None
        self.replication = layout.dp * layout.cp * layout.tp

    # -- schedule -> this rank's actions ------------------------------------------------------------
    def local_actions(self, schedule: IterationSchedule) -> list[Action]:
        """This rank's actions: its stage representative's list, peers moved to its dp/cp/tp coords."""
        layout, me = self.mesh.layout, self.mesh.coords
        graph = schedule.graph
        if graph.encoders:
            raise LayoutError(f"schedule has encoders {graph.encoders}; boundary transfers need the "
                              "boundary communicator, which this executor does not drive")
        if graph.llm.n_stages != layout.n_stages:
            raise ScheduleError(f"schedule has {graph.llm.n_stages} LLM stage chunks, layout "
                                f"{layout.n_stages}; build the schedule from the same layout")
        rep = graph.rank_of(StageRef(self.name, me["pp"]))
        out = []
        for a in schedule.orders.get(rep, []):
            if a.peer_rank is not None:
                peer = layout.coords(a.peer_rank)
                a = replace(a, peer_rank=layout.rank_at(pp=peer["pp"], dp=me["dp"], cp=me["cp"], tp=me["tp"]))
            if a.stage not in self.chunks:
                raise ScheduleError(f"{a} runs on rank {self.mesh.rank}, which does not hold chunk {a.stage}")
            out.append(a)
        return out

    def global_targets(self, microbatches: Sequence[PackedBatch]) -> float:
        """Target tokens of the global batch: this replica's, summed over ``dp``."""
        n = torch.tensor(float(sum(mb.n_targets for mb in microbatches)), dtype=torch.float64)
        if self.mesh.layout.dp > 1:
            dist.all_reduce(n, group=self.mesh.group_of("dp"))
        return float(n)

    # -- one iteration ------------------------------------------------------------------------------
    def step(self, schedule: IterationSchedule, microbatches: Sequence[PackedBatch],
             normalizer: float | None = None) -> StepResult:
        """Run one iteration: the schedule's actions, gradient reduction, clipping, optimizer step.

        A trainer with several modules calls `forward_backward` on each, clips once over all of
        them (`harmonia.runtime.grads.clip_grad_norm` with the sum of their `norm_share`), then
        calls `optimizer_step` on each; this method is that sequence for one module.

        Args:
            schedule: the lowered schedule of this rank's LLM replica (any replica's works: only
                stage positions are read; peers are re-targeted to this replica).
            microbatches: this replica's microbatches, indexed as in the schedule; every rank of the
                replica passes the same list (middle stages read positions, masks and labels only).
            normalizer: global target count; None = computed with an all-reduce over ``dp``.
        """
        loss, n_targets = self.forward_backward(schedule, microbatches, normalizer)
        norm = clip_grad_norm(self.norm_share(), self.trainable, self.max_norm, self.norm_group)
        self.optimizer_step()
        return StepResult(loss, norm, n_targets)

    @property
    def trainable(self) -> list[nn.Parameter]:
        """This rank's trainable parameters of the module (shards under FSDP/TP)."""
        return [p for ps in self.params.values() for p in ps]

    def forward_backward(self, schedule: IterationSchedule, microbatches: Sequence[PackedBatch],
                         normalizer: float | None = None) -> tuple[float, float]:
        """The schedule's actions and the gradient reduction over ``dp``; see `step`.

        Returns:
            (global loss, global target count), identical on every rank of the module.
        """
        if not schedule.is_lowered() and self.mesh.layout.pp > 1:
            raise ScheduleError("schedule has no sends/receives; pass harmonia.schedule.lower(schedule)")
        if len(microbatches) != schedule.n_microbatches:
            raise ScheduleError(f"schedule has {schedule.n_microbatches} microbatches but "
                                f"{len(microbatches)} were given; give one PackedBatch per microbatch")
        actions = self.local_actions(schedule)
        n_targets = normalizer if normalizer is not None else self.global_targets(microbatches)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if self.fsdp:
            for module in self.chunks.values():
                start_fsdp_backward(module)
        run = _Iteration(self, schedule.graph, microbatches, max(n_targets, 1.0))
        run.execute(actions)
        self.p2p.wait_sends()
        if self.dp_sync is not None:
            self.dp_sync.finish()
        return self._global_loss(run.loss_sum), n_targets

    def norm_share(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (see `squared_norm_share`)."""
        return squared_norm_share(self.trainable, self.replication)

    def optimizer_step(self) -> None:
        """One step of the module's optimizer (no-op for a frozen module)."""
        if self.optimizer is not None:
            self.optimizer.step()

    def _global_loss(self, local: torch.Tensor) -> float:
        me, layout = self.mesh.coords, self.mesh.layout
        last = layout.n_stages - 1
        counts = last in self.chunks and me["tp"] == 0 and me["cp"] == 0
        total = (local.detach().double() if counts else torch.zeros((), dtype=torch.float64)).clone()
        dist.all_reduce(total, group=self.mesh.group)
        return float(total)

    def on_chunk_backward_done(self, chunk: int) -> None:
        """Start the chunk's gradient reduction (called after its last backward of the iteration)."""
        if self.fsdp:
            finish_fsdp_backward(self.chunks[chunk])
        elif self.dp_sync is not None:
            self.dp_sync.start(self.params[chunk])


def _stage_width(chunks: dict[int, nn.Module]) -> int | None:
    widths = {m.spec.body.hidden if isinstance(m, DecoderLM) else None for m in chunks.values()}
    return widths.pop() if len(widths) == 1 else None


class _Iteration:
    """Tensors in flight during one iteration on one rank, keyed by (chunk, microbatch)."""

    def __init__(self, ex: PipelineExecutor, graph: StageGraph, microbatches: Sequence[PackedBatch],
                 normalizer: float) -> None:
        self.ex, self.graph, self.microbatches, self.normalizer = ex, graph, microbatches, normalizer
        self.n_chunks = graph.llm.n_stages
        self.fwd_in: dict[tuple[int, int], torch.Tensor | Action] = {}
        self.bwd_in: dict[tuple[int, int], torch.Tensor | Action] = {}
        self.outbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.w_groups: dict[tuple[int, int], list] = {}
        self.masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.loss_sum = torch.zeros(())

    def execute(self, actions: list[Action]) -> None:
        ex = self.ex
        for a in actions:
            if a.kind.is_recv:
                ex.p2p.expect(a, self._shape(a.microbatch))
        last_backward = {a.stage: i for i, a in enumerate(actions) if a.kind in (Kind.B, Kind.W, Kind.BW)}
        for i, a in enumerate(actions):
            ex.p2p.poll()
            handler = {Kind.F: self.forward, Kind.B: self.backward_input, Kind.W: self.backward_weight,
                       Kind.BW: self.backward, Kind.SEND_F: self.send, Kind.SEND_B: self.send,
                       Kind.RECV_F: self.recv, Kind.RECV_B: self.recv}[a.kind]
            handler(a)
            if last_backward.get(a.stage) == i and ex.params[a.stage]:
                ex.on_chunk_backward_done(a.stage)
        if self.saved or self.w_groups or self.outbox:
            raise ScheduleError(f"iteration ended with unfinished work: backward pending for "
                                f"{sorted(self.saved)}, W for {sorted(self.w_groups)}, unsent {sorted(self.outbox)}")

    # -- communication --------------------------------------------------------------------------
    def send(self, a: Action) -> None:
        direction = "F" if a.kind is Kind.SEND_F else "B"
        self.ex.p2p.send(a, self.outbox.pop((direction, a.stage, a.microbatch)), announce=self.ex.hidden is None)

    def _shape(self, m: int) -> tuple[int, int, int] | None:
        """The (1, T, h) of microbatch ``m``'s activations and their gradients, when known."""
        if self.ex.hidden is None:
            return None
        return (1, self.microbatches[m].input_ids.shape[-1], self.ex.hidden)

    def recv(self, a: Action) -> None:
        box = self.fwd_in if a.kind is Kind.RECV_F else self.bwd_in
        box[(a.stage, a.microbatch)] = a  # resolved by P2P.take when the compute needs it

    def _take(self, box: dict, key: tuple[int, int], what: str) -> torch.Tensor:
        value = box.pop(key, None)
        if value is None:
            raise ScheduleError(f"{self.ex.name}.s{key[0]} microbatch {key[1]}: {what} has not arrived; "
                                "the schedule runs a consumer before its producer")
        return self.ex.p2p.take(value) if isinstance(value, Action) else value

    # -- compute --------------------------------------------------------------------------------
    def _attention_inputs(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        if m not in self.masks:
            mb = self.microbatches[m]
            self.masks[m] = (mb.positions(), mb.mask())  # (1, T), (T, T)
        return self.masks[m]

    def forward(self, a: Action) -> None:
        c, m = a.stage, a.microbatch
        ref, mb = a.stage_ref, self.microbatches[m]
        if c == 0:
            if mb.media:
                raise LayoutError(f"microbatch {m} has {sorted(mb.media)} items; encoder outputs need "
                                  "the boundary communicator")
            x = mb.input_ids  # (1, T)
        else:
            x = self._take(self.fwd_in, (c, m), "the activation")  # (1, T, h)
            x.requires_grad_(self.graph.needs_b(ref))
        positions, mask = self._attention_inputs(m)
        grad = self.graph.needs_backward(ref)
        with torch.set_grad_enabled(grad):
            y = self.ex.chunks[c](x, positions, mask)  # (1, T, h) or logits (1, T, V)
            if c == self.n_chunks - 1:
                y = lm_loss(y, mb.labels, self.normalizer)
                self.loss_sum += y.detach()
        if grad:
            self.saved[(c, m)] = (x, y)
        if c < self.n_chunks - 1:
            box = self.fwd_in if c + 1 in self.ex.chunks else None
            if box is not None:
                box[(c + 1, m)] = y.detach()
            else:
                self.outbox[("F", c, m)] = y.detach()

    def _grad_output(self, c: int, m: int) -> torch.Tensor | None:
        if c == self.n_chunks - 1:
            return None  # the loss itself
        return self._take(self.bwd_in, (c, m), "the output gradient")

    def _route_input_grad(self, c: int, m: int, dx: torch.Tensor | None) -> None:
        if c == 0:
            return
        if dx is None:
            raise ScheduleError(f"{self.ex.name}.s{c} microbatch {m}: the input gradient is missing")
        if c - 1 in self.ex.chunks:
            self.bwd_in[(c - 1, m)] = dx
        else:
            self.outbox[("B", c, m)] = dx

    def _weights(self, c: int) -> Iterator[nn.Parameter]:
        """The chunk's trainable parameters as registered now (FSDP2 swaps in unsharded ones)."""
        return (p for p in self.ex.chunks[c].parameters() if p.requires_grad)

    def backward(self, a: Action) -> None:
        """BW: input and weight gradients in one pass."""
        c, m = a.stage, a.microbatch
        x, y = self.saved.pop((c, m))
        g = self._grad_output(c, m)
        torch.autograd.backward(y, g)
        if self.graph.needs_b(a.stage_ref):
            self._route_input_grad(c, m, x.grad)

    def backward_input(self, a: Action) -> None:
        """B: the input gradient now; what W needs stays in ``w_groups``."""
        from torch.distributed.pipelining._backward import stage_backward_input

        c, m = a.stage, a.microbatch
        x, y = self.saved.pop((c, m))
        g = self._grad_output(c, m)
        if self.graph.needs_w(a.stage_ref):
            dx, groups = stage_backward_input([y], None if g is None else [g], [x], self._weights(c))
            self.w_groups[(c, m)] = groups
            dx = dx[0]
        else:
            (dx,) = torch.autograd.grad(y, x, g)
        self._route_input_grad(c, m, dx)

    def backward_weight(self, a: Action) -> None:
        """W: the weight gradient, from B's saved intermediates or straight from the output gradient."""
        from torch.distributed.pipelining._backward import stage_backward_weight

        c, m = a.stage, a.microbatch
        groups = self.w_groups.pop((c, m), None)
        if groups is not None:
            stage_backward_weight(self._weights(c), groups)
            return
        _x, y = self.saved.pop((c, m))  # nothing upstream trains: no B ran, the input needs no grad
        torch.autograd.backward(y, self._grad_output(c, m))
