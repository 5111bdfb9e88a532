"""Building a model on 4 CPU processes: each rank's peak memory and time, meta build vs whole-stage build.

For LLM-only checkpoints of about 0.5B, 1B and 2B parameters (Qwen2-shaped ``config.json`` and bf16
safetensors shards written here, random weights), 4 gloo processes build their rank of the model as
`harmonia.train.rank.build_rank_model` does: chunks on ``meta``, sharded there, then only the rank's
shards allocated and read (each tensor alone, a shard's box only where it is one). Beside it, the
build every rank did before: its whole stage chunk built in fp32 on the CPU, filled from the
checkpoint, then sharded (``whole stage``; run only where 4 such ranks fit this machine).

Per row: the largest rank's peak of anonymous resident memory during the build over what it held
before (``RssAnon`` sampled every millisecond by a thread; glibc's mmap threshold fixed so freed
memory leaves; the checkpoint's pages that safetensors maps are the page cache's, reclaimable, and
not counted), the largest rank's anonymous memory after the build (the model still held), the planner's estimate of a rank's weights (what
the plan holds before the optimizer's first step: trained fp32, frozen in their held dtype) and of
its whole step (`harmonia.plan.candidates.state_bytes_per_rank`: weights, gradients, Adam), the
slowest rank's build seconds and the seconds to read every safetensors file once (page cache warm,
as for every build here).

Then (``--train``) the 2B LLM, frozen with LoRA adapters on it, composed with a small SigLIP tower
and trained by ``harmonia train`` for 2 steps on 4 processes with the LLM's base weights sharded
(``llm dp4 fsdp reshard``): its fp32 weights times 4 ranks exceed this machine's 24 GiB, so only a
sharded build can start it. Shown: each rank's resident memory after the last step, the counted
tensor peak of the step (``log.memory``) beside the planner's prediction, and the seconds; then
``harmonia export`` of its checkpoint to an HF directory in a process of its own: its peak anonymous
memory beside the largest tensor plus the largest file it writes. ``--train-layouts``: the same two
steps and export for the 0.5B LLM under each layout of the build rows (dp4, fsdp4, fsdp4 reshard,
tp2 dp2, pp2 dp2), one row each (``--size 1B`` or ``2B`` for a larger LLM: a layout whose plan does not
fit a rank's share of this machine shows the line ``harmonia train`` refuses it with).

    python benchmarks/build_memory.py [--quick] [--train | --train-layouts [--size 0.5B|1B|2B]] [--dir DIR]

``--dir``: where the checkpoints go (default a temporary directory, removed at the end).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table
from saved import save_table

from harmonia.model.hf.io import CheckpointFiles

SIZES = {  # name -> (hidden, layers, ffn, heads, kv heads, vocab)
    "0.5B": (1024, 20, 4096, 16, 4, 32768),
    "1B": (1536, 24, 5632, 16, 4, 32768),
    "2B": (2048, 28, 7168, 16, 4, 32768),
}
LAYOUTS = {  # name -> llm layout kwargs
    "dp4": dict(dp=4),
    "fsdp4": dict(dp=4, fsdp=True),
    "fsdp4 reshard": dict(dp=4, fsdp=True, reshard=True),
    "tp2 dp2": dict(tp=2, dp=2),
    "pp2 dp2": dict(pp=2, dp=2),
}
HOST_BUDGET = 20 * 2**30  # what 4 ranks may hold together on this 24 GiB machine


def write_checkpoint(path: Path, size: str) -> int:
    """A Qwen2-shaped LLM directory in bf16 shards; returns its parameter count."""
    import transformers

    from harmonia.model.hf.io import write_shards

    h, n, f, heads, kv, vocab = SIZES[size]
    config = transformers.Qwen2Config(hidden_size=h, num_hidden_layers=n, intermediate_size=f,
                                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                      tie_word_embeddings=False, dtype="bfloat16")
    config.architectures = ["Qwen2ForCausalLM"]
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    d = h // heads
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(n):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.q_proj.bias": (heads * d,),
                       p + "self_attn.k_proj.weight": (kv * d, h), p + "self_attn.k_proj.bias": (kv * d,),
                       p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.v_proj.bias": (kv * d,),
                       p + "self_attn.o_proj.weight": (h, heads * d), p + "mlp.gate_proj.weight": (f, h),
                       p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)})
    g = torch.Generator().manual_seed(0)

    def load(keys):
        return {k: (torch.randn(shapes[k], generator=g) * 0.02).to(torch.bfloat16) for k in keys}

    write_shards(path, {k: (torch.bfloat16, s) for k, s in shapes.items()}, load, max_shard_bytes=2 * 2**30)
    return sum(int(torch.Size(s).numel()) for s in shapes.values())


class AnonPeak:
    """The largest ``RssAnon`` of this process while running, sampled by a thread every millisecond."""

    def __init__(self) -> None:
        import threading

        self.peak = _status("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _status("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status("RssAnon"))


def _status(field: str, pid: int | str = "self") -> int:
    """A ``/proc/<pid>/status`` field in bytes (0 once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        return 0
    if pid != "self":
        return 0  # a process exiting: its memory fields are gone
    raise RuntimeError(field)


def whole_stage_build(spec, plan, meshes, source) -> None:
    """The build before meta: each chunk whole in fp32 on the CPU, filled from the checkpoint, then sharded."""
    from harmonia.model.hf.stages import load_module_state
    from harmonia.model.lora import apply_training
    from harmonia.runtime.parallelize import build_stage_modules, parallelize_stage, stage_layers

    layout, mesh = plan.layouts["llm"], meshes.module_mesh("llm")
    layers_of = stage_layers(layout, spec.llm.body.n_layers)
    chunks = build_stage_modules(spec, "llm", layout, meshes.rank)
    for c, module in chunks.items():
        apply_training(module, spec.training_of("llm"))
        keys = set(module.state_dict())
        module.load_state_dict(load_module_state(source, spec, "llm", layers_of[c], keys))
        parallelize_stage(module, mesh)
    return chunks


def rank_build(rank: int, world: int, port: int, source: str, layout_kw: dict, how: str, out) -> None:
    import torch.distributed as dist

    from harmonia.model.hf.mllm import mllm_spec_from_hf
    from harmonia.runtime.meshes import build_module_meshes
    from harmonia.schedule.layout import Layout
    from harmonia.schedule.plan import Plan
    from harmonia.train.rank import build_rank_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    spec = mllm_spec_from_hf(source)
    plan = Plan(model=source, layouts={"llm": Layout(**layout_kw)}, n_microbatches=2, global_batch=8)
    meshes = build_module_meshes(plan)
    dist.barrier()
    before = _status("RssAnon")
    sampler = AnonPeak()
    t0 = time.perf_counter()
    if how == "meta":
        model = build_rank_model(spec, plan, meshes, 0, lambda ps: torch.optim.AdamW(ps), None, source=source)
    else:
        model = whole_stage_build(spec, plan, meshes, source)
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    dist.barrier()
    out.put((rank, peak - before, _status("RssAnon") - before, seconds))
    del model
    dist.destroy_process_group()


def measure(source: str, layout_kw: dict, how: str) -> tuple[int, int, float]:
    """(largest rank's build peak over its start, largest resident after, slowest rank's seconds)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed tensors leave the process
    procs = [ctx.Process(target=rank_build, args=(r, 4, port, source, layout_kw, how, out)) for r in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    return max(r[1] for r in results), max(r[2] for r in results), max(r[3] for r in results)


def estimates(source: str, layout_kw: dict) -> tuple[float, float]:
    """Planner's largest rank: (weights before the first step, whole step's states)."""
    from harmonia.model.hf.mllm import mllm_spec_from_hf
    from harmonia.plan.candidates import state_bytes_per_rank
    from harmonia.schedule.layout import Layout
    from harmonia.schedule.plan import Plan
    from harmonia.workload.cost import CostModel
    from harmonia.workload.memory_cost import MASTER_BYTES
    from harmonia.workload.devices import cluster_from_string

    spec = mllm_spec_from_hf(source)
    cost = CostModel(spec, cluster_from_string("cpu:1x4").device)
    layout = Layout(**layout_kw)
    plan = Plan(model=source, layouts={"llm": layout}, n_microbatches=2, global_batch=8)
    total, _ = cost.param_count("llm")
    weights = total * MASTER_BYTES / layout.tp / (layout.dp if layout.fsdp else 1)
    if layout.pp > 1:
        per_stage = [cost.param_count("llm", a, b)[0] for a, b in _stage_ranges(cost, plan)]
        weights = max(per_stage) * MASTER_BYTES / layout.tp / (layout.dp if layout.fsdp else 1)
    return weights, max(state_bytes_per_rank(cost, plan).values())


def _stage_ranges(cost, plan):
    from harmonia.schedule.stagework import stage_layer_range

    return [stage_layer_range(cost, plan, "llm", c) for c in range(plan.layouts["llm"].n_stages)]


def read_once_s(path: Path) -> float:
    t0 = time.perf_counter()
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 * 2**20):
                pass
    return time.perf_counter() - t0


TRAIN_LAYOUTS = {"dp4": "dp4", "fsdp4": "dp4 fsdp", "fsdp4 reshard": "dp4 fsdp reshard", "tp2 dp2": "tp2 dp2",
                 "pp2 dp2": "pp2 dp2"}
"""``--train-layouts``: the LLM's layout of each training row (its name as `LAYOUTS` names it)."""


