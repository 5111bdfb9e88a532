"""The whole-MLLM executor: encoder stages, projectors, boundary transfers and the LLM pipeline on one rank.

Each rank runs the stage chunks it holds of every module (an encoder colocated with the LLM shares
its ranks; a disjoint one has its own). The projector of an encoder runs on the encoder's last
stage, so that stage emits ``(rows, D)`` item embeddings in LLM width. Actions::

    vision.s1.F3.1   encoder forward of sub-microbatch 1 (the last stage adds the projector; after a
                     microbatch's last sub-microbatch its rows leave through the boundary)
    llm.s0.F3        waits for every encoder's rows of microbatch 3, splices them in, runs the stage
    llm.s0.B3        input gradient w.r.t. the spliced rows, sent back through the boundary
    vision.s1.B3.1   the boundary gradient of the sub-microbatch's rows, back through the projector
    llm.s1.B3 / W3   split backward (zero-bubble): B the input gradient only, keeping what W needs
                     (torch.distributed.pipelining's ``stage_backward_input``), W the weight gradient
                     later; BW fused. W alone on a trainable projector behind a frozen encoder (it
                     runs the stage's whole backward); no backward at all where nothing trains

An LLM-only model is the same graph without encoders: every pipeline layout, of an LLM alone or of a
whole MLLM, runs through this one executor.

The schedule is one LLM replica's (`StageGraph.from_layouts`); every rank runs its own action list
of it, `harmonia.schedule.rank_actions.plan_rank_actions`: the compute of its stage chunks in the
schedule's timeline order, and every send, receive, boundary transfer and gradient reduction in its
place. The executor derives nothing: it interprets the list, the same list the simulator times.
Communication is asynchronous: every receive is posted when the iteration starts, stage messages
travel through `P2P` (one per module, on its group), boundary rows through `BoundaryLink` (one
plan per microbatch and encoder); a receive action waits for its data, a send never blocks. After
the actions: the reductions finish, one global-norm clip over all modules, one optimizer step per
module.

Context parallelism (LLM only; encoders run ``cp=1``): every CP rank of an LLM stage runs its own
tokens of every microbatch (the batch's token-to-rank assignment, `RankBatch.llm_cp`), attention
gathers keys and values over ``cp`` (`harmonia.runtime.context_parallel`), the boundary delivers
each CP rank the item rows of its tokens, stage messages go between ranks of the same ``cp``
coordinate, the loss sums each rank's own targets (divided by the global target count), and the
gradients of the weights, replicated over ``cp``, are summed over ``dp x cp``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from harmonia.errors import LayoutError, ScheduleError
from harmonia.model.attention import PackedAttention
from harmonia.model.llm import lm_loss
from harmonia.model.mllm import project_items, run_encoder
from harmonia.runtime.boundary_link import BoundaryLink
from harmonia.runtime.context_parallel import CPShard, build_cp_shard
from harmonia.runtime.grads import (reduce_in_last_backward, reduce_loss_and_clip, squared_norm_share,
                                   start_fsdp_backward, start_fsdp_resharding)
from harmonia.runtime.meshes import ModuleMeshes
from harmonia.runtime.mllm_inputs import RankBatch
from harmonia.runtime.p2p import P2P
from harmonia.runtime.runner import ModuleRunner
from harmonia.schedule.actions import Action, Kind, StageRef
from harmonia.schedule.graph import LLM, IterationSchedule, StageGraph
from harmonia.schedule.rank_actions import plan_rank_actions

Key = tuple[str, int, int, int]  # (module, chunk, microbatch, sub)
OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]
"""Builds one runner's optimizer from its param groups, one per module (`ModuleRunner.param_groups`)."""


@dataclass(frozen=True)
class StepResult:
    """What one iteration reports (identical on every rank).

    Attributes:
        loss: summed token loss of the global batch divided by its target count.
        grad_norm: global gradient norm before clipping.
        n_targets: the global target count the loss was divided by.
    """

    loss: float
    grad_norm: float
    n_targets: float


