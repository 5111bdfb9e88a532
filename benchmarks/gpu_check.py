"""The GPU check (`make gpu-check`): attention kernels and one training step of a LLaVA-shaped model.

1. Kernel parity: every attention kernel that runs on this device (`harmonia.model.attention`:
   ``varlen``, ``flex``, ``segments``) against dense SDPA with the ``(T, T)`` mask computed in fp32,
   outputs and input gradients, in bf16 on a GPU (relative error of the whole tensor <= 2e-2) and in
   fp32 on CPU (<= 1e-5): causal packed documents (HF's LLaVA: image tokens causal), with a sliding
   window, and bidirectional items inside causal text; GQA throughout.
2. One training step (forward, backward, AdamW; the vision tower frozen, as LLaVA's instruction
   tuning runs) of a LLaVA of about 2B parameters (SigLIP-so400m-shaped tower, Qwen2-1.5B-shaped
   LLM, random weights from a config made here) on one GPU, bf16 autocast: harmonia's model on one
   packed microbatch (attention ``auto``) beside transformers' own (``attn_implementation="sdpa"``)
   on the same samples padded as an HF Trainer feeds them. Measured: step seconds (best of 3 after
   a warm-up), tokens/s (real tokens), MFU (useful FLOPs of the cost model over the device's bf16
   peak), peak memory; beside them the cost model's predicted step (the simulator's single-GPU,
   single-microbatch time: every module's F, B and W) and the planner's peak-memory estimate for
   the same plan and batch.
3. The whole runtime: ``harmonia train`` started as a user starts it, one process on this device
   (NCCL, bf16, attention and compilation ``auto``, then compilation off), read back from its
   metrics: wall-clock tokens/s, the last step beside the simulator's, the allocator's peak beside
   the planner's estimate, start-up.
4. Syncs (`gpu_sync_audit`): executor steps of tiny models (a tiled ViT, Qwen2.5-VL's native
   tower) with ``torch.cuda.set_sync_debug_mode("error")`` while their actions run, after a warm-up
   step: a host sync in the hot path fails the part with its stack. Runs before part 3, which takes
   what is left of the budget.

``--tiny`` runs every part on CPU with tiny widths (CI runs it, so the script never rots); on a GPU
the tables are saved under ``benchmarks/results/gpu-check-DATE.txt`` (after part 2, then again at
the end). A kernel out of tolerance, a step or a run that fails exits 1 after the tables; each part
stops where ``--budget`` seconds are spent.

    python benchmarks/gpu_check.py [--tiny] [--budget SECONDS] [--parts kernels,step,syncs,runtime]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from saved import save_table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harmonia.errors import ConfigError  # noqa: E402
from harmonia.model.attention import PackedAttention  # noqa: E402
from harmonia.model.attention_backend import choose_backend, mask_kind  # noqa: E402
from harmonia.model.attention_mask import TokenLayout, multimodal_mask  # noqa: E402

IMAGE_TOKEN = 151646
PARTS = ("kernels", "step", "syncs", "runtime")


def kernel_cases(n_tokens: int, seed: int = 0) -> list[tuple[str, TokenLayout, int | None]]:
    """(name, layout, window): packed documents of 1/16 to 1/4 of the microbatch each."""
    g = torch.Generator().manual_seed(seed)
    samples, total = [], 0
    while total < n_tokens:
        n = min(int(torch.randint(n_tokens // 16, n_tokens // 4 + 1, (1,), generator=g)), n_tokens - total)
        image = n // 3
        samples.append([("text", n // 6), ("item", image), ("text", n - n // 6 - image)])
        total += n
    causal = TokenLayout.from_segments(samples, causal_items=True)
    images = [[("item", n)] for _, (_, n), _ in samples]  # an encoder's images of different sizes
    return [("causal documents", causal, None), ("causal documents, window 256", causal, 256),
            ("bidirectional items", TokenLayout.from_segments(samples), None),
            ("encoder sequences", TokenLayout.from_segments(images), None)]


def _timed_kernel(packed: PackedAttention, qkv, g, window, dtype):
    """Output, input gradients and ms of one forward and backward after a warm-up (which compiles flex)."""
    inputs = [t.to(dtype).clone().requires_grad_() for t in qkv]
    y = packed.attend(*inputs, window)
    torch.autograd.grad(y, inputs, g.to(dtype))
    _sync(g.device)
    t0 = time.perf_counter()
    y = packed.attend(*inputs, window)
    grads = torch.autograd.grad(y, inputs, g.to(dtype))
    _sync(g.device)
    return y, grads, (time.perf_counter() - t0) * 1e3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def kernel_parity(device: torch.device, dtype: torch.dtype, n_tokens: int, tol: float) -> tuple[Table, bool]:
    table = Table(title=f"attention kernels vs dense SDPA (fp32 reference), {n_tokens} packed tokens, "
                        f"{str(dtype).removeprefix('torch.')} on {device.type}")
    for col in ("mask", "kernel", "output rel. error", "grad rel. error (q, k, v)", "ms fwd+bwd", "verdict"):
        table.add_column(col, justify="left" if col in ("mask", "kernel", "verdict") else "right")
    ok = True
    for name, layout, window in kernel_cases(n_tokens):
        host = layout  # the kernels plan from the host's layout, as a training step's do
        layout = TokenLayout(*(t.to(device) for t in (layout.sample, layout.segment, layout.is_item, layout.position)))
        torch.manual_seed(0)
        q = torch.randn(1, 8, len(layout), 64, device=device)
        k, v = torch.randn(2, 1, 2, len(layout), 64, device=device).unbind(0)
        g = torch.randn_like(q)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*ref_in, attn_mask=multimodal_mask(layout, window=window)[None, None],
                                              enable_gqa=True)
        want_grads = torch.autograd.grad(want, ref_in, g)
        for kernel in ("varlen", "flex", "segments"):
            try:
                choose_backend(kernel, device, mask_kind(layout))
            except ConfigError as e:
                table.add_row(name, kernel, "", "", "", f"not run: {e}".split(";")[0])
                continue
            try:
                y, grads, ms = _timed_kernel(PackedAttention(host, backend=kernel, device=device), (q, k, v), g,
                                             window, dtype)
            except Exception as e:  # noqa: BLE001 - the table says which kernel failed and why
                ok = False
                traceback.print_exc()
                table.add_row(name, kernel, "", "", "", f"FAIL: {type(e).__name__}: {e}"[:160])
                continue
            errors = [_rel(y, want)] + [_rel(a, b) for a, b in zip(grads, want_grads)]
            passed = max(errors) <= tol
            ok &= passed
            table.add_row(name, kernel, f"{errors[0]:.1e}", ", ".join(f"{e:.1e}" for e in errors[1:]), f"{ms:.1f}",
                          "ok" if passed else f"FAIL (> {tol:.0e})")
    return table, ok


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def llava_config(tiny: bool):
    import transformers

    if tiny:
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, image_size=28, patch_size=14)
        text = transformers.Qwen2Config(vocab_size=IMAGE_TOKEN + 2, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True)
    else:  # SigLIP-so400m/14 at 384 px (729 tokens per image), Qwen2-1.5B
        vision = transformers.SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                                 num_attention_heads=16, image_size=384, patch_size=14)
        text = transformers.Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                        tie_word_embeddings=True, rope_theta=1e6)
    return transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                                    vision_feature_layer=-1, vision_feature_select_strategy="full")


def make_samples(config, n: int, text_range: tuple[int, int], seed: int = 0):
    """``n`` samples of one image and a text of random length: ids (image tokens in place), labels, pixels."""
    g = torch.Generator().manual_seed(seed)
    per_image = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
    out = []
    for _ in range(n):
        n_text = int(torch.randint(*text_range, (1,), generator=g))
        text = torch.randint(10, 1000, (n_text,), generator=g)
        ids = torch.cat([text[:8], torch.full((per_image,), IMAGE_TOKEN), text[8:]])
        labels = ids.clone()
        labels[:8 + per_image + n_text // 2] = -100  # the answer: the second half of the text
        pixels = torch.randn(1, 3, config.vision_config.image_size, config.vision_config.image_size, generator=g)
        out.append((ids, labels, pixels))
    return out


def harmonia_step(config, samples, device, dtype):
    from harmonia.model.batch import pack_samples
    from harmonia.model.families.llava import llava_spec_from_hf, tokenized_sample
    from harmonia.model.mllm import build_mllm_model

    spec = llava_spec_from_hf(config.to_dict()).with_training(vision="frozen")
    model = build_mllm_model(spec).to(device)
    batch = pack_samples([tokenized_sample(spec, ids, px, labels, i) for i, (ids, labels, px) in enumerate(samples)])
    batch = batch.to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=device.type == "cuda")

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model.loss(batch, batch.n_targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return timed(step, device)


def transformers_step(config, samples, device, dtype, accumulate: int = 1):
    """transformers' LLaVA on the samples as a Trainer feeds them: ``accumulate`` padded batches (each
    right-padded to its longest sample, as the Trainer's collators pad) whose losses are averaged."""
    import transformers

    model = transformers.LlavaForConditionalGeneration._from_config(config, attn_implementation="sdpa").to(device)
    model.model.vision_tower.requires_grad_(False)
    per = -(-len(samples) // accumulate)
    batches = [padded_inputs(samples[i:i + per], device) for i in range(0, len(samples), per)]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=device.type == "cuda")

    def step():
        total = 0.0
        for inputs in batches:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = model(**inputs).loss / len(batches)
            loss.backward()
            total += float(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return timed(step, device)


def padded_inputs(samples, device) -> dict[str, torch.Tensor]:
    width = max(ids.numel() for ids, _, _ in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), -100)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for i, (x, y, _) in enumerate(samples):
        ids[i, :x.numel()], labels[i, :x.numel()], mask[i, :x.numel()] = x, y, 1
    pixels = torch.cat([px for _, _, px in samples])
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device),
            "pixel_values": pixels.to(device)}


