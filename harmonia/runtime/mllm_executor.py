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
place. The executor derives nothing: it interprets the list, the same list the simulator times
(each iteration's tensors in flight and actions: `harmonia.runtime.mllm_iteration`).
Communication is asynchronous and in one order both ends of every pair derive from the action lists
(`harmonia.runtime.message_program`, `harmonia.schedule.message_order`: NCCL matches messages by
order, not by tag): the iteration's `Messenger` posts each receive where that order puts it and
issues each send at once; stage messages travel on their module's group, boundary rows through
`BoundaryLink` (one plan per microbatch and encoder); a receive action waits for its data. After
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
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from harmonia.errors import LayoutError, ScheduleError
from harmonia.runtime.grads import reduce_loss_and_clip, squared_norm_share, start_fsdp_backward, start_fsdp_resharding
from harmonia.runtime.meshes import ModuleMeshes
from harmonia.runtime.mllm_inputs import RankBatch
from harmonia.runtime.mllm_iteration import MLLMIteration
from harmonia.runtime.runner import ModuleRunner
from harmonia.schedule.actions import Action, Kind
from harmonia.schedule.graph import LLM, IterationSchedule
from harmonia.schedule.rank_actions import plan_rank_actions

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
            self.runners[name] = ModuleRunner(mesh, dict(sorted(mods.items())), projectors.get(name))
        missing = [m for m in meshes.modules() if m not in self.runners]
        if missing:
            raise LayoutError(f"rank {self.rank} runs {missing} in the plan but got no chunks for them")
        self.dtype, self.device = dtype, device
        self.wire_dtype = autocast or dtype
        """The dtype stage messages and boundary rows travel in: the compute dtype under mixed
        precision (bf16, as the cost model prices a send: ``act_bytes``), converted back to ``dtype``
        on arrival; ``dtype`` itself otherwise (fp32 jobs send exactly what they compute)."""
        self.optimizers = {n: (optimizer or default_optimizer)(r.param_groups())
                           for n, r in self.runners.items() if r.trainable}
        self.action_times: list[tuple[Action, float, float, float]] | None = None
        """When a list: every compute action run is appended with its start and end
        (``time.perf_counter``; on a GPU from CUDA events, `harmonia.runtime.action_timer`) and the CPU
        seconds this thread spent in it (``time.thread_time``)."""
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
        run = self._running = MLLMIteration(self, schedule, batch, _reducing_backwards(self.runners, actions))
        with self._vocabulary_parallel():
            run.execute(actions)
        try:
            if beside_reduction is not None:
                beside_reduction()
        finally:  # its error raised once nothing is in flight
            for r in self.runners.values():
                r.finish_reduction()
            run.messenger.finish()
        for link in run.links.values():
            link.finish()
        for r in self.runners.values():
            if r.tied is not None:
                r.tied.run()
        run.timer.resolve()  # on a GPU: one wait for the last action's event, none per action
        # TP ranks repeat the loss; CP ranks each hold the loss of their own tokens.
        counts = LLM in self.runners and self.runners[LLM].mesh.coords["tp"] == 0
        # on the host, as the caller reads it (a process group on GPUs has gloo beside NCCL for this)
        return (run.loss_sum.detach().to("cpu", torch.float64, copy=True) if counts
                else torch.zeros((), dtype=torch.float64))

    def waiting_on(self) -> str | None:
        """The message this rank waits for now, as a hang's report names it (None: none)."""
        run = getattr(self, "_running", None)
        return None if run is None else run.messenger.waiting_on()

    def norm_share(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm, over all its modules."""
        return sum((squared_norm_share(r.norm_params, r.replication) for r in self.runners.values()),
                   torch.zeros((), dtype=torch.float64))

    def optimizer_step(self) -> None:
        """One step of every module's optimizer on this rank."""
        for opt in self.optimizers.values():
            opt.step()


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