def train_row(root: Path, console: Console, size: str = "2B", layouts: tuple[str, ...] = ("fsdp4 reshard",)) -> None:
    """2 training steps of an LLM of ``size`` (LoRA on its frozen base) with a small vision tower, under
    each of ``layouts`` (`TRAIN_LAYOUTS`), then ``harmonia export`` of its checkpoint."""
    import transformers

    from harmonia.train.tiny_llava import build_tokenizer

    llm, vision = root / size, root / "vision"
    if not (llm / "config.json").is_file():
        write_checkpoint(llm, size)
    build_tokenizer().save_pretrained(llm)
    if not (vision / "config.json").is_file():
        cfg = transformers.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=2, image_size=32, patch_size=8)
        transformers.SiglipVisionModel(cfg).save_pretrained(vision)
        transformers.SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(vision)
    gib = 2**30
    params = sum(int(t.numel()) for t in CheckpointFiles(llm).meta().values())
    table = Table(title=f"training a LoRA-adapted {size} LLM (frozen base, fp32) with a small vision tower on 4 CPU "
                        "processes: 2 steps of harmonia train, then harmonia export")
    for col in ("LLM layout", "LLM fp32 weights x 4 ranks", "resident per rank after the step",
                "tensor peak per rank (counted)", "planner's prediction per rank", "wall s (start to end)",
                "export: peak anonymous", "export: largest tensor + largest file", "export s"):
        table.add_column(col, justify="left" if col == "LLM layout" else "right")
    for name in layouts:
        try:
            last, seconds = _train(root, llm, vision, name)
        except Refused as err:  # the plan does not fit a rank's share of this machine: said before any rank starts
            table.add_row(name, f"{params * 4 * 4 / gib:.1f} GiB", f"refused: {err}", *[""] * 6)
            console.print(f"{size} {name}: refused before any rank started: {err}", highlight=False)
            continue
        export_peak, export_s, largest, biggest_file = export_row(root / name / "ck", root / name / "export")
        table.add_row(name, f"{params * 4 * 4 / gib:.1f} GiB", " ".join(f"{r / gib:.2f}" for r in last["rss_bytes"]),
                      " ".join(f"{r / gib:.2f}" for r in last["memory_peak_bytes"]),
                      " ".join(f"{r / gib:.2f}" for r in last["memory_predicted_bytes"]), f"{seconds:.0f}",
                      f"{export_peak / gib:.2f}", f"{(largest + biggest_file) / gib:.2f}", f"{export_s:.0f}")
        console.print(f"{size} {name}: trained in {seconds:.0f} s, exported in {export_s:.0f} s", highlight=False)
    console.print(table)