def timed(step, device) -> dict:
    """Best of 3 steps after one warm-up; peak memory over the steps."""
    step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    best = float("inf")
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
    return {"s": best, "peak": peak, "loss": loss}


def shapes_of(config, samples):
    from harmonia.workload.shapes import ModalityItem, SampleShape

    per_image = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
    return [SampleShape(ids.numel() - per_image, (ModalityItem("image", tiles=1),), sample_id=i)
            for i, (ids, _, _) in enumerate(samples)]


def predicted(spec, shapes, device_name: str) -> tuple[float, float, float]:
    """The cost model's single-GPU step (F + B + W of every module), useful FLOPs, the planner's peak bytes."""
    from harmonia.plan.memory import plan_peak_bytes
    from harmonia.plan.profiling import profile_batches
    from harmonia.schedule.layout import Layout, Placement
    from harmonia.schedule.plan import Plan
    from harmonia.workload.cost import CostModel
    from harmonia.workload.devices import device_preset

    cost = CostModel(spec, device_preset(device_name))
    step = float(cost.sample_costs(shapes).sum())
    plan = Plan(spec.name, {"vision": Layout(), "llm": Layout()}, Placement.COLOCATED, "1f1b", 1,
                global_batch=len(shapes), training={"vision": "frozen"})
    peak = plan_peak_bytes(cost, plan, profile_batches(shapes, cost, len(shapes), n_batches=1))[0]
    return step, cost.model_flops(shapes), peak