def default_optimizer(param_groups: list[dict]) -> torch.optim.Optimizer:
    """AdamW at lr 1e-3: the optimizer of a module when the caller gives none."""
    return torch.optim.AdamW(param_groups, lr=1e-3)


class MLLMExecutor:
    """Runs this rank's stage chunks of every module (encoders, projectors, LLM), iteration after iteration.

    Args:
        meshes: every module's meshes and groups (`harmonia.runtime.meshes.build_module_meshes`).
        chunks: module -> chunk index -> stage module, for the modules this rank runs, already
            parallelized (`harmonia.runtime.parallelize.parallelize_stage`: TP, FSDP).
        hidden: the LLM hidden size (width of the rows crossing every boundary).
        projectors: encoder -> its projector, on ranks holding the encoder's last chunk (every TP
            rank of it holds a whole replica: its input and output rows are replicated over ``tp``).
        optimizer: builds one runner's optimizer from its trainable parameters, given as param groups
            ``{"params": [...], "module": name}``: the runner's own, and an encoder's projector
            (``vision_proj``) as a group of its own (default AdamW).
        max_norm: clip the global gradient norm over all modules to this; None = no clipping.
        norm_group: ranks the norm, the loss and the target count are global over (default: world;
            every rank of it calls `step`).
        dtype: dtype of activations and gradients between stages and across boundaries.
        autocast: compute dtype of every forward (``torch.bfloat16`` for mixed precision on GPUs:
            matmuls in bf16, reductions and the loss in fp32, parameters and their gradients
            stay fp32); None = the parameters' dtype.
        attention: the LLM's attention kernel (`harmonia.model.attention_backend.choose_backend`: ``auto``
            picks by device and each microbatch's mask kind).
        head_dim: the LLM's channels per head, which the kernel must take (None = not checked).
        row_widths: encoder -> width of its boundary rows where it is not ``hidden`` (a projector
            with DeepStack mergers sends ``hidden * (1 + k)``, `harmonia.model.projector_spec.ProjectorSpec`).
    """

    def __init__(self, meshes: ModuleMeshes, chunks: dict[str, dict[int, nn.Module]], hidden: int,
                 projectors: dict[str, nn.Module] | None = None, optimizer: OptimizerFactory | None = None,
                 max_norm: float | None = 1.0, norm_group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype = torch.float32, autocast: torch.dtype | None = None,
                 attention: str = "auto", row_widths: dict[str, int] | None = None,
                 head_dim: int | None = None) -> None:
        projectors = projectors or {}
        self.autocast, self.attention, self.head_dim = autocast, attention, head_dim
        self.meshes, self.rank, self.max_norm, self.norm_group = meshes, meshes.rank, max_norm, norm_group
        self.hidden = hidden
        self.row_widths = dict(row_widths or {})
        self.runners: dict[str, ModuleRunner] = {}
        device: torch.device | str = "cpu"
        for name, mods in sorted(chunks.items()):
            mesh = meshes.module_mesh(name)
            layout, pp = mesh.layout, mesh.coords["pp"]
            if layout.cp > 1 and name != LLM:
                raise LayoutError(f"encoder {name!r}: cp={layout.cp}; encoders run cp=1 (only the LLM is "
                                  "context-parallel); use tp, dp, fsdp and pp for encoders")
            if not mods or any(c % layout.pp != pp for c in mods):
                raise LayoutError(f"rank {self.rank} ({name} pp={pp}) must hold chunks c with c % pp == "
                                  f"{pp}; got {sorted(mods)}")
            last = layout.n_stages - 1 in mods
            if name != LLM and last != (name in projectors):
                raise LayoutError(f"rank {self.rank}: pass {name!r}'s projector exactly on the ranks "
                                  "holding its last stage chunk")
            if layout.resharded and name != LLM:
                raise LayoutError(f"encoder {name!r}: fsdp reshard is for the LLM only (an encoder replica "
                                  "with no items skips units its peers gather weights for); use fsdp without reshard")
            device = next(p for m in mods.values() for p in m.parameters()).device
            self.runners[name] = ModuleRunner(mesh, dict(sorted(mods.items())), projectors.get(name),
                                              P2P(group=mesh.group, dtype=dtype, device=device))
        missing = [m for m in meshes.modules() if m not in self.runners]
        if missing:
            raise LayoutError(f"rank {self.rank} runs {missing} in the plan but got no chunks for them")
        self.dtype, self.device = dtype, device
        self.optimizers = {n: (optimizer or default_optimizer)(r.param_groups())
                           for n, r in self.runners.items() if r.trainable}
        self.action_times: list[tuple[Action, float, float, float]] | None = None
        """When a list: every compute action run is appended with its start and end
        (``time.perf_counter``) and the CPU seconds this thread spent in it (``time.thread_time``)."""
        self.executed: list[Action] = []
        """Every action of the last iteration, in the order it ran."""

    def row_width(self, encoder: str) -> int:
        """Width of the rows ``encoder`` sends the LLM."""
        return self.row_widths.get(encoder, self.hidden)

    @property
    def trainable(self) -> list[nn.Parameter]:
        """This rank's trainable parameters over all its modules."""
        return [p for r in self.runners.values() for p in r.trainable]

    def rank_actions(self, schedule: IterationSchedule) -> list[Action]:
        """This rank's action list of a schedule (`harmonia.schedule.rank_actions.plan_rank_actions`):
        exactly what `forward_backward` runs, in order."""
        return plan_rank_actions(self.meshes.layouts, schedule, [self.rank])[self.rank]

    # -- one iteration ------------------------------------------------------------------------------
    def step(self, schedule: IterationSchedule, batch: RankBatch) -> StepResult:
        """One iteration: the schedule's actions, gradient reduction, global-norm clip, optimizer steps.

        Args:
            schedule: the iteration's schedule of one LLM replica over all modules; this rank runs
                its own action list of it (`rank_actions`).
            batch: this rank's data (`harmonia.runtime.mllm_inputs.build_rank_batch`).
        """
        share = self.loss_share(schedule, batch)
        loss, norm = reduce_loss_and_clip(share, self.norm_share(), self.trainable, self.max_norm, self.norm_group)
        self.optimizer_step()
        return StepResult(loss, norm, batch.n_targets)

    def _vocabulary_parallel(self) -> contextlib.AbstractContextManager:
        """torch's ``loss_parallel`` where this rank's LLM head is split over the vocabulary (LLM
        ``tp > 1``, `harmonia.model.tp`): the loss and its backward read only the rank's logits."""
        if LLM not in self.runners or self.meshes.layouts[LLM].tp <= 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def forward_backward(self, schedule: IterationSchedule, batch: RankBatch) -> float:
        """The actions and the gradient reduction; returns the global loss (the same on every rank)."""
        total = self.loss_share(schedule, batch)
        dist.all_reduce(total, group=self.norm_group)
        return float(total)

    def loss_share(self, schedule: IterationSchedule, batch: RankBatch,
                   beside_reduction: Callable[[], None] | None = None) -> torch.Tensor:
        """The actions and the gradient reduction; returns this rank's share of the global loss
        (float64 on the host; summed over ``norm_group`` it is the loss): a training step reduces it
        with the gradient norm in one collective (`harmonia.runtime.grads.reduce_loss_and_clip`).
        ``beside_reduction`` runs on the host once every action has run, while the last gradient
        reductions are in flight (e.g. the next step's preparation), before they are waited for."""
        graph = schedule.graph
        if sorted(graph.module_names) != sorted(self.meshes.layouts):
            raise ScheduleError(f"schedule modules {graph.module_names} differ from the plan's "
                                f"{sorted(self.meshes.layouts)}; build the graph from the same layouts")
        if LLM in self.runners and len(batch.llm) != schedule.n_microbatches:
            raise ScheduleError(f"schedule has {schedule.n_microbatches} microbatches but {len(batch.llm)} "
                                "LLM microbatches were given")
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
        actions = self.rank_actions(schedule)
        split = [a for a in actions if a.kind is Kind.W and self.runners[a.module].reshard]
        if split:
            raise ScheduleError(f"{split[0]}: a split backward's W on an FSDP chunk that reshards per microbatch "
                                "(B freed the weights W needs); use a schedule with fused backward (1f1b, gpipe, "
                                "interleaved) or fsdp without reshard")
        for r in self.runners.values():
            r.reduced.clear()
            if r.fsdp:
                for c, module in r.chunks.items():
                    if r.reshard:
                        start_fsdp_resharding(module)
                    else:
                        r.gathers[c] = start_fsdp_backward(module)
        run = _MLLMIteration(self, schedule, batch, _reducing_backwards(self.runners, actions))
        with self._vocabulary_parallel():
            run.execute(actions)
        try:
            if beside_reduction is not None:
                beside_reduction()
        finally:  # its error raised once nothing is in flight
            for r in self.runners.values():
                r.p2p.wait_sends()
                r.finish_reduction()
        for link in run.links.values():
            link.finish()
        for r in self.runners.values():
            if r.tied is not None:
                r.tied.run()
        # TP ranks repeat the loss; CP ranks each hold the loss of their own tokens.
        counts = LLM in self.runners and self.runners[LLM].mesh.coords["tp"] == 0
        # on the host, as the caller reads it (a process group on GPUs has gloo beside NCCL for this)
        return (run.loss_sum.detach().to("cpu", torch.float64, copy=True) if counts
                else torch.zeros((), dtype=torch.float64))

    def norm_share(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm, over all its modules."""
        return sum((squared_norm_share(r.norm_params, r.replication) for r in self.runners.values()),
                   torch.zeros((), dtype=torch.float64))

    def optimizer_step(self) -> None:
        """One step of every module's optimizer on this rank."""
        for opt in self.optimizers.values():
            opt.step()


class _MLLMIteration:
    """Tensors in flight during one iteration on one rank, keyed by (module, chunk, microbatch, sub)."""

    def __init__(self, ex: MLLMExecutor, schedule: IterationSchedule, batch: RankBatch,
                 reducing: frozenset[Action] = frozenset()) -> None:
        """``reducing``: the backwards that reduce-scatter their chunk's gradients (`_reducing_backwards`)."""
        self.ex, self.schedule, self.batch, self.reducing = ex, schedule, batch, reducing
        self.graph: StageGraph = schedule.graph
        self.normalizer = max(batch.n_targets, 1.0)
        self.inbox: dict[Key, torch.Tensor] = {}  # a chunk's inputs: activations or output gradients
        self.outbox: dict[tuple[str, Key], torch.Tensor] = {}  # ("F" or "B", producer) -> tensor to send
        self.rows_in: dict[tuple[str, int], torch.Tensor] = {}  # (encoder, microbatch) -> LLM input rows
        self.row_grads: dict[tuple[str, int], torch.Tensor] = {}  # their gradients, to send back
        self.saved: dict[Key, tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]] = {}
        self.w_groups: dict[Key, list] = {}
        self.enc_rows: dict[tuple[str, int], dict[int, torch.Tensor]] = {}  # encoder output rows per sub
        self.enc_grads: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.leaves: dict[int, dict[str, torch.Tensor]] = {}  # microbatch -> encoder -> LLM input rows
        self.loss_sum = torch.zeros((), device=ex.device)
        self.enc_sizes: dict[tuple[str, int], list[int]] = {}
        self.pending_g: dict[Key, torch.Tensor | None] = {}
        self.masks: dict[int, tuple[torch.Tensor, PackedAttention, CPShard | None]] = {}
        self.links: dict[str, BoundaryLink] = {}
        for e in self.graph.encoders:
            plans = batch.plans.get(e, [])
            if len(plans) != schedule.n_microbatches:
                raise ScheduleError(f"encoder {e!r}: {len(plans)} boundary plans for "
                                    f"{schedule.n_microbatches} microbatches; give one per microbatch")
            src_last = ex.meshes.layouts[e].n_stages - 1
            if (e in ex.runners and src_last in ex.runners[e].chunks) or \
                    (LLM in ex.runners and 0 in ex.runners[LLM].chunks):
                back = self.graph.needs_backward(StageRef(e, self.graph.module(e).n_stages - 1))
                self.links[e] = BoundaryLink(plans, ex.rank, ex.meshes.boundary_group(e), ex.row_width(e),
                                             back, ex.dtype, ex.device)


    # -- driving the actions ------------------------------------------------------------------------
    def execute(self, actions: list[Action]) -> None:
        """Run this rank's action list, in order (every receive posted first, so data flows early)."""
        for link in self.links.values():
            link.post_receives()
        for a in actions:
            if a.kind.is_recv and a.peer is None and not self._empty(a):
                self.ex.runners[a.module].p2p.expect(a, self._message_shape(a.module, a.microbatch))
        handlers = {Kind.F: self.forward, Kind.B: self.backward_input, Kind.W: self.backward_weight,
                    Kind.BW: self.backward, Kind.SEND_F: self.send, Kind.SEND_B: self.send,
                    Kind.RECV_F: self.receive, Kind.RECV_B: self.receive, Kind.REDUCE: self.reduce}
        self.ex.executed = []
        for a in actions:
            for r in self.ex.runners.values():
                r.p2p.poll()
            self.ex.executed.append(a)
            if self.ex.action_times is None or not a.kind.is_compute:
                handlers[a.kind](a)
            else:
                start, cpu = time.perf_counter(), time.thread_time()
                handlers[a.kind](a)
                self.ex.action_times.append((a, start, time.perf_counter(), time.thread_time() - cpu))
        if self.saved or self.w_groups or self.pending_g or self.outbox:
            raise ScheduleError(f"iteration ended with unfinished work: backward pending for "
                                f"{sorted(self.saved)}, W for {sorted(self.w_groups)}, unsent {sorted(self.outbox)}")

    def _key(self, a: Action) -> Key:
        return a.module, a.stage, a.microbatch, 0 if a.sub is None else a.sub

    def _media(self, a: Action):
        """The encoder inputs of an action's (sub-)microbatch on this replica (None: no items)."""
        subs = self.batch.media.get(a.module, [])
        if a.microbatch >= len(subs) or len(subs[a.microbatch]) != len(self.schedule.subs(a.module, a.microbatch)):
            raise ScheduleError(f"{a}: give {a.module!r} inputs for each of the schedule's "
                                f"{len(self.schedule.subs(a.module, a.microbatch))} sub-microbatches")
        return subs[a.microbatch][self._key(a)[3]]

    def _empty(self, a: Action) -> bool:
        """The unit has no data on this replica (an encoder replica without items): its compute and
        stage messages do nothing, on both ends of each message."""
        return a.module != LLM and self._media(a) is None

    def _take(self, key: Key, what: str) -> torch.Tensor:
        value = self.inbox.pop(key, None)
        if value is None:
            raise ScheduleError(f"{key[0]}.s{key[1]} microbatch {key[2]}.{key[3]}: {what} has not arrived; "
                                "the action list runs a consumer before its producer")
        return value

    def _pass(self, a: Action, forward: bool, t: torch.Tensor) -> None:
        """Hand a stage's output (forward) or input gradient to the neighbouring chunk: straight into
        its inbox when this rank holds it, else to the outbox its send action empties."""
        name, c, m, s = self._key(a)
        nxt = c + 1 if forward else c - 1
        if nxt in self.ex.runners[name].chunks:
            self.inbox[(name, nxt, m, s)] = t
        else:
            self.outbox[("F" if forward else "B", (name, c, m, s))] = t

    def _message_shape(self, name: str, m: int) -> tuple[int, int, int] | None:
        """The ``(1, t, hidden)`` of the LLM's stage messages of microbatch ``m`` (activations and their
        gradients): both ends know this rank's token count, so no shape header travels. None for
        encoders, whose message shapes follow their media."""
        if name != LLM:
            return None
        mesh = self.ex.runners[LLM].mesh
        if mesh.layout.cp == 1:
            return 1, self.batch.llm[m].input_ids.shape[-1], self.ex.hidden
        return 1, int((self.batch.llm_cp[m] == mesh.coords["cp"]).sum()), self.ex.hidden

    # -- communication ------------------------------------------------------------------------------
    def send(self, a: Action) -> None:
        """A stage message to the peer rank, or this rank's part of a boundary transfer."""
        name, c, m, s = self._key(a)
        if a.peer is None:
            if not self._empty(a):
                t = self.outbox.pop(("F" if a.kind is Kind.SEND_F else "B", (name, c, m, s)))
                self.ex.runners[name].p2p.send(a, t, announce=self._message_shape(name, m) is None)
        elif a.kind is Kind.SEND_F:  # the encoder's rows of the microbatch, every sub-microbatch's
            parts = self.enc_rows.pop((name, m))
            self.enc_sizes[(name, m)] = [parts[j].shape[0] for j in sorted(parts)]
            self.links[name].send(m, torch.cat([parts[j] for j in sorted(parts)]))  # (src_rows, D)
        else:  # the gradients of the LLM input rows of one encoder
            e = a.peer.module
            grads = self.row_grads.pop((e, m), None)
            if grads is None:  # this rank received none of its rows
                grads = torch.zeros(0, self.ex.row_width(e), dtype=self.ex.dtype, device=self.ex.device)
            self.links[e].send(m, grads, backward=True)

    def receive(self, a: Action) -> None:
        """A stage message from the peer rank, or this rank's part of a boundary transfer."""
        name, c, m, s = self._key(a)
        if a.peer is None:
            if not self._empty(a):
                self.inbox[(name, c, m, s)] = self.ex.runners[name].p2p.take(a)
        elif a.kind is Kind.RECV_F:  # (dst_rows, D) rows of encoder a.peer, in media.index order
            self.rows_in[(a.peer.module, m)] = self.links[a.peer.module].take(m)
        else:  # (src_rows, D) gradients of this encoder's rows, cut back into its sub-microbatches
            dx = self.links[name].take(m, backward=True)
            self.enc_grads[(name, m)] = list(dx.split(self.enc_sizes.pop((name, m))))

    def reduce(self, a: Action) -> None:
        """Start the chunk's gradient reduction over ``dp x cp`` (after its last backward)."""
        runner = self.ex.runners[a.module]
        if runner.params[a.stage]:
            runner.backward_done(a.stage)

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, a: Action) -> None:
        if a.module == LLM:
            return self._llm_forward(a)
        r, key = self.ex.runners[a.module], self._key(a)
        name, c, m, s = key
        last = c == r.n_stages - 1
        media = self._media(a)
        if media is not None:
            ref = a.stage_ref
            if c == 0:
                x = media.inputs  # (N, C, H, W) tiles, (N, n_mels, F) audio chunks or (N, D) patches
            else:
                x = self._take(key, "the activation")  # (N, P', h)
                x.requires_grad_(self.graph.needs_b(ref))
            grad = self.graph.needs_backward(ref)
            with torch.set_grad_enabled(grad), self._autocast():
                y = run_encoder(r.chunks[c], x, media)
                if last:
                    y = project_items(r.projector, y, media)  # (rows, D)
            if grad:
                self.saved[key] = ([x] if c > 0 else [], y)
            if not last:
                self._pass(a, True, y.detach())
        if last:  # the boundary send after the microbatch's last forward takes every part
            parts = self.enc_rows.setdefault((name, m), {})
            parts[s] = y.detach() if media is not None else torch.zeros(0, self.ex.row_width(name), dtype=self.ex.dtype,
                                                                        device=self.ex.device)

    def _autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.ex.autocast
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.ex.device).type, dtype=dtype)

    def _attention_inputs(self, m: int) -> tuple[torch.Tensor, PackedAttention, CPShard | None]:
        """Rotary positions, attention and CP shard of LLM microbatch ``m`` on this rank (once per
        microbatch, shared by every layer of every chunk)."""
        if m not in self.masks:
            mb, mesh = self.batch.llm[m], self.ex.runners[LLM].mesh
            if mesh.layout.cp == 1:
                self.masks[m] = (mb.positions(), mb.attention(self.ex.attention, self.ex.head_dim), None)  # (1, T)
            else:
                if m >= len(self.batch.llm_cp):
                    raise ScheduleError(f"LLM microbatch {m}: cp={mesh.layout.cp} but the batch has no CP "
                                        "assignment for it; build it with build_rank_batch from the same layouts")
                shard = build_cp_shard(mb, self.batch.llm_cp[m], mesh.coords["cp"], mesh.group_of("cp"),
                                       mesh.layout.cp, self.ex.attention, self.ex.head_dim)
                self.masks[m] = (shard.positions, shard.attention, shard)  # (1, t), local queries vs all keys
        return self.masks[m]

    def _llm_forward(self, a: Action) -> None:
        r, key = self.ex.runners[LLM], self._key(a)
        _, c, m, _ = key
        mb = self.batch.llm[m]
        positions, mask, shard = self._attention_inputs(m)
        ref = a.stage_ref
        grad = self.graph.needs_backward(ref)
        embeds, index = [], []
        if c == 0:
            x, inputs = mb.input_ids if shard is None else mb.input_ids[:, shard.tokens], []  # (1, t)
            leaves = self.leaves.setdefault(m, {})
            for e in self.graph.encoders:
                rows = self.rows_in.pop((e, m))  # (dst_rows, D) in media.index order (this CP rank's)
                at = mb.media[e].index if e in mb.media else torch.zeros(0, dtype=torch.long)
                if shard is not None:
                    at = shard.item_rows(at)[1]
                if rows.shape[0] != at.numel():
                    raise LayoutError(f"microbatch {m}: {rows.shape[0]} {e} rows arrived for {at.numel()} item "
                                      "positions; build the boundary plans from the same sample split")
                if at.numel() == 0:
                    continue
                if self.links[e].backward:
                    leaves[e] = rows.requires_grad_()
                    inputs.append(rows)
                embeds.append(rows)
                index.append(at)
        else:
            x = self._take(key, "the activation")  # (1, t, h)
            x.requires_grad_(self.graph.needs_b(ref))
            inputs = [x]
        with torch.set_grad_enabled(grad), self._autocast():
            y = r.chunks[c](x, positions, mask, torch.cat(embeds) if embeds else None,
                            torch.cat(index) if index else None)  # (1, t, h) or logits (1, t, V)
            if c == r.n_stages - 1:
                labels = mb.labels if shard is None else mb.labels[:, shard.tokens]  # this rank's targets
                y = lm_loss(y, labels, self.normalizer)
                self.loss_sum += y.detach()
        if grad:
            self.saved[key] = (inputs, y)
        if c < r.n_stages - 1:
            self._pass(a, True, y.detach())

    # -- backward -----------------------------------------------------------------------------------
    def _grad_output(self, a: Action) -> torch.Tensor | None:
        r, key = self.ex.runners[a.module], self._key(a)
        name, c, m, s = key
        if c < r.n_stages - 1:
            return self._take(key, "the output gradient")
        if name == LLM:
            return None  # the loss itself
        return self.enc_grads[(name, m)][s]  # the boundary gradient of the sub-microbatch's rows

    def _route(self, a: Action, inputs: list[torch.Tensor], grads) -> None:
        """Send the input gradients back: to the previous stage, or across the boundaries."""
        if not self.graph.needs_b(a.stage_ref):
            return
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]
        name, c, m, _ = self._key(a)  # LLM s0: one input per encoder with rows, else the activation
        if name == LLM and c == 0:  # the boundary sends that follow take them
            for e, rows in self.leaves.pop(m, {}).items():
                self.row_grads[(e, m)] = _grad_of(rows, inputs, grads)
        elif c > 0:
            self._pass(a, False, grads[0])

    def backward(self, a: Action) -> None:
        """BW: input and weight gradients in one pass."""
        if self._empty(a):
            return
        inputs, y = self.saved.pop(self._key(a))
        if a in self.reducing:
            runner = self.ex.runners[a.module]
            reduce_in_last_backward(runner.chunks[a.stage])
            runner.reduced.add(a.stage)
        torch.autograd.backward(y, self._grad_output(a))
        self._route(a, inputs, [x.grad for x in inputs])

    def backward_input(self, a: Action) -> None:
        """B: the input gradient now; what W needs stays in ``w_groups``."""
        if self._empty(a):
            return
        key = self._key(a)
        inputs, y = self.saved.pop(key)
        g = self._grad_output(a)
        if not inputs:  # nothing to differentiate on this replica: W runs the whole backward
            if self.graph.needs_w(a.stage_ref):
                self.saved[key], self.pending_g[key] = (inputs, y), g
            self._route(a, inputs, [])
            return
        if self.graph.needs_w(a.stage_ref):
            from torch.distributed.pipelining._backward import stage_backward_input

            _check_splittable(self.ex.runners[a.module].chunks[a.stage], a)
            weights = self.ex.runners[a.module].weights(a.stage)
            grads, self.w_groups[key] = stage_backward_input([y], None if g is None else [g], inputs, weights)
        else:
            grads = torch.autograd.grad(y, inputs, g, allow_unused=True)
        self._route(a, inputs, list(grads))

    def backward_weight(self, a: Action) -> None:
        """W: weight gradients from B's saved intermediates, or straight from the output gradient."""
        if self._empty(a):
            return
        key = self._key(a)
        groups = self.w_groups.pop(key, None)
        if groups is not None:  # imported where a split B ran (torch.distributed.pipelining: 0.1 s)
            from torch.distributed.pipelining._backward import stage_backward_weight

            stage_backward_weight(self.ex.runners[a.module].weights(a.stage), groups)
            return
        _inputs, y = self.saved.pop(key)
        g = self.pending_g.pop(key) if key in self.pending_g else self._grad_output(a)
        torch.autograd.backward(y, g)


