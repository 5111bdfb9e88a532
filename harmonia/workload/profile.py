"""Measure per-layer F, B, W times on the current device and fit the cost model's efficiencies.

One transformer block of a module's spec is timed on sequences of several lengths:
F = forward; B = ``autograd.grad`` w.r.t. the input only; W = the full backward (input and weights)
minus B, which is the weight-gradient share as Zero Bubble (Qi et al. 2024) defines it. The achieved
fraction of the device's peak for each phase is ``analytic FLOPs / (seconds * peak)``; the median
over lengths becomes the calibration that `CostModel` loads. B and W are differences of two timings:
where one is below `NOISE_SHARE` of the timing it is taken from (a tiny block on a busy CPU), it is
within the timings' noise, recorded as such and left out of the median; a phase with no measurement
above the noise at any length is left out of the calibration, so the device's own rate prices it
(`harmonia.workload.cost.CostModel`), and `harmonia profile` says so.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from harmonia.model.spec import TransformerSpec
from harmonia.model.training_mode import Trainability
from harmonia.workload.calibration import Calibration
from harmonia.workload.devices import DeviceSpec
from harmonia.workload.layers import block_cost


class ProbeBlock(nn.Module):
    """A pre-norm attention + MLP block with the widths of a `TransformerSpec` (bidirectional)."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.norm1 = nn.LayerNorm(spec.hidden)
        self.qkv = nn.Linear(spec.hidden, spec.q_dim + 2 * spec.kv_dim, bias=spec.qkv_bias)
        self.out = nn.Linear(spec.q_dim, spec.hidden, bias=spec.out_bias)
        self.norm2 = nn.LayerNorm(spec.hidden)
        n_in = 2 if spec.mlp == "swiglu" else 1
        self.up = nn.Linear(spec.hidden, n_in * spec.ffn_hidden, bias=spec.mlp_bias)
        self.down = nn.Linear(spec.ffn_hidden, spec.hidden, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        b, t, _ = x.shape  # (B, T, h)
        q, k, v = self.qkv(self.norm1(x)).split([s.q_dim, s.kv_dim, s.kv_dim], dim=-1)
        q = q.view(b, t, s.n_heads, s.dim_head).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(b, t, s.kv_heads, s.dim_head).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(b, t, s.kv_heads, s.dim_head).transpose(1, 2)
        if s.kv_heads != s.n_heads:
            k = k.repeat_interleave(s.n_heads // s.kv_heads, dim=1)
            v = v.repeat_interleave(s.n_heads // s.kv_heads, dim=1)
        a = nn.functional.scaled_dot_product_attention(q, k, v)  # (B, nh, T, hd)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, s.q_dim))
        hmid = self.up(self.norm2(x))
        if s.mlp == "swiglu":
            gate, up = hmid.chunk(2, dim=-1)
            hmid = nn.functional.silu(gate) * up
        else:
            hmid = nn.functional.gelu(hmid)
        return x + self.down(hmid)


def _timeit(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of ``repeats`` runs after one warm-up (the least disturbed by other load)."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - t0)
    return min(samples)


def measure_block(spec: TransformerSpec, tokens: int, device: torch.device, dtype: torch.dtype,
                  repeats: int = 3) -> dict[str, float]:
    """Seconds of F, B and W of one block on one sequence of ``tokens`` tokens."""
    block = ProbeBlock(spec).to(device=device, dtype=dtype)
    x = torch.randn(1, tokens, spec.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    params = [p for p in block.parameters()]

    def forward() -> None:
        with torch.no_grad():
            block(x)

    def backward_input() -> None:
        torch.autograd.grad(block(x), [x], grad)

    def backward_all() -> None:
        torch.autograd.grad(block(x), [x, *params], grad)

    f = _timeit(forward, device, repeats)
    fb = _timeit(backward_input, device, repeats)
    fbw = _timeit(backward_all, device, repeats)
    return phase_seconds(f, fb, fbw)


NOISE_SHARE = 0.03
"""A difference of two timings below this share of the larger is within their noise (the fastest of a
few runs of the same work differs by a few percent on a busy CPU)."""


def phase_seconds(f: float, fb: float, fbw: float) -> dict[str, float | None]:
    """F, B = ``fb - f`` and W = ``fbw - fb`` from the forward, forward + input-gradient and forward +
    whole-backward timings; None for a difference within the timings' noise (`NOISE_SHARE`)."""
    def diff(a: float, b: float) -> float | None:
        return b - a if b - a > NOISE_SHARE * b else None

    return {"F": f, "B": diff(f, fb), "W": diff(fb, fbw)}


def profile_device(device_spec: DeviceSpec, spec: TransformerSpec, lengths: tuple[int, ...] = (256, 512, 1024),
                   device: torch.device | None = None, repeats: int = 3) -> Calibration:
    """Time a block at several lengths and return the achieved fraction of peak per phase."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer = block_cost("probe", spec, Trainability.FULL, 16, upstream_trains=True)
    rows, eff = [], {"F": [], "B": [], "W": []}
    for t in lengths:
        secs = measure_block(spec, t, device, dtype, repeats)
        pairs = t * t
        flops = {"F": layer.f_tok * t + layer.f_pair * pairs, "B": layer.b_tok * t + layer.b_pair * pairs,
                 "W": layer.w_tok * t}
        for phase in eff:
            if secs[phase] is not None:
                eff[phase].append(flops[phase] / (secs[phase] * device_spec.peak_flops))
            rows.append({"layer": "block", "tokens": t, "phase": phase, "seconds": secs[phase],
                         "flops": flops[phase]})
    fitted = {p: float(min(1.5, max(1e-4, statistics.median(v)))) for p, v in eff.items() if v}
    return Calibration(device_spec.name, fitted, rows)
