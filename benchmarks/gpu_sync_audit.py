"""GPU sync audit: a training step's actions must never wait for the device.

A step's actions (`harmonia.runtime.mllm_iteration.MLLMIteration.execute`: every forward, backward,
boundary transfer and stage message) only queue work; a host read of a device value there (a
``.tolist()``, ``.item()``, ``int(t)``, a blocking copy, a ``nonzero``) would stall the CPU until the
GPU drains, once per action. This script builds tiny models on one GPU as a training job does
(`harmonia.train.rank.build_rank_model`: bf16 autocast, attention ``auto``; blocks compiled with
``--compile``), runs a warm-up step, then ``--steps`` steps of new samples with
``torch.cuda.set_sync_debug_mode`` set while the actions run. In ``error`` mode the first sync raises
with its stack; ``warn`` lists them all. What the step does on the host after its actions is not
audited: the loss and gradient norm it reports, and the action timer's one wait for its events
(`harmonia.runtime.action_timer`).

Models: ``tiny-vlm`` (a tiled ViT whose projector averages slots, the LLM's packed causal attention)
and ``qwen2.5-vl`` (a native-resolution tower: packed frames and windows of images of several sizes,
multimodal rotary positions; a tiny config made here with transformers).

    python benchmarks/gpu_sync_audit.py [--models tiny-vlm,qwen2.5-vl] [--steps 2] [--mode error|warn] [--compile]

Without CUDA it says so and exits 2 (`benchmarks/gpu_check.py --tiny` runs the same steps on CPU,
unaudited, so the script never rots; the unit tests run them with host reads refused,
``tests/unit/test_host_reads.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("tiny-vlm", "qwen2.5-vl")
N_SAMPLES, N_MICROBATCHES = 6, 2


def model_spec(name: str):
    """The `MLLMSpec` of one of `MODELS`."""
    if name == "tiny-vlm":
        from harmonia.model.presets import mllm_preset

        return mllm_preset("tiny-vlm")
    if name == "qwen2.5-vl":
        import transformers

        from harmonia.model.families.qwen_vl import qwen_vl_spec_from_hf

        text = dict(vocab_size=96, bos_token_id=1, eos_token_id=2, hidden_size=64, intermediate_size=96,
                    num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 4]})
        vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=2, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=8, fullatt_block_indexes=[1], out_hidden_size=64)
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=95,
                                               video_token_id=94, vision_start_token_id=93, vision_end_token_id=92)
        return qwen_vl_spec_from_hf(config.to_dict())
    raise SystemExit(f"unknown model {name!r}; pick from {MODELS}")


def samples(spec, step: int):
    """The step's samples: text around 0-2 images (tiles, or native grids of 2..8 x 2..8 patches)."""
    from harmonia.model.batch import ItemInputs, TokenizedSample
    from harmonia.model.mrope import item_rope_positions

    vision = spec.encoders["vision"]
    rng, g = random.Random(step), torch.Generator().manual_seed(step)
    out = []
    for i in range(N_SAMPLES):
        items, segments = [], [("text", rng.randint(1, 4))]
        for _ in range(rng.randint(0, 2)):
            if vision.native is not None:
                h, w = 2 * rng.randint(1, 4), 2 * rng.randint(1, 4)
                items.append(ItemInputs("vision", torch.randn(h * w, vision.native.patch_dim, generator=g),
                                        grid=torch.tensor([[1, h, w]])))
                segments.append(("item", h * w // vision.native.merge_size ** 2))
            else:
                items.append(ItemInputs("vision", torch.randn(1, 3, vision.image_size, vision.image_size, generator=g)))
                segments.append(("item", vision.llm_tokens_per_tile()))
            segments.append(("text", 1))
        segments.append(("text", rng.randint(2, 8)))
        n = sum(k for _, k in segments)
        ids = torch.randint(4, 90, (n,), generator=g)
        labels = torch.roll(ids, -1)
        labels[-1] = -100
        out.append(TokenizedSample(ids, labels, segments, items, sample_id=i,
                                   causal_items=spec.item_attention == "causal",
                                   rope_positions=item_rope_positions(spec, segments, items)))
    return out


@dataclass
class Job:
    """One rank's model, schedule and layouts: everything but the data."""

    name: str
    spec: object
    executor: object
    schedule: object
    layouts: dict


def build_job(name: str, device: torch.device, compile: bool = False) -> Job:
    """A tiny model on this one rank as `harmonia train` builds it (the process group is up)."""
    from harmonia.runtime.meshes import build_module_meshes
    from harmonia.schedule import build_schedule
    from harmonia.schedule.layout import Layout, Placement
    from harmonia.schedule.plan import Plan
    from harmonia.train.rank import build_rank_model, schedule_graph

    spec = model_spec(name)
    plan = Plan(spec.name, {"vision": Layout(), "llm": Layout()}, Placement.COLOCATED, "1f1b", N_MICROBATCHES,
                global_batch=N_SAMPLES)
    meshes = build_module_meshes(plan, device.type)
    model = build_rank_model(spec, plan, meshes, 0, lambda groups: torch.optim.AdamW(groups, lr=1e-4), 1.0, device,
                             attention="auto", compile="on" if compile else "off")
    return Job(name, spec, model.executor, build_schedule(schedule_graph(spec, plan), N_MICROBATCHES, "1f1b"),
               dict(plan.layouts))


def step_batch(job: Job, step: int, move: Callable):
    """The step's `RankBatch` (microbatches of consecutive samples), moved by ``move`` (`to_device`)."""
    from harmonia.runtime.mllm_inputs import build_rank_batch

    batch = samples(job.spec, step)
    per = len(batch) // N_MICROBATCHES
    micro = [batch[m * per:(m + 1) * per] for m in range(N_MICROBATCHES)]
    split = [[list(range(len(mb)))] for mb in micro]
    return move(build_rank_batch(job.layouts, 0, micro, split, {"vision": split}))


@contextlib.contextmanager
def watching_actions(guard: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    """Every iteration's actions run inside ``guard()`` while this is on (nothing else of a step)."""
    from harmonia.runtime.mllm_iteration import MLLMIteration

    execute = MLLMIteration.execute

    def guarded(self, actions):
        with guard():
            return execute(self, actions)

    MLLMIteration.execute = guarded
    try:
        yield
    finally:
        MLLMIteration.execute = execute


@contextlib.contextmanager
def sync_debug(mode: str) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode(mode)`` while on."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def run_steps(job: Job, steps: int, move: Callable, guard: Callable[[], contextlib.AbstractContextManager]) -> dict:
    """A warm-up step, then ``steps`` steps with their actions inside ``guard()``; the actions' times
    (`MLLMExecutor.action_times`) checked: one per compute action, each ending after it starts.

    Returns:
        ``steps``, ``actions`` (compute actions timed in the audited steps), ``busy_s`` (their seconds)
        and ``loss`` (the last step's).
    """
    ex = job.executor
    computes = sum(a.kind.is_compute for a in ex.rank_actions(job.schedule))
    timed, busy, loss = 0, 0.0, float("nan")
    for step in range(steps + 1):
        batch = step_batch(job, step, move)
        ex.action_times = []
        with watching_actions(guard) if step else contextlib.nullcontext():
            loss = ex.step(job.schedule, batch).loss
        if len(ex.action_times) != computes or any(e < s for _, s, e, _ in ex.action_times):
            raise AssertionError(f"{job.name} step {step}: {len(ex.action_times)} action times for {computes} "
                                 f"compute actions, or one ending before it starts: {ex.action_times}")
        if step:
            timed += len(ex.action_times)
            busy += sum(e - s for _, s, e, _ in ex.action_times)
    ex.action_times = None
    return {"steps": steps, "actions": timed, "busy_s": busy, "loss": loss}


def audit(models: list[str], steps: int, mode: str, compile: bool = False) -> list[tuple[str, str]]:
    """(model, verdict) of each model's audited steps on this process's GPU (the process group is up)."""
    from harmonia.train.rank import to_device

    device = torch.device("cuda", torch.cuda.current_device())
    out = []
    for name in models:
        t0 = time.perf_counter()
        try:
            job = build_job(name, device, compile)
            got = run_steps(job, steps, lambda batch: to_device(batch, device), lambda: sync_debug(mode))
        except Exception as e:  # noqa: BLE001 - the verdict names the sync; its stack is printed
            import traceback

            traceback.print_exc()
            out.append((name, f"FAIL: {type(e).__name__}: {e}"[:200]))
            continue
        out.append((name, f"ok: no sync in the actions of {got['steps']} steps ({got['actions']} compute actions "
                          f"timed by CUDA events, {got['busy_s'] * 1e3:.1f} ms busy; loss {got['loss']:.3f}; "
                          f"{time.perf_counter() - t0:.1f} s)"))
    return out


@contextlib.contextmanager
def one_process_group(device_type: str) -> Iterator[None]:
    """A process group of this process alone as a job makes it (`process_group_backend`: NCCL with gloo
    beside it for the host-side loss and norm on a GPU, gloo on CPU), unless one is up."""
    from harmonia.train.backend import process_group_backend

    if dist.is_initialized():
        yield
        return
    backend = process_group_backend("nccl" if device_type == "cuda" else "gloo")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {MODELS}")
    parser.add_argument("--steps", type=int, default=2, help="audited steps after the warm-up (default 2)")
    parser.add_argument("--mode", choices=("error", "warn"), default="error",
                        help="error: the first sync raises with its stack; warn: every sync is listed")
    parser.add_argument("--compile", action="store_true", help="compile the blocks, as a GPU job does by default")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_sync_audit: no CUDA device here; it audits GPU syncs and needs one "
              "(benchmarks/gpu_check.py --tiny runs the same steps on CPU)")
        return 2
    torch.cuda.set_device(0)
    with one_process_group("cuda"):
        verdicts = audit(args.models.split(","), args.steps, args.mode, args.compile)
    for name, verdict in verdicts:
        print(f"{name}: {verdict}")
    return 0 if all(v.startswith("ok") for _, v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