def _check_splittable(chunk: nn.Module, a: Action) -> None:
    """Refuse a B/W split of a chunk holding both uses of a tied embedding (`fused_backward` fuses it)."""
    spec = getattr(chunk, "spec", None)
    if getattr(spec, "tie_embeddings", False) and getattr(chunk, "is_first", False) and getattr(chunk, "is_last", False):
        raise ScheduleError(f"{a}: this LLM chunk holds both uses of its tied embeddings, so its backward cannot be "
                            "split into B and W; build the stage graph with fused_backward (as "
                            "harmonia.train.rank.schedule_graph does)")


def _reducing_backwards(runners: dict[str, ModuleRunner], actions: list[Action]) -> frozenset[Action]:
    """The backwards that reduce-scatter their chunk's gradients as they run (`reduce_in_last_backward`):
    each LLM FSDP chunk's last one on this rank where it is fused (BW) and the chunk gathers once per
    step. Every LLM replica runs the same backwards (none is ever empty), so the ``dp`` ranks meet in
    the same reduce-scatters; encoder replicas may skip theirs and reduce after (`finish_fsdp_backward`)."""
    runner = runners.get(LLM)
    if runner is None or not runner.fsdp or runner.reshard:
        return frozenset()
    last: dict[int, Action] = {}
    for a in actions:
        if a.module == LLM and a.kind in (Kind.B, Kind.W, Kind.BW):
            last[a.stage] = a
    return frozenset(a for a in last.values() if a.kind is Kind.BW)


def _grad_of(rows: torch.Tensor, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradient belonging to input tensor ``rows`` (matched by identity)."""
    for x, g in zip(inputs, grads):
        if x is rows:
            return g
    raise ScheduleError("boundary rows of the LLM's first stage lost their gradient")
