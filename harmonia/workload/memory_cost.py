"""Bytes per rank (Rajbhandari et al. 2020, ZeRO, mixed-precision Adam), as harmonia's runtime holds
it (`harmonia.train.rank`). A module without FSDP keeps, per trainable weight, an fp32 weight (4 B;
autocast computes in bf16), an fp32 gradient (4 B, all-reduced over ``dp``) and Adam's two moments
(8 B): 16 B; a frozen weight is held in bf16 under mixed precision (2 B, `DeviceSpec.mixed_precision`;
`harmonia.runtime.parallelize.hold_frozen_in`), in fp32 otherwise (4 B). FSDP as the runtime runs it
(`harmonia.runtime.grads.start_fsdp_backward`, as torch.distributed.pipelining does with FSDP2)
gathers a chunk's weights once at the start of the step and keeps them (one unit's gather buffer
beside them while it copies each out: `MemoryCosts.gather_transient_bytes`), and the gradients it
accumulates over the microbatches, whole until the chunk's last backward reduce-scatters them: for
the whole step a rank holds every bf16 weight (2 B) and, per trainable one, its fp32 accumulated
gradient (4 B, FSDP2's reduce dtype), while the weight shards (4 B; a frozen one's 2 B under mixed
precision), gradient shards (4 B) and Adam moments (8 B) are divided by the shard degree: a sharded
optimizer's memory (ZeRO-1), not ZeRO-3's. It saves memory over ``dp > 1`` replicas of a trained
module (6 + 16/dp < 16) and, in fp32, over ``dp > 2`` of a frozen one (2 + 4/dp < 4); a frozen
module held in bf16 never (2 + 2/dp > 2). An LLM laid out ``fsdp reshard`` (`Layout.reshard`,
`harmonia.runtime.grads.start_fsdp_resharding`) runs FSDP2's default (ZeRO-3): every block gathers
its weights before each forward and backward and frees them after, every backward reduce-scatters
its gradients, so every state is divided by the shard degree, and while a block runs its backward
a rank holds that block's whole bf16 weights and fp32 gradients and the next block's prefetched
weights (`reshard_transient_bytes`); the simulator prices the gathers and reduce-scatters per phase
(`harmonia.sim.collectives`). ``fsdp_per_microbatch`` prices every FSDP layout that way, as
published runs gather.

A split backward (zero-bubble schedules) runs B and W as two passes over one autograd graph
(torch.distributed.pipelining's ``stage_backward_input`` keeps it, ``retain_graph``): B frees none
of the activations and adds, until W, the output gradient of every operation on a trained weight
(`MemoryCosts.wgrad_bytes`); W frees both, holding while it runs the weight gradients it makes
before adding them into the accumulated ones (`MemoryCosts.w_transient_bytes`).

The transients: while one block runs its backward its full activations exist again under
recompute (`MemoryCosts.recompute_transient_bytes`). With or without recompute, a block's backward
holds the gradients of what it kept, as many elements, while it frees what it kept
(`MemoryCosts.backward_transient_bytes`), and a block that keeps nothing (frozen, nothing upstream
trains) still holds its intermediates while its forward runs (`MemoryCosts.forward_transient_bytes`):
each phase's peak is the level it starts at plus these. The LLM head's backward holds the loss's
fp32 gradients, ``2 V`` per token over the vocabulary's TP shards, beside the log-softmax it kept
(`MemoryCosts._loss_gradient_bytes`): for a 128k vocabulary 1 MB per token, more than any block's.
"""

from __future__ import annotations

PARAM_BYTES = 2
"""A bf16 weight: what a matmul reads, what FSDP gathers and keeps whole through the step, under mixed
precision (`CostModel.weight_bytes`; fp32 without)."""
MASTER_BYTES = 4
"""An fp32 weight: a module without FSDP keeps its trained weights in fp32 (autocast computes in
bf16), FSDP its shards; frozen weights too where the device trains in fp32."""
GRAD_BYTES = 4
"""An fp32 gradient: all-reduced without FSDP, accumulated whole and reduce-scattered with it
(FSDP2's reduce dtype)."""
ADAM_BYTES = 8


