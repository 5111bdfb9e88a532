"""The cost model: seconds and bytes of F, B, W per layer, stage, sample and microbatch.

Time of a piece of work on one device is a roofline (Williams et al. 2009):
``t = max(flops / (peak * eff_flops), bytes / (mem_bw * eff_bw))``, where ``eff_flops`` is the
device's achievable fraction, optionally replaced per phase (F, B, W) by a measured calibration
(`harmonia profile`). Tensor parallelism divides FLOPs and activation bytes by ``tp`` and weights by
``tp``; context parallelism divides tokens and pairs by ``cp`` (balanced shards). Communication is
the simulator's business (`harmonia.sim`), not this module's.

Activation recomputation (Chen et al. 2016; Korthikanti et al. 2022, "full" recompute, as in
Megatron-LM's ``--recompute-granularity full``): a recomputed module checkpoints every transformer
block that runs a backward (``harmonia.runtime.parallelize.apply_recompute``, non-reentrant). The
forward keeps only each block's input, ``tokens x hidden`` elements per block (replicated over TP,
which runs without sequence parallelism, so divided by ``cp`` only), instead of the block's
``act_elems_tok``; the backward of each such block first runs the block's forward again, so a
stage's B grows by exactly the F of those blocks (``B' = B + F_blocks``; W is unchanged, the
front end, post layer, head and projector are not checkpointed). While one block runs its
backward its full activations exist again: `recompute_transient_bytes`.

Memory per rank (Rajbhandari et al. 2020, ZeRO, mixed-precision Adam): 2 bytes per bf16 weight,
plus for each trainable weight 2 bytes of gradient and 12 bytes of fp32 master weight and Adam
moments (K = 12), the 14 trainable bytes divided by the FSDP shard degree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harmonia.errors import ConfigError
from harmonia.model.spec import MLLMSpec
from harmonia.workload.devices import DeviceSpec
from harmonia.workload.layers import LayerCost, module_layers
from harmonia.workload.shapes import SampleShape
from harmonia.workload.work import ModuleLoad, load_arrays, sample_loads

PHASES = ("F", "B", "W")
PARAM_BYTES = 2
GRAD_BYTES = 2
OPTIMIZER_BYTES = 12


@dataclass(frozen=True)
class Calibration:
    """Measured efficiency factors: achieved fraction of ``peak_flops`` per phase.

    Attributes:
        device: device name the numbers were measured on.
        flops_efficiency: phase -> achieved fraction of peak.
        measurements: raw rows (layer, tokens, phase, seconds, flops) for reference.
    """

    device: str
    flops_efficiency: dict[str, float]
    measurements: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.flops_efficiency.items() if k not in PHASES or not 0 < v <= 1.5}
        if bad:
            raise ConfigError(
                f"calibration for {self.device!r}: efficiencies {bad} invalid; expected phases "
                f"{PHASES} with values in (0, 1.5]"
            )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(
            {"device": self.device, "flops_efficiency": self.flops_efficiency,
             "measurements": self.measurements}, indent=1))

    @staticmethod
    def load(path: str | Path) -> Calibration:
        try:
            raw = json.loads(Path(path).read_text())
            return Calibration(raw["device"], dict(raw["flops_efficiency"]), list(raw.get("measurements", [])))
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as err:
            raise ConfigError(
                f"calibration file {path}: {err}; expected JSON written by `harmonia profile`"
            ) from None


@dataclass(frozen=True)
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


class CostModel:
    """Analytic, frozen-aware cost of an MLLM on one device kind.

    Args:
        mllm: the model spec with training modes.
        device: the device the work runs on.
        calibration: measured per-phase efficiencies replacing ``device.flops_efficiency``.
        act_bytes: bytes per activation element (2 for bf16, 4 for fp32).
    """

    def __init__(self, mllm: MLLMSpec, device: DeviceSpec, calibration: Calibration | None = None,
                 act_bytes: int = 2) -> None:
        self.mllm = mllm
        self.device = device
        self.calibration = calibration
        self.act_bytes = act_bytes
        self.layers: dict[str, list[LayerCost]] = module_layers(mllm)
        self.modules: list[str] = mllm.module_names
        self._coef = {m: self._coefficients(m, 0, len(self.layers[m])) for m in self.modules}
        self._ranges: dict[tuple[str, int, int], tuple[np.ndarray, int, int, int]] = {}
        self._blocks: dict[tuple[str, int, int], tuple[int, int, float, float]] = {}
        self._flat: dict[tuple[str, int, int], tuple[float, ...]] = {}  # FLOP coefficients as floats
        self._loads: dict[SampleShape, dict[str, ModuleLoad]] = {}

    def _range(self, module: str, start: int, stop: int | None) -> tuple[np.ndarray, int, int, int]:
        """Per-layer sums over layers [start, stop) of ``module``, computed once per range: FLOP
        coefficients, parameters, activation elements kept and elements moved per token."""
        stop = len(self.layers[module]) if stop is None else stop
        key = (module, start, stop)
        if key not in self._ranges:
            layers = self.layers[module][start:stop]
            self._ranges[key] = (self._coefficients(module, start, stop), sum(x.params for x in layers),
                                 sum(x.act_elems_tok for x in layers), sum(x.io_elems_tok for x in layers))
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
        key = (module, start, len(self.layers[module]) if stop is None else stop)
        coef = self._flat.get(key)
        if coef is None:
            coef = self._flat[key] = tuple(float(x) for x in self._range(module, start, stop)[0].ravel())
        f_tok, f_pair, f_win, b_tok, b_pair, b_win, w_tok, _, _ = coef
        tokens, pairs, win = float(load.tokens), float(load.pairs), float(load.windowed_pairs)
        return (f_tok * tokens + f_pair * pairs + f_win * win, b_tok * tokens + b_pair * pairs + b_win * win,
                w_tok * tokens)

    def efficiency(self, phase: str) -> float:
        if self.calibration and phase in self.calibration.flops_efficiency:
            return self.calibration.flops_efficiency[phase]
        return self.device.flops_efficiency

    # ---- time --------------------------------------------------------------------------------
    def stage_times(self, module: str, load: ModuleLoad, start: int = 0, stop: int | None = None,
                    tp: int = 1, cp: int = 1, recompute: bool = False) -> PhaseTimes:
        """Seconds of F, B, W for layers [start, stop) of ``module`` on one rank of a TP x CP group.

        Each phase is a roofline: FLOPs at the phase's efficiency, or the bytes it moves (weights
        once, activations per token) at memory bandwidth, whichever is slower. With ``recompute``
        B also runs the forward of every block with a backward again (module docstring):
        ``B + F`` of those blocks, each term its own roofline.
        """
        stop = len(self.layers[module]) if stop is None else stop
        if recompute:
            plain = self.stage_times(module, load, start, stop, tp, cp)
            lo, hi, n, _ = self._backward_blocks(module, start, stop)
            again = self.stage_times(module, load, lo, hi, tp, cp).F if n else 0.0
            return PhaseTimes(plain.F, plain.B + again, plain.W)
        flops = [f / (tp * cp) for f in self.phase_flops(module, load, start, stop)]
        _, params, _, io_elems = self._range(module, start, stop)
        weight_bytes = params * PARAM_BYTES / tp
        io_bytes = io_elems * load.tokens * self.act_bytes / (tp * cp)
        bw = self.device.mem_bw * self.device.bw_efficiency
        times = []
        for phase, f in zip(PHASES, flops):
            if f == 0.0:
                times.append(0.0)
                continue
            compute = f / (self.device.peak_flops * self.efficiency(phase))
            times.append(float(max(compute, (weight_bytes + io_bytes) / bw)))
        return PhaseTimes(*times)

    def module_times(self, module: str, load: ModuleLoad, tp: int = 1, cp: int = 1) -> PhaseTimes:
        return self.stage_times(module, load, 0, None, tp, cp)

    def sample_costs(self, samples: list[SampleShape], phases: str = "FBW") -> np.ndarray:
        """Per-module work of each sample in seconds (compute term of the roofline).

        Returns:
            array (n_samples, n_modules) in ``self.modules`` order: the sum over ``phases`` of
            FLOPs / achievable rate. Additive over samples, as the balancer needs.
        """
        tokens, pairs = load_arrays(samples, self.mllm)
        return self.costs_from_loads(tokens, pairs, phases)

    def costs_from_loads(self, tokens: np.ndarray, pairs: np.ndarray, phases: str = "FBW") -> np.ndarray:
        """`sample_costs` from precomputed ``(tokens, pairs)`` arrays of shape (n, n_modules)
        (`harmonia.workload.work.load_arrays`: pairs averaged over the blocks, so every block,
        sliding-window or not, counts the same pairs here)."""
        out = np.zeros(tokens.shape, dtype=float)
        for j, module in enumerate(self.modules):
            for p, phase in enumerate(PHASES):
                if phase in phases:
                    rate = self.device.peak_flops * self.efficiency(phase)
                    c = self._coef[module][p]
                    out[:, j] += (c[0] * tokens[:, j] + (c[1] + c[2]) * pairs[:, j]) / rate
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

    # ---- memory ------------------------------------------------------------------------------
    def param_count(self, module: str, start: int = 0, stop: int | None = None) -> tuple[int, int]:
        """(all, trainable) parameters of layers [start, stop)."""
        layers = self.layers[module][start:stop]
        return sum(x.params for x in layers), sum(x.trainable_params for x in layers)

    def state_bytes(self, module: str, start: int = 0, stop: int | None = None, tp: int = 1,
                    fsdp_shards: int = 1) -> float:
        """Weights, gradients and optimizer states of layers [start, stop) on one rank.

        bf16 weights (2 B) for every parameter, plus 2 B gradient + 12 B fp32 master/Adam per
        trainable one; with FSDP everything is sharded over ``fsdp_shards`` ranks.
        """
        total, trainable = self.param_count(module, start, stop)
        per_rank = (total * PARAM_BYTES + trainable * (GRAD_BYTES + OPTIMIZER_BYTES)) / tp
        return per_rank / fsdp_shards

    def activation_bytes(self, module: str, tokens: int, start: int = 0, stop: int | None = None,
                         tp: int = 1, cp: int = 1, recompute: bool = False) -> float:
        """Bytes kept for backward by one microbatch of ``tokens`` through layers [start, stop).

        With ``recompute`` each block with a backward keeps only its input, ``tokens / cp x
        hidden`` elements (replicated over TP), and the other layers keep theirs.
        """
        kept = self._range(module, start, stop)[2]
        if not recompute:
            return kept * tokens * self.act_bytes / (tp * cp)
        lo, hi, n, _ = self._backward_blocks(module, start, stop)
        blocks = sum(x.act_elems_tok for x in self.layers[module][lo:hi] if x.kind == "block")
        inputs = n * self.hidden(module) * tokens * self.act_bytes / cp
        return (kept - blocks) * tokens * self.act_bytes / (tp * cp) + inputs

    def recompute_transient_bytes(self, module: str, tokens: int, start: int = 0, stop: int | None = None,
                                  tp: int = 1, cp: int = 1) -> float:
        """Bytes a recomputed stage holds beyond its kept activations while one block runs its
        backward: that block's recomputed activations (the largest block of layers [start, stop))."""
        return self._backward_blocks(module, start, stop)[3] * tokens * self.act_bytes / (tp * cp)

    def needs_backward(self, module: str) -> bool:
        """Whether any layer of the module runs B or W."""
        return any(x.needs_b or x.needs_w for x in self.layers[module])