def training_table(tiny: bool, device: torch.device) -> tuple[Table, bool]:
    dtype = torch.float32 if tiny else torch.bfloat16
    config = llava_config(tiny)
    samples = make_samples(config, 4 if tiny else 16, (16, 64) if tiny else (64, 1024))
    packed_tokens = sum(ids.numel() for ids, _, _ in samples)
    padded_tokens = len(samples) * max(ids.numel() for ids, _, _ in samples)
    ours = _guarded(lambda: harmonia_step(config, samples, device, dtype))
    held = _free(device)
    theirs = _guarded(lambda: transformers_step(config, samples, device, dtype))
    theirs_2 = None
    if isinstance(theirs, str):  # what a Trainer user does when the batch does not fit: two half batches
        _free(device)
        theirs_2 = _guarded(lambda: transformers_step(config, samples, device, dtype, accumulate=2))
    device_name = preset_of(device)
    from harmonia.model.families.llava import llava_spec_from_hf

    spec = llava_spec_from_hf(config.to_dict()).with_training(vision="frozen")
    step_s, flops, peak_bytes = predicted(spec, shapes_of(config, samples), device_name)
    peak_flops = _peak(device_name)
    n_params = sum(spec.n_params().values())
    table = Table(title=f"one training step, LLaVA {n_params / 1e9:.2f}B (vision frozen), {len(samples)} samples, "
                        f"{packed_tokens} tokens ({padded_tokens} padded), {str(dtype).removeprefix('torch.')} on "
                        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}"
                        + ("" if not held else f" ({held / 2**30:.1f} GiB still allocated after harmonia's step)"))
    for col in ("", "step s", "tokens/s", "MFU", "peak GiB", "loss (own random weights)"):
        table.add_column(col, justify="left" if not col else "right")

    def row(name, result):
        if isinstance(result, str):
            table.add_row(name, result, "", "", "", "")
            return
        secs, peak, loss = result["s"], result["peak"], result["loss"]
        mfu = f"{flops / secs / peak_flops:.1%}" if peak_flops else "-"
        table.add_row(name, f"{secs:.3f}", f"{packed_tokens / secs:,.0f}", mfu,
                      "-" if peak != peak else f"{peak / 2**30:.1f}", "-" if loss is None else f"{loss:.3f}")

    row("harmonia (packed, attention auto)", ours)
    row("transformers (padded, sdpa)", theirs)
    if theirs_2 is not None:
        row("transformers (padded, sdpa), 2 x half batch accumulated", theirs_2)
    row("cost model's prediction (simulator, planner memory)", {"s": step_s, "peak": peak_bytes, "loss": None})
    return table, not isinstance(ours, str)


