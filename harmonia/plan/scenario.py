"""Scenarios: a model, a cluster, a trace and a batch size, loaded once for the planner.

A `ScenarioRun` holds what every candidate plan is scored on: the model and its cost model, the
cluster, the trace's sample shapes and their per-module work, and the profiled global batches
(`harmonia.plan.profiling`). The planner searches it (`harmonia.plan.search`); every recipe's best
plan on it is compared by `harmonia.plan.compare`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import get_origin, get_type_hints

from harmonia.errors import ConfigError
from harmonia.model.resolve import resolve_mllm
from harmonia.model.spec import MLLMSpec
from harmonia.plan.profiling import MEMORY_POOL, heaviest, profile_batches
from harmonia.plan.recipes import Candidate, assign, simulate
from harmonia.schedule.stagework import IterationWork, plan_iteration_work
from harmonia.sim.engine import Timeline
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import ClusterSpec, DeviceSpec, cluster_from_string
from harmonia.workload.shapes import SampleShape
from harmonia.workload.traces import is_generated, load_trace
from harmonia.workload.work import load_arrays

ROOT = Path(__file__).resolve().parents[2]
DEVICE_FIELDS = frozenset(f.name for f in fields(DeviceSpec)) - {"name", "gpus_per_node"}
"""What a scenario's ``device`` may replace in its cluster's device preset (the cluster string
gives the devices per node)."""
DEVICE_BOOLEANS = frozenset(name for name, kind in get_type_hints(DeviceSpec).items() if kind is bool)
"""The device fields that are true or false."""
DEVICE_PAIRS = frozenset(name for name, kind in get_type_hints(DeviceSpec).items() if get_origin(kind) is tuple)
"""The device fields that are two numbers (``split_backward_s``: B's and W's); every other one a number."""
DEVICE_KINDS = (f"{' and '.join(sorted(DEVICE_BOOLEANS))} is true or false, {' and '.join(sorted(DEVICE_PAIRS))} "
                "two numbers, every other field a number")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _device_value_fits(name: str, value: object) -> bool:
    """Whether ``value`` is of device field ``name``'s kind (a bool, two numbers, or a number)."""
    if name in DEVICE_BOOLEANS:
        return isinstance(value, bool)
    if name in DEVICE_PAIRS:
        return isinstance(value, (list, tuple)) and len(value) == 2 and all(map(_is_number, value))
    return _is_number(value)


def parse_device_changes(text: str) -> dict[str, float | bool | tuple[float, float]]:
    """``flops_efficiency=0.6,mixed_precision=false`` (a command line's ``--device-set``) as the device
    fields it replaces: booleans ``true`` or ``false``, pairs as ``B:W`` (``split_backward_s=2e-4:4e-4``),
    every other field a number.

    Raises:
        ConfigError: on an item that is not ``FIELD=VALUE``, an unknown field or a value of the wrong type.
    """
    out: dict[str, float | bool | tuple[float, float]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = (x.strip() for x in item.partition("="))
        if not sep or name not in DEVICE_FIELDS:
            raise ConfigError(f"device setting {item!r}: expected FIELD=VALUE with FIELD one of "
                              f"{sorted(DEVICE_FIELDS)}, e.g. flops_efficiency=0.6")
        try:
            if name in DEVICE_BOOLEANS:
                if value.lower() not in ("true", "false"):
                    raise ValueError(value)
                out[name] = value.lower() == "true"
            elif name in DEVICE_PAIRS:
                pair = tuple(float(x) for x in value.split(":"))
                if len(pair) != 2:
                    raise ValueError(value)
                out[name] = pair
            else:
                out[name] = float(value)
        except ValueError:
            kind = "bool" if name in DEVICE_BOOLEANS else "pair of floats B:W" if name in DEVICE_PAIRS else "float"
            raise ConfigError(f"device setting {item!r}: {name} takes a {kind}, not {value!r}") from None
    return out


@dataclass(frozen=True)
class Scenario:
    """What to simulate.

    Attributes:
        name: scenario name.
        model: MLLM preset name, HF checkpoint directory, or composition (`harmonia.model.resolve`).
        training: module -> full / frozen / lora.
        cluster: ``DEVICE:NODESxGPUS``.
        trace: CSV path (relative paths resolve against the project root), ``synthetic[:...]`` or
            ``text:N`` (`harmonia.workload.traces.load_trace`).
        global_batch: samples per iteration.
        iterations: batches averaged in the report.
        search_batches: batches each candidate is scored on during the search.
        memory_batches: further batches a plan must also fit device memory on before the search
            ranks it (a plan timed on a few batches meets heavier ones when it trains): the
            heaviest of `MEMORY_POOL` times as many drawn batches (`heaviest`).
        seed: sampling seed.
        sequence_parallel: price TP as Megatron-LM's sequence parallelism does (norms, residual adds
            and their activations split over tokens; `harmonia.workload.cost`); harmonia's runtime runs
            TP without it.
        fsdp_per_microbatch: price every FSDP layout as ZeRO-3 (weights gathered before every
            forward and backward, every state sharded: FSDP2's default, as published runs use it);
            harmonia's runtime does so for an LLM laid out ``fsdp reshard`` and otherwise gathers
            once per step and keeps weights and gradients whole until its end
            (`harmonia.workload.cost`).
        mixed_precision: whether the job trains in bf16 mixed precision (frozen weights held in
            bf16: `DeviceSpec.mixed_precision`); None: as the device kind does by default (the
            GPUs yes, the CPU no), as ``train.precision`` ``auto`` runs it.
        device: fields of the cluster's device preset to replace (`DeviceSpec`), e.g.
            ``{flops_efficiency = 0.62}`` for a matmul rate measured on the user's own runs.
    """

    name: str
    model: str | dict
    cluster: str
    trace: str
    global_batch: int
    training: dict[str, str] = field(default_factory=dict)
    iterations: int = 20
    search_batches: int = 2
    memory_batches: int = 8
    seed: int = 0
    sequence_parallel: bool = False
    fsdp_per_microbatch: bool = False
    mixed_precision: bool | None = None
    device: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.iterations < 1 or self.search_batches < 1:
            raise ConfigError(f"scenario {self.name!r}: global_batch, iterations and search_batches must be >= 1")
        unknown = sorted(set(self.device) - DEVICE_FIELDS)
        if unknown:
            raise ConfigError(f"scenario {self.name!r}: device fields {unknown} unknown; a device sets "
                              f"{sorted(DEVICE_FIELDS)}")
        wrong = {k: v for k, v in self.device.items() if not _device_value_fits(k, v)}
        if wrong:
            raise ConfigError(f"scenario {self.name!r}: device {wrong} invalid: {DEVICE_KINDS}")
        if self.memory_batches < 0:
            raise ConfigError(f"scenario {self.name!r}: memory_batches={self.memory_batches} must be >= 0")

    @staticmethod
    def load(path: str | Path) -> Scenario:
        path = Path(path)
        try:
            raw = tomllib.loads(path.read_text())
            unknown = sorted(set(raw) - {"scenario"})
            if unknown:
                raise ConfigError(f"scenario file {path}: unknown tables or keys {unknown}; everything goes in the "
                                  "[scenario] table (device fields as `device = {...}` inside it)")
            return Scenario(**raw["scenario"])
        except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"scenario file {path}: {err}; expected a [scenario] table with name, model, "
                              "cluster, trace and global_batch") from None

    def trace_spec(self) -> str:
        """The trace as `load_trace` takes it: a generated trace as written, a relative CSV path
        resolved against the project root."""
        if is_generated(self.trace):
            return self.trace
        p = Path(self.trace)
        return str(p if p.is_absolute() else ROOT / p)


