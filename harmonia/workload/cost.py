"""The cost model: seconds and bytes of F, B, W per layer, stage, sample and microbatch (bytes:
`harmonia.workload.memory_cost`).

Time of a piece of work on one device is a roofline per kernel class (Williams et al. 2009): the
kernels of a layer run one after another, so their times add, and each is bound by its own
resource:

    t = max(matmul_flops / (peak * eff_matmul), weight_bytes / bw)     matmuls (weights read once)
      + attention_flops / (peak * eff_attention)                       fused attention kernels
      + elementwise_bytes / bw                                         norms, residuals, activations

with ``bw = mem_bw * eff_bw``. Matmul FLOPs are the token terms of `harmonia.workload.layers`,
attention FLOPs its pair terms, elementwise bytes the memory-bound kernels' traffic of
`harmonia.workload.kernels`. The device preset's efficiencies are published kernel rates
(`harmonia.workload.devices`). A measured calibration (`harmonia profile`, or one fitted to a
measured step) is the achieved fraction of peak of a whole block, all its kernels together: with one,
a phase takes ``max(flops / (peak * eff_measured), weight_bytes / bw)``.

Without a calibration, each layer that runs a phase also costs the host ``dispatch_s`` to dispatch
its operators in eager PyTorch, whatever its size (`DeviceSpec.dispatch_s`): on the CPU, where the
same thread runs the kernels, the phase takes ``t + n_layers * dispatch_s``; on an accelerator,
which the host feeds ahead, ``max(t, n_layers * dispatch_s)``. On a small model this is most of a
microbatch, so it decides how many microbatches (and pipeline stages, and zero-bubble B/W splits)
pay: `benchmarks/dispatch.py` measures it (0.3 ms per layer and phase on this machine's CPU, where
the kernels of a tiny layer take 8-16 us). The GPU presets price none until measured there.
A backward split into B and W (zero-bubble) costs the host more again, where it runs the kernels:
``stage_backward_input`` walks the autograd graph and keeps W's intermediates,
``stage_backward_weight`` runs a second autograd pass from them. The CPU prices what each adds per
layer (`DeviceSpec.split_backward_s`: 0.27 ms to B and 0.44 ms to W, measured by
`benchmarks/dispatch.py`'s split table, where the split took 2.4-2.8x the fused backward); the
simulator's split B and W tasks and the search's bounds add it, a fused backward does not, and
neither does a calibrated cost model, which measured the split actions whole.

Tensor parallelism divides FLOPs and weights by ``tp``; context parallelism divides tokens and pairs
by ``cp`` (balanced shards). The elementwise kernels and activations inside TP's sharded region
divide by ``tp``; the norms and residual adds, and the activations they keep, are replicated over
TP unless the cost model runs with ``sequence_parallel`` (Korthikanti et al. 2022), which splits
them over tokens (`harmonia.workload.kernels`; TP's all-reduces become reduce-scatters plus
all-gathers, the same bytes on a ring). Communication is the simulator's business (`harmonia.sim`),
not this module's.

Activation recomputation (Chen et al. 2016; Korthikanti et al. 2022, "full" recompute, as in
Megatron-LM's ``--recompute-granularity full``): a recomputed module checkpoints every transformer
block that runs a backward (``harmonia.runtime.parallelize.apply_recompute``, non-reentrant). The
forward keeps only each block's input, ``tokens x hidden`` elements per block (replicated over TP
without sequence parallelism, so divided by ``cp`` only; by ``tp x cp`` with it), instead of the block's
``act_elems_tok``; the backward of each such block first runs the block's forward again, so a
stage's B grows by exactly the F of those blocks (``B' = B + F_blocks``; W is unchanged, the
front end, post layer, head and projector are not checkpointed). While one block runs its
backward its full activations exist again (the transients: `harmonia.workload.memory_cost`).
Partial recompute (``recompute`` a share ``f`` in (0, 1), Megatron-LM's ``--recompute-method block
--recompute-num-layers``): only the first ``ceil(f x n)`` of a stage's ``n`` blocks with a backward
recompute; the others keep their activations.

"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from harmonia.model.spec import MLLMSpec
from harmonia.workload.calibration import PHASES, Calibration
from harmonia.workload.devices import DeviceSpec
from harmonia.workload.kernels import elementwise_elems, replicated_activation_elems
from harmonia.workload.layers import LayerCost, module_layers
from harmonia.workload.memory_cost import MemoryCosts
from harmonia.workload.shapes import SampleShape
from harmonia.workload.work import ModuleLoad, load_arrays, sample_loads

UNIT_CACHE = 1 << 16
"""Most `CostModel.unit_cost` results one cost model keeps (about 25 MB)."""


@dataclass(frozen=True, slots=True)
class PhaseTimes:
    """Seconds of forward, input-gradient and weight-gradient work."""

    F: float = 0.0
    B: float = 0.0
    W: float = 0.0

    @property
    def total(self) -> float:
        return self.F + self.B + self.W

    def __add__(self, other: PhaseTimes) -> PhaseTimes:
        return PhaseTimes(self.F + other.F, self.B + other.B, self.W + other.W)


def _phase_seconds(rates: tuple, tokens: float, pairs: float, win: float) -> tuple[float, float, float]:
    """F, B, W seconds of a load at a range's kernel rates (`CostModel._per_unit_seconds`): the
    phase sums of `CostModel.kernel_seconds`, added as `CostModel.stage_times` adds them."""
    weight_s, per_phase = rates
    return tuple(0.0 if tok == 0.0 and pair == 0.0 and window == 0.0
                 else max(tok * tokens, weight_s) + (pair * pairs + window * win) + elem * tokens
                 for tok, pair, window, elem in per_phase)


def _phase_arrays(rates: tuple, tokens: np.ndarray, pairs: np.ndarray, win: np.ndarray) -> tuple[np.ndarray, ...]:
    """`_phase_seconds` of many loads at once (arrays of their tokens, pairs and windowed pairs):
    the same operations in the same order, so the same numbers."""
    weight_s, per_phase = rates
    return tuple(np.zeros_like(tokens) if tok == 0.0 and pair == 0.0 and window == 0.0
                 else np.maximum(tok * tokens, weight_s) + (pair * pairs + window * win) + elem * tokens
                 for tok, pair, window, elem in per_phase)


class CostModel(MemoryCosts):
    """Analytic, frozen-aware cost of an MLLM on one device kind.

    Args:
        mllm: the model spec with training modes.
        device: the device the work runs on.
        calibration: measured per-phase whole-block efficiencies replacing the device's kernel rates.
        act_bytes: bytes per activation element (2 for bf16, 4 for fp32); None = what the device
            computes in (`weight_bytes`: 2 under mixed precision, 4 otherwise).
        sequence_parallel: TP splits the norms, residual adds and the activations they keep over
            tokens (Megatron-LM's ``--sequence-parallel``); without it they are replicated on every
            TP rank, as harmonia's runtime runs TP.
        fsdp_per_microbatch: FSDP gathers weights before every forward and backward and shards
            every state (ZeRO-3, FSDP2's default); without it, as harmonia's runtime runs FSDP,
            weights are gathered once per step and kept with their gradients until the step's
            reduce-scatter (module docstring).
    """

    def __init__(self, mllm: MLLMSpec, device: DeviceSpec, calibration: Calibration | None = None,
                 act_bytes: int | None = None, sequence_parallel: bool = False,
                 fsdp_per_microbatch: bool = False) -> None:
        self.mllm = mllm
        self.device = device
        self.calibration = calibration
        self.act_bytes = self.weight_bytes if act_bytes is None else act_bytes
        self.sequence_parallel = sequence_parallel
        self.fsdp_per_microbatch = fsdp_per_microbatch
        self.layers: dict[str, list[LayerCost]] = module_layers(mllm)
        self.modules: list[str] = mllm.module_names
        self._coef = {m: self._coefficients(m, 0, len(self.layers[m])) for m in self.modules}
        self._elem = {m: self._elementwise(m, 0, len(self.layers[m])) for m in self.modules}
        self._ranges: dict[tuple[str, int, int], tuple[np.ndarray, int, float]] = {}
        self._forms: dict[tuple, tuple] = {}  # `_unit_form` per range, degrees and recompute
        self._counts: dict[tuple[str, int | None, int | None], tuple[int, int]] = {}  # `param_count` per range
        self._kernels: dict[tuple[str, int, int], tuple[np.ndarray, float]] = {}
        self._rates: dict[tuple[str, int, int, int, int], tuple] = {}  # `_per_unit_seconds` per range and degrees
        self._units: dict[tuple, tuple[PhaseTimes, float, float, float]] = {}  # `unit_cost` per arguments
        self._blocks: dict[tuple[str, int, int], tuple[int, int, float, float]] = {}
        self._flat: dict[tuple[str, int, int], tuple[float, ...]] = {}  # FLOP coefficients as floats
        self._loads: dict[SampleShape, dict[str, ModuleLoad]] = {}
        self._largest: dict[tuple, float] = {}  # a range's largest transient block's bytes per token
        self._dispatches: dict[tuple, tuple[int, int, int]] = {}  # layers running F, B, W per range

    def _range(self, module: str, start: int, stop: int | None) -> tuple[np.ndarray, int, float]:
        """Per-layer sums over layers [start, stop) of ``module``, computed once per range: FLOP
        coefficients, parameters and activation elements kept per token."""
        stop = len(self.layers[module]) if stop is None else stop
        key = (module, start, stop)
        if key not in self._ranges:
            layers = self.layers[module][start:stop]
            self._ranges[key] = (self._coefficients(module, start, stop), sum(x.params for x in layers),
                                 sum(x.act_elems_tok for x in layers))
        return self._ranges[key]

    def _backward_blocks(self, module: str, start: int, stop: int | None) -> tuple[int, int, float, float]:
        """The blocks of layers [start, stop) that recompute: ``(lo, hi, n, act)``, the layer range
        [lo, hi) from the first to the last block running a backward (B or W), their count, and
        the largest activation elements per token one of them keeps without recompute. Blocks with
        a backward are contiguous: everything downstream of a trainable weight needs B."""
        stop = len(self.layers[module]) if stop is None else stop
        key = (module, start, stop)
        if key not in self._blocks:
            idx = [i for i in range(start, stop) if self.layers[module][i].kind == "block"
                   and (self.layers[module][i].needs_b or self.layers[module][i].needs_w)]
            self._blocks[key] = ((idx[0], idx[-1] + 1, float(len(idx)),
                                  max(self.layers[module][i].act_elems_tok for i in idx)) if idx
                                 else (start, start, 0.0, 0.0))
        return self._blocks[key]

    def _recomputed_blocks(self, module: str, start: int, stop: int | None,
                           share: float) -> tuple[int, int, int]:
        """The blocks of layers [start, stop) that recompute under a share ``share`` in [0, 1]:
        ``(lo, hi, n)``, the first ``ceil(share x n_backward)`` blocks with a backward."""
        lo, hi, n, _ = self._backward_blocks(module, start, stop)
        k = min(int(n), math.ceil(share * n - 1e-9)) if share > 0 else 0
        return lo, lo + k, k

    def _kernel_range(self, module: str, start: int, stop: int) -> tuple[np.ndarray, float]:
        """Per-layer sums over layers [start, stop): elementwise elements per token (3 phases x
        (TP-sharded, replicated)) and activation elements per token replicated over TP."""
        key = (module, start, stop)
        if key not in self._kernels:
            layers = self.layers[module][start:stop]
            self._kernels[key] = (self._elementwise(module, start, stop),
                                  sum(replicated_activation_elems(self.mllm, module, x) for x in layers))
        return self._kernels[key]

    def _elementwise(self, module: str, start: int, stop: int) -> np.ndarray:
        out = np.zeros((3, 2))
        for layer in self.layers[module][start:stop]:
            out += elementwise_elems(self.mllm, module, layer)
        return out

    def _sp(self, tp: int) -> int:
        """What divides TP-replicated work and activations: ``tp`` with sequence parallelism, else 1."""
        return tp if self.sequence_parallel else 1

    def hidden(self, module: str) -> int:
        """Width of a module's transformer blocks (the LLM's or an encoder's body)."""
        return self.mllm.llm.body.hidden if module == "llm" else self.mllm.encoders[module].body.hidden

    # ---- FLOPs -------------------------------------------------------------------------------
    def _coefficients(self, module: str, start: int, stop: int) -> np.ndarray:
        """(3 phases, 3 loads) FLOP coefficients of layers [start, stop) of ``module``; loads are
        tokens, pairs and the pairs of sliding-window blocks (`ModuleLoad.windowed_pairs`)."""
        c = np.zeros((3, 3))
        for layer in self.layers[module][start:stop]:
            pair = 2 if layer.windowed else 1
            c[:, 0] += [layer.f_tok, layer.b_tok, layer.w_tok]
            c[:2, pair] += [layer.f_pair, layer.b_pair]
        return c

    def flops(self, module: str, load: ModuleLoad, start: int = 0, stop: int | None = None) -> np.ndarray:
        """F, B, W FLOPs (shape (3,)) of layers [start, stop) of ``module`` for a load."""
        return np.array(self.phase_flops(module, load, start, stop))

    def phase_flops(self, module: str, load: ModuleLoad, start: int = 0,
                    stop: int | None = None) -> tuple[float, float, float]:
        """`flops` as plain floats (the simulator asks this per stage and microbatch)."""
        f_tok, f_pair, f_win, b_tok, b_pair, b_win, w_tok, _, _ = self._flop_factors(module, start, stop)
        tokens, pairs, win = float(load.tokens), float(load.pairs), float(load.windowed_pairs)
        return (f_tok * tokens + f_pair * pairs + f_win * win, b_tok * tokens + b_pair * pairs + b_win * win,
                w_tok * tokens)

    def _flop_factors(self, module: str, start: int, stop: int | None) -> tuple[float, ...]:
        """`_coefficients` of layers [start, stop) as plain floats, kept per range."""
        key = (module, start, len(self.layers[module]) if stop is None else stop)
        coef = self._flat.get(key)
        if coef is None:
            coef = self._flat[key] = tuple(float(x) for x in self._range(module, start, stop)[0].ravel())
        return coef

    def efficiency(self, phase: str) -> float:
        """The matmul rate of a phase as a fraction of peak: the calibration's measured whole-block
        efficiency when it has the phase, else the device's matmul efficiency."""
        if self.calibration and phase in self.calibration.flops_efficiency:
            return self.calibration.flops_efficiency[phase]
        return self.device.flops_efficiency

    def _measured(self, phase: str) -> float | None:
        """The calibration's whole-block efficiency of a phase, None when it has none."""
        if self.calibration and phase in self.calibration.flops_efficiency:
            return self.calibration.flops_efficiency[phase]
        return None

    def unit_cost(self, module: str, load: ModuleLoad, start: int, stop: int, tp: int = 1, cp: int = 1,
                  recompute: float = 0.0, proj_load: ModuleLoad | None = None) -> tuple[PhaseTimes, float, float, float, float]:
        """One microbatch's ``load`` through layers [start, stop) of ``module`` on one rank of a TP x CP
        group, and its projector's ``proj_load`` after them where given: (F, B, W seconds, FLOPs of the
        whole group, kept activation bytes, bytes its backward holds beyond them while a block runs
        it (`backward_transient_bytes`), bytes its forward holds beyond them (`forward_transient_bytes`)).

        Kept per arguments: every candidate layout's stage work asks for the same loads again.
        """
        # the loads' fields, not the loads: a frozen dataclass hashes in Python, a tuple of ints in C
        key = (module, load.tokens, load.pairs, load.sequences, load.window_pairs, start, stop, tp, cp, recompute,
               None if proj_load is None else (proj_load.tokens, proj_load.pairs, proj_load.sequences,
                                               proj_load.window_pairs))
        found = self._units.get(key)
        if found is not None:
            return found
        if self.calibration is None:
            times, flops, act, transient = self._uncalibrated_unit(module, load, start, stop, tp, cp, recompute)
        else:
            times = self.stage_times(module, load, start, stop, tp, cp, recompute)
            flops = sum(self.phase_flops(module, load, start, stop))
            act = self.activation_bytes(module, load.tokens, start, stop, tp, cp, recompute)
            transient = self.backward_transient_bytes(module, load.tokens, start, stop, tp, cp, recompute)
        f_transient = self.forward_transient_bytes(module, load.tokens, start, stop, tp, cp)
        if proj_load is not None:
            proj = f"{module}_proj"
            times = times + self.stage_times(proj, proj_load, cp=cp)  # whole on every TP rank
            flops += sum(self.phase_flops(proj, proj_load))
            act += self.activation_bytes(proj, proj_load.tokens, cp=cp)
        if self.calibration is None and self.device.dispatch_s:
            times = self._dispatched(times, module, start, stop, proj_load is not None)
        if len(self._units) >= UNIT_CACHE:
            self._units.clear()
        self._units[key] = (times, flops, act, transient, f_transient)
        return self._units[key]

    def unit_costs(self, module: str, loads: list[ModuleLoad], start: int, stop: int, tp: int = 1, cp: int = 1,
                   recompute: float = 0.0) -> list[tuple[PhaseTimes, float, float, float, float]]:
        """`unit_cost` of each of ``loads`` (no projector): the same numbers, computed for all of
        them in one vectorised pass where no calibration prices them (a search prices the units of
        hundreds of LLM replicas at once)."""
        if self.calibration is not None or len(loads) < 8:
            return [self.unit_cost(module, load, start, stop, tp, cp, recompute) for load in loads]
        f, b, w, flops, act, transient, f_transient = self._unit_arrays(module, loads, start, stop, tp, cp, recompute)
        return [(PhaseTimes(fi, bi, wi), fl, a, t, ft) for fi, bi, wi, fl, a, t, ft in
                zip(f.tolist(), b.tolist(), w.tolist(), flops.tolist(), act.tolist(), transient.tolist(),
                    f_transient.tolist())]

    def unit_times(self, module: str, loads: list[ModuleLoad], start: int, stop: int, tp: int = 1, cp: int = 1,
                   recompute: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(n_loads,) F, B and W seconds of each of ``loads`` as `unit_costs` gives them (the same
        floats), as arrays: the times of many units without an object per unit."""
        if self.calibration is not None or len(loads) < 8:
            times = [self.unit_cost(module, load, start, stop, tp, cp, recompute)[0] for load in loads]
            return tuple(np.array([getattr(t, phase) for t in times], dtype=float) for phase in "FBW")
        return self._unit_arrays(module, loads, start, stop, tp, cp, recompute)[:3]

    def _unit_arrays(self, module: str, loads: list[ModuleLoad], start: int, stop: int, tp: int, cp: int,
                     recompute: float) -> tuple[np.ndarray, ...]:
        """F, B, W seconds, FLOPs, kept bytes, backward and forward transient bytes of ``loads`` (no
        projector, no calibration), one array each."""
        tokens = np.array([load.tokens for load in loads], dtype=float)
        pairs = np.array([load.pairs for load in loads], dtype=float)
        win = np.array([load.windowed_pairs for load in loads], dtype=float)
        f, b, w, flops, act, transient = self._unit_terms(_phase_arrays, module, tokens, pairs, win, start, stop, tp,
                                                          cp, recompute)
        f_transient = self.forward_transient_bytes(module, 1, start, stop, tp, cp) * tokens
        if self.device.dispatch_s:
            f, b, w = self._dispatched_arrays((f, b, w), module, start, stop)
        return f, b, w, flops, act, transient, f_transient

    def _dispatched_arrays(self, times: tuple[np.ndarray, ...], module: str, start: int,
                           stop: int) -> tuple[np.ndarray, ...]:
        """`_dispatched` of many units' phases at once (no projector)."""
        counts = self._phase_layers(module, start, stop, False)
        d, on_host = self.device.dispatch_s, self.device.kernels_on_host
        return tuple(np.where(t > 0, t + n * d if on_host else np.maximum(t, n * d), t)
                     for t, n in zip(times, counts))

    def _dispatched(self, times: PhaseTimes, module: str, start: int, stop: int, projector: bool) -> PhaseTimes:
        """``times`` with each phase's operator dispatch (`DeviceSpec.dispatch_s` per layer that runs
        the phase; the projector's layers too where it follows): added where the host runs the
        kernels, the longer of the two where it dispatches ahead of an accelerator. A calibration
        measures whole actions, dispatch included, so it is priced only without one."""
        counts = self._phase_layers(module, start, stop, projector)
        d, on_host = self.device.dispatch_s, self.device.kernels_on_host
        return PhaseTimes(*((t + n * d if on_host else max(t, n * d)) if t > 0 else t
                            for t, n in zip((times.F, times.B, times.W), counts)))

    def _phase_layers(self, module: str, start: int, stop: int, projector: bool) -> tuple[int, int, int]:
        """How many of layers [start, stop) (and the projector's, where it follows) run F, B and W,
        kept per range."""
        key = (module, start, stop, projector)
        counts = self._dispatches.get(key)
        if counts is None:
            layers = self.layers[module][start:stop] + (self.layers[f"{module}_proj"] if projector else [])
            counts = self._dispatches[key] = (len(layers), sum(x.needs_b for x in layers),
                                              sum(x.needs_w for x in layers))
        return counts

    def split_backward_extra(self, module: str, start: int, stop: int) -> tuple[float, float]:
        """Seconds a backward of layers [start, stop) split into B and W adds to B and to W beyond their
        fused price: `DeviceSpec.split_backward_s` per layer running the phase (0 under a
        calibration, which measures the split actions whole)."""
        s_b, s_w = self.device.split_backward_s
        if self.calibration is not None or not (s_b or s_w):
            return 0.0, 0.0
        _, n_b, n_w = self._phase_layers(module, start, stop, False)
        return n_b * s_b, n_w * s_w

    def _uncalibrated_unit(self, module: str, load: ModuleLoad, start: int, stop: int, tp: int, cp: int,
                           recompute: float) -> tuple[PhaseTimes, float, float, float]:
        """`unit_cost` without a projector or calibration from the range's factors, kept per
        (range, degrees, recompute): the same operations, in the same order, as `stage_times`,
        `phase_flops`, `activation_bytes` and `backward_transient_bytes` (search asks for
        hundreds of thousands of units)."""
        f, b, w, flops, act, transient = self._unit_terms(_phase_seconds, module, float(load.tokens), float(load.pairs),
                                                          float(load.windowed_pairs), start, stop, tp, cp, recompute)
        return PhaseTimes(f, b, w), flops, act, transient

    def _unit_terms(self, phases, module: str, tokens, pairs, win, start: int, stop: int, tp: int, cp: int,
                    recompute: float) -> tuple:
        """F, B, W seconds, FLOPs, kept bytes and backward transient bytes of loads (floats, or arrays
        of many loads' with ``phases`` = `_phase_arrays`) from the range's factors (`_unit_form`,
        kept per range, degrees and recompute): one expression for both, so the same numbers."""
        key = (module, start, stop, tp, cp, recompute)
        form = self._forms.get(key)
        if form is None:
            form = self._forms[key] = self._unit_form(module, start, stop, tp, cp, recompute)
        rates, again_rates, flop_coef, kept, recomputed, inputs, largest = form
        f, b, w = phases(rates, tokens, pairs, win)
        if again_rates is not None:
            b = b + phases(again_rates, tokens, pairs, win)[0]
        f_tok, f_pair, f_win, b_tok, b_pair, b_win, w_tok, _, _ = flop_coef
        flops = (f_tok * tokens + f_pair * pairs + f_win * win) + (b_tok * tokens + b_pair * pairs + b_win * win) \
            + w_tok * tokens
        zero = tokens * 0.0
        act = kept * tokens * self.act_bytes / cp if kept is not None else zero
        if recomputed is not None:
            gone = recomputed * tokens * self.act_bytes / cp if recomputed else 0.0
            act = act - gone + inputs * tokens * self.act_bytes / (cp * self._sp(tp))
        transient = largest * tokens if largest else zero
        return f, b, w, flops, act, transient

    def _unit_form(self, module: str, start: int, stop: int, tp: int, cp: int, recompute: float) -> tuple:
        """The factors `_uncalibrated_unit` multiplies a load by: the range's kernel rates and
        (recompute) its recomputed blocks', FLOP coefficients, kept activation elements per token
        (`_kept_bytes` before tokens), the recomputed blocks' and their inputs' (``n x hidden``),
        and the backward's transient bytes per token (`backward_transient_bytes`)."""
        rates = self._kernel_rates(module, start, stop, tp, cp)
        flop_coef = self._flop_factors(module, start, stop)
        kept = self._kept_factor(module, start, stop, tp) if start < stop else None
        again_rates = recomputed = inputs = None
        largest = self.backward_transient_bytes(module, 1, start, stop, tp, cp, recompute)
        if recompute:
            lo, hi, n = self._recomputed_blocks(module, start, stop, float(recompute))
            if n:
                again_rates = self._kernel_rates(module, lo, hi, tp, cp)
            recomputed = self._kept_factor(module, lo, hi, tp) if lo < hi else 0.0
            inputs = n * self.hidden(module)
        return rates, again_rates, flop_coef, kept, recomputed, inputs, largest

    def _kept_factor(self, module: str, start: int, stop: int, tp: int) -> float:
        """`_kept_bytes` of layers [start, stop) before its ``x tokens x act_bytes / cp``."""
        kept = self._range(module, start, stop)[2]
        replicated = self._kernel_range(module, start, stop)[1]
        return (kept - replicated) / tp + replicated / self._sp(tp)

    # ---- time --------------------------------------------------------------------------------
    def stage_times(self, module: str, load: ModuleLoad, start: int = 0, stop: int | None = None,
                    tp: int = 1, cp: int = 1, recompute: float = 0.0) -> PhaseTimes:
        """Seconds of F, B, W for layers [start, stop) of ``module`` on one rank of a TP x CP group.

        Each phase adds its kernel classes' rooflines (module docstring): matmuls at the matmul
        rate or reading the weights at memory bandwidth, whichever is slower; attention at the
        attention rate; the elementwise kernels' bytes at memory bandwidth. With a calibration, the
        phase's FLOPs run at its measured whole-block rate instead. With ``recompute`` (a share of
        the blocks, True = all) B also runs the forward of the recomputed blocks again (module
        docstring): ``B + F`` of those blocks.
        """
        stop = len(self.layers[module]) if stop is None else stop
        if recompute:
            plain = self.stage_times(module, load, start, stop, tp, cp)
            lo, hi, n = self._recomputed_blocks(module, start, stop, float(recompute))
            again = self.stage_times(module, load, lo, hi, tp, cp).F if n else 0.0
            return PhaseTimes(plain.F, plain.B + again, plain.W)
        seconds = self.kernel_seconds(module, load, start, stop, tp, cp)
        if self.calibration is None:
            return PhaseTimes(*(float(sum(row)) for row in seconds))
        times = []
        for p, phase in enumerate(PHASES):
            measured = self._measured(phase)
            flops = sum(self._split_flops(module, load, start, stop, tp, cp)[p])
            if measured is None or not flops:
                times.append(float(sum(seconds[p])))
            else:
                times.append(float(max(flops / (self.device.peak_flops * measured),
                                       self._weight_seconds(module, start, stop, tp))))
        return PhaseTimes(*times)

    def kernel_seconds(self, module: str, load: ModuleLoad, start: int = 0, stop: int | None = None,
                       tp: int = 1, cp: int = 1) -> tuple[tuple[float, float, float], ...]:
        """Seconds of each kernel class of layers [start, stop) on one rank of a TP x CP group at the
        device's rates, without calibration or recompute (module docstring).

        Returns:
            per phase F, B, W: (matmuls, at least the weights' read time in a phase that runs any;
            attention; elementwise kernels).
        """
        weight_s, per_phase = self._kernel_rates(module, start, stop, tp, cp)
        tokens, pairs, win = float(load.tokens), float(load.pairs), float(load.windowed_pairs)
        out = []
        for tok, pair, window, elem in per_phase:
            if tok == 0.0 and pair == 0.0 and window == 0.0:
                out.append((0.0, 0.0, 0.0))
            else:
                out.append((max(tok * tokens, weight_s), pair * pairs + window * win, elem * tokens))
        return tuple(out)

    def _kernel_rates(self, module: str, start: int, stop: int | None, tp: int, cp: int) -> tuple:
        """`_per_unit_seconds` of layers [start, stop), kept per range and degrees."""
        key = (module, start, len(self.layers[module]) if stop is None else stop, tp, cp)
        rates = self._rates.get(key)
        if rates is None:
            rates = self._rates[key] = self._per_unit_seconds(module, *key[1:])
        return rates

    def _per_unit_seconds(self, module: str, start: int, stop: int, tp: int, cp: int) -> tuple:
        """Seconds per token, pair and windowed pair of each phase's matmuls, attention and
        elementwise kernels for layers [start, stop) on one rank of a TP x CP group, and the
        weights' read time: the factors `kernel_seconds` multiplies by a load, as plain floats."""
        peak, bw = self.device.peak_flops, self.device.mem_bw * self.device.bw_efficiency
        coef = self._range(module, start, stop)[0]
        elem = self._kernel_range(module, start, stop)[0]
        matmul, attention = peak * self.device.flops_efficiency * tp * cp, peak * self.device.attention_efficiency * tp * cp
        per_phase = tuple(
            (float(coef[p, 0]) / matmul, float(coef[p, 1]) / attention, float(coef[p, 2]) / attention,
             float(elem[p, 0] / tp + elem[p, 1] / self._sp(tp)) * self.act_bytes / (cp * bw))
            for p in range(3))
        return self._weight_seconds(module, start, stop, tp), per_phase

    def _split_flops(self, module: str, load: ModuleLoad, start: int, stop: int, tp: int,
                     cp: int) -> list[tuple[float, float]]:
        """Per phase, (matmul, attention) FLOPs of layers [start, stop) on one rank of a TP x CP group."""
        coef = self._range(module, start, stop)[0]
        tokens, pairs, win = float(load.tokens), float(load.pairs), float(load.windowed_pairs)
        return [(coef[p, 0] * tokens / (tp * cp), (coef[p, 1] * pairs + coef[p, 2] * win) / (tp * cp))
                for p in range(3)]

    def _weight_seconds(self, module: str, start: int, stop: int, tp: int) -> float:
        """Reading a TP shard of the layers' bf16 weights once at memory bandwidth."""
        params = self._range(module, start, stop)[1]
        return params * self.weight_bytes / tp / (self.device.mem_bw * self.device.bw_efficiency)

    def module_times(self, module: str, load: ModuleLoad, tp: int = 1, cp: int = 1) -> PhaseTimes:
        return self.stage_times(module, load, 0, None, tp, cp)

    def sample_costs(self, samples: list[SampleShape], phases: str = "FBW") -> np.ndarray:
        """Per-module work of each sample in seconds on one device (the cost model's compute terms).

        Returns:
            array (n_samples, n_modules) in ``self.modules`` order: the sum over ``phases`` of
            matmul FLOPs at the matmul rate, attention FLOPs at the attention rate and elementwise
            bytes at memory bandwidth (with a calibration, all FLOPs at its measured rate), without
            the weight-read bound. Additive over samples, as the balancer needs.
        """
        tokens, pairs = load_arrays(samples, self.mllm)
        return self.costs_from_loads(tokens, pairs, phases)

    def costs_from_loads(self, tokens: np.ndarray, pairs: np.ndarray, phases: str = "FBW") -> np.ndarray:
        """`sample_costs` from precomputed ``(tokens, pairs)`` arrays of shape (n, n_modules)
        (`harmonia.workload.work.load_arrays`: pairs averaged over the blocks, so every block,
        sliding-window or not, counts the same pairs here)."""
        out = np.zeros(tokens.shape, dtype=float)
        peak, bw = self.device.peak_flops, self.device.mem_bw * self.device.bw_efficiency
        for j, module in enumerate(self.modules):
            for p, phase in enumerate(PHASES):
                if phase not in phases:
                    continue
                c = self._coef[module][p]
                measured = self._measured(phase)
                if measured is not None:
                    out[:, j] += (c[0] * tokens[:, j] + (c[1] + c[2]) * pairs[:, j]) / (peak * measured)
                    continue
                per_token = (c[0] / (peak * self.device.flops_efficiency)
                             + self._elem[module][p].sum() * self.act_bytes / bw)
                per_pair = (c[1] + c[2]) / (peak * self.device.attention_efficiency)
                out[:, j] += per_token * tokens[:, j] + per_pair * pairs[:, j]
        return out

    def sample_loads(self, sample: SampleShape) -> dict[str, ModuleLoad]:
        """`harmonia.workload.work.sample_loads` of this model, computed once per distinct sample
        (the simulator and the planner ask it for the same samples under every candidate)."""
        loads = self._loads.get(sample)
        if loads is None:
            loads = self._loads[sample] = sample_loads(sample, self.mllm)
        return loads

    def model_flops(self, samples: list[SampleShape]) -> float:
        """Useful FLOPs (F + B + W, all modules) of a set of samples, for MFU."""
        total = 0.0
        for s in samples:
            for module, load in self.sample_loads(s).items():
                total += float(self.flops(module, load).sum())
        return total

    def reshards(self, layout) -> bool:
        """Whether an FSDP layout gathers and frees its weights around every forward and backward:
        laid out ``fsdp reshard``, or every FSDP layout under ``fsdp_per_microbatch``."""
        return layout.sharded and (layout.reshard or self.fsdp_per_microbatch)

    def needs_backward(self, module: str) -> bool:
        """Whether any layer of the module runs B or W."""
        return any(x.needs_b or x.needs_w for x in self.layers[module])
