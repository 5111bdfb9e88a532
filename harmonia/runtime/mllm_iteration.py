"""One iteration of the whole-MLLM executor on one rank (`harmonia.runtime.mllm_executor`): the
tensors in flight between its actions, keyed by (module, chunk, microbatch, sub), and each action's
work: encoder and LLM stage forwards and backwards (fused, or split into B and W), the boundary's
item rows in and their gradients back, stage messages, the loss."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from harmonia.errors import LayoutError, ScheduleError
from harmonia.model.attention import PackedAttention
from harmonia.model.llm import lm_loss
from harmonia.model.mllm import project_items, run_encoder
from harmonia.runtime.action_timer import ActionTimer
from harmonia.runtime.boundary_link import BoundaryLink
from harmonia.runtime.context_parallel import CPShard, build_cp_shard
from harmonia.runtime.grads import reduce_in_last_backward
from harmonia.runtime.message_program import plan_iteration_messages, stage_key
from harmonia.runtime.messenger import Messenger
from harmonia.runtime.mllm_inputs import RankBatch
from harmonia.schedule.actions import Action, Kind, StageRef
from harmonia.schedule.graph import LLM, IterationSchedule, StageGraph

Key = tuple[str, int, int, int]  # (module, chunk, microbatch, sub)


class MLLMIteration:
    """Tensors in flight during one iteration on one rank, keyed by (module, chunk, microbatch, sub)."""

    def __init__(self, ex, schedule: IterationSchedule, batch: RankBatch,
                 reducing: frozenset[Action] = frozenset()) -> None:
        """``ex``: the `harmonia.runtime.mllm_executor.MLLMExecutor` running it (not imported here: it
        imports this module); ``reducing``: the backwards that reduce-scatter their chunk's gradients
        (its ``_reducing_backwards``)."""
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
        self.timer = ActionTimer.for_device(ex.action_times, ex.device)  # compute actions into ex.action_times
        order = batch.messages or plan_iteration_messages(ex.meshes.layouts, schedule, batch.plans, ex.rank)
        self.messenger = Messenger(order, ex.rank)
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
                                             back, self.messenger, e, ex.wire_dtype, ex.device)


    # -- driving the actions ------------------------------------------------------------------------
    def execute(self, actions: list[Action]) -> None:
        """Run this rank's action list, in order; each receive is posted where the iteration's message
        order puts it (`harmonia.runtime.messenger`), so data flows early and both ends agree."""
        self._expect_stage_messages(actions)
        handlers = {Kind.F: self.forward, Kind.B: self.backward_input, Kind.W: self.backward_weight,
                    Kind.BW: self.backward, Kind.SEND_F: self.send, Kind.SEND_B: self.send,
                    Kind.RECV_F: self.receive, Kind.RECV_B: self.receive, Kind.REDUCE: self.reduce}
        self.ex.executed = []
        for a in actions:
            self.messenger.post_ready()
            self.ex.executed.append(a)
            if self.ex.action_times is None or not a.kind.is_compute:
                handlers[a.kind](a)
            else:
                mark = self.timer.start()
                handlers[a.kind](a)
                self.timer.stop(a, mark)
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

    def _expect_stage_messages(self, actions: list[Action]) -> None:
        """Tell the messenger how each stage message this rank receives lands, and which messages
        neither end issues (units without data on this replica)."""
        for a in actions:
            if a.peer is not None or not (a.kind.is_send or a.kind.is_recv):
                continue
            key = stage_key(a, self.ex.rank)
            if self._empty(a):
                self.messenger.skip(key)
            elif a.kind.is_recv:
                shape, dtype, device = self._message_shape(a), self.ex.wire_dtype, self.ex.device
                self.messenger.expect(key, self.ex.runners[a.module].mesh.group,
                                      lambda shape=shape: torch.empty(shape, dtype=dtype, device=device))

    def _message_shape(self, a: Action) -> tuple[int, ...]:
        """The shape of a stage message this rank receives, from the iteration's data (no header): the
        LLM's ``(1, t, hidden)`` from this rank's token count of the microbatch (activations and their
        gradients alike); an encoder's hidden state between its stages from the sub-microbatch's media
        (the same on both ends: they are one replica)."""
        name, c, m, _ = self._key(a)
        if name == LLM:
            mesh = self.ex.runners[LLM].mesh
            if mesh.layout.cp == 1:
                return 1, self.batch.llm[m].input_ids.shape[-1], self.ex.hidden
            return 1, int((self.batch.llm_cp[m] == mesh.coords["cp"]).sum()), self.ex.hidden
        chunk = self.ex.runners[name].chunks[c]
        block = chunk.indices.start if a.kind is Kind.RECV_F else chunk.indices.stop
        return tuple(chunk.hidden_shape(self._media(a), block))

    # -- communication ------------------------------------------------------------------------------
    def send(self, a: Action) -> None:
        """A stage message to the peer rank, or this rank's part of a boundary transfer."""
        name, c, m, s = self._key(a)
        if a.peer is None:
            if not self._empty(a):
                t = self.outbox.pop(("F" if a.kind is Kind.SEND_F else "B", (name, c, m, s)))
                self.messenger.send(stage_key(a, self.ex.rank), t.detach().to(self.ex.wire_dtype),
                                    self.ex.runners[name].mesh.group)
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
                # in the wire dtype (bf16 under mixed precision), computed on in the executor's
                self.inbox[(name, c, m, s)] = self.messenger.recv(stage_key(a, self.ex.rank)).to(self.ex.dtype)
        elif a.kind is Kind.RECV_F:  # (dst_rows, D) rows of encoder a.peer, in media.index order
            self.rows_in[(a.peer.module, m)] = self.links[a.peer.module].take(m).to(self.ex.dtype)
        else:  # (src_rows, D) gradients of this encoder's rows, cut back into its sub-microbatches
            dx = self.links[name].take(m, backward=True).to(self.ex.dtype)
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
                if shard is not None:  # this CP rank's rows, picked on the host
                    at = shard.item_rows(mb.media[e].plan_index if e in mb.media else at)[1]
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

            check_splittable(self.ex.runners[a.module].chunks[a.stage], a)
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


def check_splittable(chunk: nn.Module, a: Action) -> None:
    """Refuse a B/W split of a chunk holding both uses of a tied embedding (`fused_backward` fuses it)."""
    spec = getattr(chunk, "spec", None)
    if getattr(spec, "tie_embeddings", False) and getattr(chunk, "is_first", False) and getattr(chunk, "is_last", False):
        raise ScheduleError(f"{a}: this LLM chunk holds both uses of its tied embeddings, so its backward cannot be "
                            "split into B and W; build the stage graph with fused_backward (as "
                            "harmonia.train.rank.schedule_graph does)")


def _grad_of(rows: torch.Tensor, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradient belonging to input tensor ``rows`` (matched by identity)."""
    for x, g in zip(inputs, grads):
        if x is rows:
            return g
    raise ScheduleError("boundary rows of the LLM's first stage lost their gradient")