def _check_trace_modalities(scenario: Scenario, samples: list[SampleShape], mllm: MLLMSpec) -> None:
    """A trace whose samples hold items of a modality the model has no encoder for is refused,
    naming the trace, the modalities and what to profile instead."""
    known = {m for enc in mllm.encoders.values() for m in enc.modalities}
    found = {item.modality for s in samples for item in s.items}
    if found - known:
        hint = "text:N (N tokens a sample)" if not known else f"a trace of {sorted(known)} items"
        raise ConfigError(f"trace {scenario.trace!r} holds {sorted(found - known)} items, which {scenario.model!r} "
                          f"has no encoder for (it encodes {sorted(known)}); profile {hint} instead")


class ScenarioRun:
    """Loads a scenario's model, cluster and trace once and runs recipes on it."""

    def __init__(self, scenario: Scenario, samples: list[SampleShape] | None = None) -> None:
        """Load the scenario; ``samples`` (e.g. a dataset's shapes) replace its trace when given."""
        self.scenario = scenario
        self.mllm = resolve_mllm(scenario.model, training=scenario.training)
        self.cluster: ClusterSpec = cluster_from_string(scenario.cluster)
        if scenario.mixed_precision is not None:
            self.cluster = self.cluster.with_device(mixed_precision=scenario.mixed_precision)
        if scenario.device:
            self.cluster = self.cluster.with_device(**scenario.device)
        self.cost = CostModel(self.mllm, self.cluster.device, sequence_parallel=scenario.sequence_parallel,
                              fsdp_per_microbatch=scenario.fsdp_per_microbatch)
        self.samples = samples if samples is not None else load_trace(
            scenario.trace_spec(), n_samples=max(4 * scenario.global_batch, 4096), seed=scenario.seed)
        if samples is None:
            _check_trace_modalities(scenario, self.samples, self.mllm)
        tokens, pairs = load_arrays(self.samples, self.mllm)
        self.costs = self.cost.costs_from_loads(tokens, pairs)
        self.tokens = tokens[:, self.cost.modules.index("llm")]
        n_batches = scenario.iterations + scenario.search_batches
        pool = MEMORY_POOL * scenario.memory_batches
        drawn = profile_batches(self.samples, self.cost, scenario.global_batch, n_batches + pool, scenario.seed)
        heavy = heaviest(drawn.take(range(n_batches, n_batches + pool)), scenario.memory_batches)
        self.profile = drawn.take([*range(n_batches), *(n_batches + r for r in heavy)],
                                  drawn=n_batches if heavy else None)

    def iteration_work(self, cand: Candidate, k: int) -> IterationWork:
        """The stage work of profiled batch ``k`` under a candidate (its recipe's assignment)."""
        batch = self.profile.batches[k]
        shapes = [self.samples[i] for i in batch]
        assignment = assign(cand, self.costs[batch], self.tokens[batch], self.cost, shapes)
        return plan_iteration_work(shapes, cand.plan, self.cost, assignment)

    def timeline(self, cand: Candidate, k: int, search_budget_s: float = 0.1) -> Timeline:
        """One simulated iteration of profiled batch ``k`` under a candidate."""
        batch = self.profile.batches[k]
        return simulate(cand, self.samples, batch, self.costs[batch], self.tokens[batch], self.cost, self.cluster,
                        search_budget_s)