def _free(device: torch.device) -> int | None:
    """Collect what the last step left and return the bytes still allocated (None on CPU)."""
    import gc

    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def _guarded(run):
    """``run()``'s timing, or the line its exception says (printed with its traceback)."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - the table says which side failed and why
        traceback.print_exc()
        return f"FAIL: {type(e).__name__}: {e}"[:160]


def preset_of(device: torch.device) -> str:
    """The device preset (`harmonia.workload.devices`) of this machine's device."""
    if device.type == "cpu":
        return "cpu"
    return "h200" if "H200" in torch.cuda.get_device_name(device) else "h100"


def _peak(device_name: str) -> float:
    from harmonia.workload.devices import device_preset

    return device_preset(device_name).peak_flops


def sync_table(device: torch.device) -> tuple[Table, bool]:
    """Part 4: `gpu_sync_audit`'s steps of every model, on a GPU with sync debug mode ``error`` while
    their actions run; on CPU (``--tiny``) the same steps, unaudited (no CUDA to watch)."""
    import contextlib

    import gpu_sync_audit as audit

    table = Table(title="host syncs in the actions of a training step (torch.cuda.set_sync_debug_mode)")
    for col in ("model", "verdict"):
        table.add_column(col)
    with audit.one_process_group(device.type):
        if device.type == "cuda":
            verdicts = audit.audit(list(audit.MODELS), 2, "error")
        else:
            verdicts = []
            for name in audit.MODELS:
                got = _guarded(lambda: audit.run_steps(audit.build_job(name, device), 2, lambda b: b,
                                                       contextlib.nullcontext))
                verdicts.append((name, got if isinstance(got, str) else
                                 f"ran {got['steps']} steps, {got['actions']} compute actions timed "
                                 "(no CUDA: syncs not audited)"))
    for name, verdict in verdicts:
        table.add_row(name, verdict)
    return table, not any(v.startswith("FAIL") for _, v in verdicts)


def runtime_runs(tiny: bool, device_name: str) -> list[tuple[str, list[str], float]]:
    """(row, `harmonia train` flags, seconds allowed) of the runs through the whole runtime on this device:
    a tiny job with its blocks compiled (``auto`` on a GPU), and on a GPU the same eager and a real-size
    one (an 8B LLaVA, LoRA on its LLM: the base in bf16, built shard by shard), whose allocator peak
    is the planner's memory estimate checked at size."""
    one = [f"--parallel.cluster={device_name}:1x1", "--parallel.world_size=1", "--log.every=1"]
    flags = [*one, "--model.preset=tiny-vlm", "--data.synthesize=256", "--data.heldout=32",
             f"--train.steps={6 if tiny else 30}", "--train.global_batch=16"]
    runs = [("tiny-vlm (attention auto, compile auto)", flags, 150.0)]
    if tiny:
        return runs
    real = [*one, "--model.preset=llava-siglip-8b", "--model.lora=llm", "--data.synthesize=32", "--data.heldout=0",
            "--train.steps=4", "--train.global_batch=8"]
    return [("tiny-vlm (attention auto, compile off)", [*flags, "--train.compile=off"], 90.0), *runs,
            ("llava-siglip-8b, LoRA on the LLM (real size)", real, 300.0)]