class MemoryCosts:
    """The bytes half of `harmonia.workload.cost.CostModel`: states, activations and transients per
    rank, from the layer costs and range sums the cost model keeps."""

    def param_count(self, module: str, start: int = 0, stop: int | None = None) -> tuple[int, int]:
        """(all, trainable) parameters a stage of layers [start, stop) holds (kept per range: every
        candidate's memory estimate asks for its stages' counts again). A last LLM stage without the
        embedding holds its own copy of a tied embedding as its head (`harmonia.model.llm.DecoderLM`)."""
        return self._counts_of(module, start, stop)[:2]

    def replicated_count(self, module: str, start: int = 0, stop: int | None = None) -> tuple[int, int]:
        """(all, trainable) parameters of the stage that tensor parallelism keeps whole on every rank."""
        return self._counts_of(module, start, stop)[2:]

    def _counts_of(self, module: str, start: int, stop: int | None) -> tuple[int, int, int, int]:
        key = (module, start, stop)
        found = self._counts.get(key)
        if found is None:
            layers = self.layers[module][start:stop]
            found = [sum(x.params for x in layers), sum(x.trainable_params for x in layers),
                     sum(x.replicated for x in layers), sum(x.trainable_replicated for x in layers)]
            if module == "llm" and self.mllm.llm.tie_embeddings and start > 0 and \
                    (stop is None or stop >= len(self.layers[module])):
                embed = self.layers[module][0]
                found[0] += embed.params
                found[1] += embed.trainable_params
            found = self._counts[key] = tuple(found)
        return found

    def state_bytes(self, module: str, start: int = 0, stop: int | None = None, tp: int = 1,
                    fsdp_shards: int = 1, reshard: bool = False) -> float:
        """Weights, gradients and optimizer states of layers [start, stop) on one rank at the
        step's peak (module docstring): fp32 weight, gradient and Adam moments per trainable
        parameter, `frozen_bytes` per frozen one; over ``tp`` ranks each holds its share of the split
        parameters and the replicated ones whole (`replicated_count`). With FSDP over ``fsdp_shards`` ranks the bf16
        weights and fp32 accumulated gradients stay whole through the step and the rest is sharded;
        resharding per microbatch (``reshard`` or ``fsdp_per_microbatch``) everything is sharded.
        """
        total, trainable = self.param_count(module, start, stop)
        repl, trainable_repl = self.replicated_count(module, start, stop)
        total = (total - repl) / tp + repl  # what one TP rank holds
        trainable = (trainable - trainable_repl) / tp + trainable_repl
        sharded = trainable * (MASTER_BYTES + GRAD_BYTES + ADAM_BYTES) + (total - trainable) * self.frozen_bytes
        if fsdp_shards <= 1 or reshard or self.fsdp_per_microbatch:
            return sharded / fsdp_shards
        whole = total * self.weight_bytes + trainable * GRAD_BYTES
        return whole + sharded / fsdp_shards

    @property
    def weight_bytes(self) -> int:
        """Bytes a weight is computed in (what FSDP gathers, what a frozen weight is held in): bf16
        under mixed precision, fp32 otherwise."""
        return PARAM_BYTES if self.device.mixed_precision else MASTER_BYTES

    @property
    def frozen_bytes(self) -> int:
        """Bytes a frozen weight is held in: bf16 under mixed precision, fp32 otherwise."""
        return self.weight_bytes

    def fsdp_pays(self, module: str, dp: int, reshard: bool = False) -> bool:
        """Whether FSDP over ``dp`` replicas (resharding per microbatch with ``reshard``) holds less
        of ``module``'s states per rank than no FSDP (`state_bytes`)."""
        return dp > 1 and self.state_bytes(module, fsdp_shards=dp, reshard=reshard) < self.state_bytes(module)

    def reshard_transient_bytes(self, module: str, start: int = 0, stop: int | None = None, tp: int = 1) -> float:
        """What FSDP resharding per microbatch holds beyond the shards while a unit of layers
        [start, stop) runs its backward. FSDP2's units are the stage's blocks, the LLM's embedding
        and its final norm with the head, and the root, every other layer of the stage together
        (`fsdp_unit_counts`: a tied embedding, or its copy on the last stage, is the root's). A
        gather fills a flat buffer and copies it out into the unit's whole weights, so at the next
        unit's gather (prefetched) a rank holds the running unit's whole weights and the next one's
        twice: counted with the largest two units that run one after the other (the root first),
        both with their buffers, ``2 (u1 + u2)`` weights (measured at 2B: the root and a block, 1.4
        GiB of 1.5 priced), and the larger one's fp32 gradients."""
        units = [*self.fsdp_unit_counts(module, start, stop), (0, 0)]
        pairs = [(max(a, b), min(a, b)) for a, b in zip(units, units[1:])]  # ((u1, t1), (u2, t2))
        (u1, t1), (u2, _) = max(pairs, key=lambda p: p[0][0] + p[1][0])
        return (2 * (u1 + u2) * self.weight_bytes + t1 * GRAD_BYTES) / tp

    def gather_transient_bytes(self, module: str, start: int = 0, stop: int | None = None, tp: int = 1) -> float:
        """What FSDP without resharding holds beyond the whole weights it keeps while it gathers them
        (`harmonia.runtime.grads.start_fsdp_backward`): every unit's all-gather is issued at the
        step's start into a flat buffer, and each unit's pre-forward copies its buffer out into the
        unit's whole weights before freeing it, one unit at a time; so a rank holds one unit's
        weights twice, at worst the largest unit's (an untied head's, copied out as the forward ends
        with nearly all activations kept: measured at 0.5B under fsdp4, 0.11 of the 0.125 GiB head)."""
        return max(u for u, _ in self.fsdp_unit_counts(module, start, stop)) * self.weight_bytes / tp

    def fsdp_unit_counts(self, module: str, start: int = 0, stop: int | None = None) -> list[tuple[int, int]]:
        """(all, trainable) parameters of each FSDP2 unit of layers [start, stop) in the order they
        run, the root first (`harmonia.runtime.parallelize.fsdp_units`): on the LLM's last stage a
        tied embedding (the head, or the stage's copy of it) stays in the root with the final norm."""
        layers = self.layers[module][start:stop]
        kinds = {x.kind for x in layers}
        tied_here = module == "llm" and self.mllm.llm.tie_embeddings and "head" in kinds
        own = {"block"} | ({"embed", "head"} if module == "llm" and not tied_here else set())
        root = [sum(x.params for x in layers if x.kind not in own),
                sum(x.trainable_params for x in layers if x.kind not in own)]
        if tied_here and "embed" not in kinds:  # the last stage's copy of the first stage's embedding
            root[0] += self.layers[module][0].params
            root[1] += self.layers[module][0].trainable_params
        return [tuple(root)] + [(x.params, x.trainable_params) for x in layers if x.kind in own]

    def activation_bytes(self, module: str, tokens: int, start: int = 0, stop: int | None = None,
                         tp: int = 1, cp: int = 1, recompute: float = 0.0) -> float:
        """Bytes kept for backward by one microbatch of ``tokens`` through layers [start, stop).

        The activations TP shards divide by ``tp``, those it replicates (norm inputs, matmul
        inputs: `harmonia.workload.kernels`) only with sequence parallelism. With ``recompute`` (a
        share of the blocks with a backward, True = all) each recomputed block keeps only its input,
        ``tokens / cp x hidden`` elements (replicated over TP unless sequence parallel), and the
        other layers keep theirs.
        """
        stop = len(self.layers[module]) if stop is None else stop
        if not recompute:
            return self._kept_bytes(module, tokens, start, stop, tp, cp)
        lo, hi, n = self._recomputed_blocks(module, start, stop, float(recompute))
        inputs = n * self.hidden(module) * tokens * self.act_bytes / (cp * self._sp(tp))
        return (self._kept_bytes(module, tokens, start, stop, tp, cp)
                - self._kept_bytes(module, tokens, lo, hi, tp, cp) + inputs)

    def _kept_bytes(self, module: str, tokens: int, start: int, stop: int, tp: int, cp: int) -> float:
        """Activation bytes layers [start, stop) keep for backward: TP-sharded ones over ``tp x cp``,
        replicated ones over ``cp`` (and ``tp`` with sequence parallelism)."""
        if start >= stop:
            return 0.0
        kept = self._range(module, start, stop)[2]
        replicated = self._kernel_range(module, start, stop)[1]
        return ((kept - replicated) / tp + replicated / self._sp(tp)) * tokens * self.act_bytes / cp

    def recompute_transient_bytes(self, module: str, tokens: int, start: int = 0, stop: int | None = None,
                                  tp: int = 1, cp: int = 1, recompute: float = 1.0) -> float:
        """Bytes a recomputed stage holds beyond its kept activations while one block runs its
        backward: that block's recomputed activations (the largest recomputed block of layers
        [start, stop); ``recompute`` the share of blocks that recompute)."""
        lo, hi, n = self._recomputed_blocks(module, start, stop, float(recompute))
        if not n:
            return 0.0
        key = (module, lo, hi, tp, cp)  # kept bytes are linear in tokens: the largest block per token
        if key not in self._largest:
            self._largest[key] = max(self._kept_bytes(module, 1, i, i + 1, tp, cp) for i in range(lo, hi)
                                     if self.layers[module][i].kind == "block")
        return self._largest[key] * tokens

    def backward_transient_bytes(self, module: str, tokens: int, start: int = 0, stop: int | None = None,
                                 tp: int = 1, cp: int = 1, recompute: float = 0.0) -> float:
        """Bytes one microbatch's backward through layers [start, stop) holds beyond its kept
        activations while a block runs it: the gradients of what that block kept, as many elements
        as it keeps (the largest block with a backward), or under ``recompute`` its recomputed
        activations (`recompute_transient_bytes`), whichever is larger: autograd frees each kept
        (or recomputed) tensor once the gradient through it is made, so the two together stay about
        one block's activations; under TP also one reduction's result (`_tp_reduced_bytes`); where
        the range ends with the LLM head, the loss's gradients if larger (`_loss_gradient_bytes`);
        on the host, an encoder's attention call beside them (`cpu_attention_bytes`). 0 without a
        backward."""
        lo, hi, n, _ = self._backward_blocks(module, start, stop)
        if not n:
            return 0.0
        loss = self._loss_gradient_bytes(module, stop, tp, cp)
        key = ("grads", module, lo, hi, tp, cp, loss)
        if key not in self._largest:
            blocks = max(self._kept_bytes(module, 1, i, i + 1, tp, cp) for i in range(lo, hi)
                         if self.layers[module][i].kind == "block") + self._tp_reduced_bytes(module, tp, cp)
            self._largest[key] = max(blocks, loss)
        attend = ("attention", module, start, stop, tp)  # kept per range: the planner asks per unit
        if attend not in self._largest:
            self._largest[attend] = self.cpu_attention_bytes(module, start, stop, tp)
        again = self.recompute_transient_bytes(module, tokens, start, stop, tp, cp, recompute) if recompute else 0.0
        return max(self._largest[key] * tokens, again) + self._largest[attend] * tokens

    def _loss_gradient_bytes(self, module: str, stop: int | None, tp: int, cp: int) -> float:
        """Bytes per token the loss's backward holds beside the head's kept logits, where a range of
        layers ending at ``stop`` ends with the LLM head: the fp32 gradients of the log-softmax output and of the
        logits, ``2 V`` (over the vocabulary's ``tp`` shards; `harmonia.model.llm.lm_loss`). Beside
        a block's transient it is small for a small vocabulary and the largest of the step for a
        large one (``V = 128k``: 1 MB per token)."""
        layers = self.layers[module]
        stop = len(layers) if stop is None else stop
        if module != "llm" or stop < len(layers) or layers[-1].kind != "head":
            return 0.0
        return 2.0 * self.mllm.llm.vocab_size * GRAD_BYTES / (tp * cp)

    def _tp_reduced_bytes(self, module: str, tp: int, cp: int) -> float:
        """Bytes per token of one tensor-parallel reduction's result, held beside its input: DTensor
        all-reduces a block's partial sums (forward) and its input gradient (backward) out of place,
        ``hidden`` elements per token (over ``tp`` under sequence parallelism's reduce-scatter); 0
        without TP."""
        if tp <= 1:
            return 0.0
        return self.hidden(module) * self.act_bytes / (cp * self._sp(tp))

    def forward_transient_bytes(self, module: str, tokens: int, start: int = 0, stop: int | None = None,
                                tp: int = 1, cp: int = 1) -> float:
        """Bytes one microbatch's forward through layers [start, stop) holds beyond what it keeps
        while a block that keeps nothing runs (`LayerCost.work_elems_tok`: the largest such block;
        its input ``h`` replicated over TP, the rest split; 0 when every block keeps its
        activations: its intermediates are what it keeps), and on the host an encoder's attention
        call (`cpu_attention_bytes`)."""
        stop = len(self.layers[module]) if stop is None else stop
        key = ("work", module, start, stop, tp, cp)
        if key not in self._largest:
            h = self.hidden(module)
            per = [(x.work_elems_tok - h) / tp + h for x in self.layers[module][start:stop]
                   if x.kind == "block" and x.act_elems_tok == 0 and x.work_elems_tok]
            self._largest[key] = (max(per, default=0.0) * self.act_bytes / cp
                                  + self.cpu_attention_bytes(module, start, stop, tp, backward=False))
        return self._largest[key] * tokens

    def wgrad_bytes(self, module: str, tokens: int, start: int = 0, stop: int | None = None,
                    tp: int = 1, cp: int = 1) -> float:
        """Bytes a split backward keeps from B until W beside the activations of one microbatch
        through layers [start, stop): the output gradients of every operation on a trained weight
        (`harmonia.workload.layers.LayerCost.wgrad_elems_tok`), in the activations' dtype, over ``tp``
        where tensor parallelism splits them and over ``cp``."""
        stop = len(self.layers[module]) if stop is None else stop
        key = ("wgrad", module, start, stop, tp)
        if key not in self._largest:
            self._largest[key] = sum(x.wgrad_elems_tok / tp + x.wgrad_replicated_tok
                                     for x in self.layers[module][start:stop]) * self.act_bytes
        return self._largest[key] * tokens / cp

    def w_transient_bytes(self, module: str, start: int = 0, stop: int | None = None, tp: int = 1) -> float:
        """Bytes a split backward's W holds while it runs on layers [start, stop): two weight
        gradients at once, made whole before each is added into its accumulated gradient (fp32; the
        two largest trained weights, over ``tp``: `LayerCost.top_weights`)."""
        stop = len(self.layers[module]) if stop is None else stop
        key = ("w transient", module, start, stop, tp)
        if key not in self._largest:
            top = sorted((n for x in self.layers[module][start:stop] for n in x.top_weights), reverse=True)[:2]
            self._largest[key] = sum(top) * GRAD_BYTES / tp
        return self._largest[key]

    def cpu_attention_bytes(self, module: str, start: int = 0, stop: int | None = None, tp: int = 1,
                            backward: bool = True) -> float:
        """Bytes per token the host's attention kernel holds while an encoder's block of layers
        [start, stop) attends (`harmonia.model.attention._SegmentAttention`: its packed sequences of
        one length as one batch, at most every token of the microbatch in one call). The forward
        gathers the call's queries, keys and values and gets its output, ``2 nh + 2 nkv`` heads of
        ``hd`` activations, and its log-sum-exp, ``nh`` fp32; the backward gathers the output
        gradient, queries, keys, values and output and gets three gradients before writing them back,
        ``3 nh + 4 nkv`` heads and the log-sum-exp (heads over ``tp``). Only where the host runs the
        kernels (an accelerator's varlen kernel takes the sequences where they lie) and the range has
        a block; the LLM's causal samples are priced with its blocks."""
        if not self.device.kernels_on_host or module not in self.mllm.encoders:
            return 0.0
        stop = len(self.layers[module]) if stop is None else stop
        if not any(x.kind == "block" for x in self.layers[module][start:stop]):
            return 0.0
        body = self.mllm.encoders[module].body
        nh, nkv = body.n_heads / tp, body.kv_heads / tp
        heads = 3 * nh + 4 * nkv if backward else 2 * nh + 2 * nkv
        return heads * body.dim_head * self.act_bytes + nh * GRAD_BYTES

    def transient_bytes(self, module: str, tokens: int, start: int = 0, stop: int | None = None,
                        tp: int = 1, cp: int = 1, recompute: float = 0.0) -> float:
        """Bytes one microbatch holds beyond what it keeps while one block of layers [start, stop)
        runs: the larger of its backward's (`backward_transient_bytes`) and its forward's
        (`forward_transient_bytes`)."""
        return max(self.backward_transient_bytes(module, tokens, start, stop, tp, cp, recompute),
                   self.forward_transient_bytes(module, tokens, start, stop, tp, cp))