class Refused(Exception):
    """``harmonia train`` refused the plan before any rank started (its line)."""


def _train(root: Path, llm: Path, vision: Path, name: str) -> tuple[dict, float]:
    """``harmonia train`` of the composition for 2 steps with the LLM laid out as ``TRAIN_LAYOUTS[name]``
    (the vision tower dp4 beside it); its last memory record and wall seconds."""
    import json
    import subprocess

    from harmonia.model.hf.mllm import mllm_spec_from_hf
    from harmonia.plan.layout_text import parse_layouts, plan_from_layouts

    source = {"llm": str(llm), "encoders": {"vision": str(vision)}}
    spec = mllm_spec_from_hf(source).with_training(llm="lora", vision="frozen")
    work = root / name
    work.mkdir(parents=True, exist_ok=True)
    plan_from_layouts(spec, source, parse_layouts(f"vision dp4; llm {TRAIN_LAYOUTS[name]}"), 4, 4,
                      training={"llm": "lora", "vision": "frozen"}).save(work / "plan.json")
    run = work / "run"
    cmd = [sys.executable, "-m", "harmonia", "train", f"--model.llm={llm}",
           f"--model.encoders={json.dumps({'vision': str(vision)})}", "--model.frozen=vision", "--model.lora=llm",
           f"--parallel.plan={work / 'plan.json'}", "--parallel.world_size=4", f"--data.path={root / 'data'}",
           "--data.synthesize=32", "--data.heldout=0", "--train.steps=2", "--train.global_batch=4",
           "--log.memory=true", "--log.tensorboard=false", f"--log.dir={run}", f"--checkpoint.dir={work / 'ck'}",
           "--checkpoint.every=0"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "COLUMNS": "1000"})  # a refusal on one line
    seconds = time.perf_counter() - t0
    said = [line.strip() for line in (done.stdout + done.stderr).splitlines() if "GiB" in line and " over the " in line]
    if done.returncode == 2 and said:  # refused as over a rank's memory (a LayoutError's line), before any rank
        raise Refused(said[0])
    if done.returncode:
        raise RuntimeError(f"training row {name}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"rss_bytes"' in x][-1], seconds


def export_row(checkpoint: Path, out: Path) -> tuple[int, float, int, int]:
    """``harmonia export`` of the training checkpoint, in a process of its own: its peak resident
    anonymous bytes (``RssAnon``, sampled every millisecond: the pages of the checkpoint files it maps
    are the page cache's, as in the build rows), seconds, the largest tensor written and the largest
    file written."""
    import json
    import subprocess

    cmd = [sys.executable, "-m", "harmonia", "export", f"--checkpoint={checkpoint}", f"--out={out}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _status("RssAnon", proc.pid))
        time.sleep(0.001)
    printed = proc.stdout.read()
    if proc.returncode:
        raise RuntimeError(f"export: exit {proc.returncode}\n{printed[-3000:]}")
    seconds = time.perf_counter() - t0
    largest = 0
    for f in out.rglob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        largest = max([largest, *(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                                  if k != "__metadata__")])
    return peak, seconds, largest, max(f.stat().st_size for f in out.rglob("*.safetensors"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the 0.5B model only")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (kept)")
    parser.add_argument("--train", action="store_true", help="only the training row (2B LLM, LoRA, fsdp4 reshard)")
    parser.add_argument("--train-layouts", action="store_true",
                        help="only the training rows of the LLM of --size (LoRA) under every layout")
    parser.add_argument("--size", default="0.5B", choices=list(SIZES), help="the LLM of --train-layouts")
    args = parser.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="harmonia-build-memory-"))
    console = Console(record=True, width=160)
    table = Table(title="building one rank of an LLM on 4 CPU processes (gloo): anonymous memory per rank, GiB; "
                        "seconds")
    for col in ("model", "params", "layout", "build", "peak (largest rank)", "held after", "planner: weights",
                "planner: step states", "build s", "read files once s"):
        table.add_column(col, justify="left" if col in ("model", "layout", "build") else "right")
    gib = 2**30
    if args.train or args.train_layouts:
        try:
            if args.train:
                train_row(root, console)
            else:
                train_row(root, console, args.size, tuple(TRAIN_LAYOUTS))
        finally:
            if not args.dir:
                shutil.rmtree(root, ignore_errors=True)
        layouts = "build-memory-layouts" + ("" if args.size == "0.5B" else f"-{args.size}")
        save_table(console, "build-memory-train" if args.train else layouts)
        return 0
    try:
        for size in (["0.5B"] if args.quick else list(SIZES)):
            path = root / size
            if not (path / "config.json").is_file():
                write_checkpoint(path, size)
            params = sum(int(t.numel()) for t in CheckpointFiles(path).meta().values())
            read_s = read_once_s(path)
            for name, kw in LAYOUTS.items():
                weights, states = estimates(str(path), kw)
                for how in ("meta", "whole stage"):
                    whole = params * 4 / kw.get("pp", 1)  # fp32, every rank its whole stage
                    held = weights if how == "meta" else whole
                    if 4 * held > HOST_BUDGET:
                        table.add_row(size, f"{params / 1e9:.2f}B", name, how,
                                      f"not run: 4 x {held / gib:.1f} GiB", "", f"{weights / gib:.2f}",
                                      f"{states / gib:.2f}", "", f"{read_s:.1f}")
                        continue
                    peak, resident, secs = measure(str(path), kw, "meta" if how == "meta" else "whole")
                    table.add_row(size, f"{params / 1e9:.2f}B", name, how, f"{peak / gib:.2f}", f"{resident / gib:.2f}",
                                  f"{weights / gib:.2f}", f"{states / gib:.2f}", f"{secs:.1f}", f"{read_s:.1f}")
                    console.print(f"{size} {name} {how}: peak {peak / gib:.2f} GiB, {secs:.1f} s", highlight=False)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    console.print(table)
    save_table(console, "build-memory")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