def runtime_table(tiny: bool, device_name: str, deadline: float) -> tuple[Table, bool]:
    """Each run of `runtime_runs` as a user starts it (one process, this device), read back from its
    metrics.jsonl: wall-clock throughput, the last step measured beside the simulator, the allocator's
    peak beside the planner's estimate, start-up."""
    table = Table(title=f"harmonia train through the whole runtime, one process on {device_name}")
    for col in ("run", "exit", "steps", "loss first -> last", "tokens/s (wall)", "last step s (simulated)",
                "peak GiB (planned)", "start-up s"):
        table.add_column(col, justify="left" if col == "run" else "right")
    ok = True
    for name, flags, allowed in runtime_runs(tiny, device_name):
        allowed = min(allowed, deadline - time.monotonic() - 15)
        if allowed < 60:
            table.add_row(name, "not run: the check's time is spent", *[""] * 6)
            continue
        rc, records, startup = _train(flags, allowed)
        ok &= rc == 0
        if not records:
            table.add_row(name, str(rc), "0", *[""] * 5)
            continue
        last = records[-1]
        peak, planned = (last.get(k, [0])[0] for k in ("memory_peak_bytes", "memory_predicted_bytes"))
        table.add_row(name, str(rc), str(len(records)), f"{records[0]['loss']:.3f} -> {last['loss']:.3f}",
                      f"{last['tokens_per_s']:,.0f}", f"{last['step_s']:.3f} ({last.get('simulated_step_s', 0):.3f})",
                      f"{peak / 2**30:.2f} ({planned / 2**30:.2f})" if peak else "-", f"{sum(startup.values()):.1f}")
    return table, ok


def _train(flags: list[str], allowed: float) -> tuple[int, list[dict], dict]:
    """Exit code, metrics.jsonl's records and the start-up phases of one `harmonia train` in a scratch dir."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "harmonia", "train", *flags, f"--data.path={tmp}/data",
               f"--log.dir={tmp}/log", f"--checkpoint.dir={tmp}/checkpoints", "--log.tensorboard=false"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        try:
            run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=allowed)
            rc, out = run.returncode, run.stdout + run.stderr
        except subprocess.TimeoutExpired as e:
            rc, out = 124, (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        print(out[-6000:] if rc else out[-1500:], file=sys.stderr)
        log = Path(tmp) / "log"
        records = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()
                   if '"loss"' in line] if (log / "metrics.jsonl").exists() else []
        summary = json.loads((log / "summary.json").read_text()) if (log / "summary.json").exists() else {}
        return rc, records, summary.get("startup") or {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny widths on CPU (CI)")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the whole check (default 480)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run, of {PARTS} (default all); a subset saves "
                             "gpu-check-PARTS-DATE.txt")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget
    console = Console(record=True, width=170)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type == "cpu" and not args.tiny:
        console.print("no GPU here: run with --tiny for the CPU smoke run")
        return 2
    dtype, tol = (torch.float32, 1e-5) if device.type == "cpu" else (torch.bfloat16, 2e-2)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    console.print(f"torch {torch.__version__}, {label}")
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts {unknown} are not parts; pick from {PARTS}")
    name = "gpu-check" if set(parts) == set(PARTS) else "gpu-check-" + "-".join(parts)
    ok = stepped = synced = ran = True
    if "kernels" in parts:
        parity, ok = kernel_parity(device, dtype, 512 if args.tiny else 8192, tol)
        console.print(parity)
    if "step" in parts:
        table, stepped = training_table(args.tiny, device)
        console.print(table)
    if "syncs" in parts:
        table, synced = sync_table(device)
        console.print(table)
    if device.type == "cuda":
        save_table(console, name)  # what is measured so far is kept, whatever the runs below do
        torch.cuda.empty_cache()
    if "runtime" in parts:
        device_name = preset_of(device)
        runtime, ran = runtime_table(args.tiny, device_name, deadline)
        console.print(runtime)
        if device.type == "cuda":
            save_table(console, name)
    return 0 if ok and stepped and synced and ran else 1


if __name__ == "__main__":
    sys.exit(main())
