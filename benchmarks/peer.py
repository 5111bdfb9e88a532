"""harmonia against transformers' `Trainer` on the same tiny VLMs, the same data and the same schedule.

transformers' ``Trainer`` is the engine under LLaMA-Factory, ms-swift and most fine-tuning scripts, so
it is what a user of harmonia would otherwise run. Both sides here train the same checkpoint, each
of ``--models``: ``llava`` (`harmonia.train.tiny_llava.write_tiny_llava`: a
``LlavaForConditionalGeneration`` with a CLIP tower, a Llama text model, a ChatML template and a
processor) and ``qwen2_5_vl`` (`harmonia.train.tiny_qwen_vl.write_tiny_qwen_vl`: a
``Qwen2_5_VLForConditionalGeneration``, its native-resolution tower with windows, merger and
multimodal RoPE, and its processor), vision tower frozen (Qwen-VL's merger trains, as harmonia's
projector), projector and LLM trained, with AdamW at the same peak lr, warm-up steps, cosine decay
to 0.1 x lr, gradient clipping at 1.0, global batch and number of steps, in fp32 on the CPU, on two
datasets:

- ``llava``: `harmonia.data.synth.write_synthetic_dataset` in LLaVA JSON (one image or none, one
  question, a one-word answer: every sample about the same size);
- ``varied``: LLaVA JSON records built here from the same tasks, half short (one image, one turn)
  and half long (2-4 images, each in a turn of its own, and 2-6 text turns between them), so
  sample lengths vary by about 5x and padding, packing and balancing matter.

harmonia runs as a user runs it: ``harmonia train --config job.toml`` (``model.hf`` the checkpoint,
``model.frozen = ["vision"]``, TensorBoard off, everything else its defaults, the plan its own
search's); it saves a checkpoint at the end, which ``harmonia export`` turns into an HF directory.
The Trainer runs as ``python benchmarks/peer.py --trainer-worker SETTINGS`` (`peer_hf`; two processes:
torchrun, gloo DDP with transformers' defaults): ``from_pretrained``, the vision tower's
``requires_grad`` off, every record rendered with the checkpoint's processor and chat template and
labelled as harmonia labels it (every assistant turn's content and its end-of-turn token;
`harmonia.data.chat`), padded per batch by a collator; no evaluation or saving in the loop,
``dataloader_num_workers=0``, ``use_cpu=True``, ``save_model`` at the end. Both log every
``--log-every`` steps (default 10, torchtitan's default and LLaMA-Factory's examples'): harmonia's
``log.every`` (a ``metrics.jsonl`` record, the step line), the Trainer's ``logging_steps`` (its loss,
gradient norm and lr, printed). Its schedule is
transformers' ``cosine_with_min_lr`` (``min_lr_rate=0.1``), which starts its warm-up at lr 0 where
harmonia starts at ``lr / warmup``: the one difference of schedule.

Measured per run, the same way for both (``OMP_NUM_THREADS`` set alike, cores // processes):

- samples/s and tokens/s: samples and real (unpadded) LLM tokens, image tokens included, over the
  wall-clock window from the first step's start to the last step's end on rank 0 (harmonia's own
  ``summary.json`` throughput; on the Trainer's side a callback's clock and a hook on the model's
  inputs);
- start-up: from starting the command to the first step's start (harmonia: the first
  ``metrics.jsonl`` record seen less its ``elapsed_s``; Trainer: the callback);
- CPU-s/step: CPU seconds of the whole process tree, sampled from ``/proc`` every 0.1 s, between
  the first and the last step record seen (harmonia's logged steps, the Trainer callback's every
  step), per step; CPU-s command: ``RUSAGE_CHILDREN`` (this process
  adopts and reaps what the command leaves orphaned, e.g. harmonia's fork server) over the
  whole command (start-up and saving included);
- peak RSS: the largest sum over the process tree of proportional resident memory (``Pss``: a page
  shared by processes counted once), sampled every 0.1 s in one more run of each tool and
  configuration, whose other figures are not counted: reading ``Pss`` slows the process read
  (`proctree`), by 12-20% of a 2-process job's samples/s here, so the timed runs do not sample it;
- answer loss: mean cross-entropy per learned token on held-out records, computed by transformers
  itself from the trained weights (harmonia's export, the Trainer's saved model) of the first run
  of each tool and configuration (both train deterministically from the same seed).

Every configuration runs ``--reps`` times, harmonia and the Trainer alternating (ABBA), then once
more each for its memory; the table shows medians, and every run is listed below it.

    python benchmarks/peer.py [--quick] [--reps 2] [--steps 40] [--processes 1,2] [--log-every 10]
        [--datasets llava,varied] [--models llava,qwen2_5_vl]
        [--harmonia-set parallel.llm_pp=1 ...]

The table goes to stdout and (without ``--quick``) to ``benchmarks/results/peer-<date>.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peer_hf import answer_loss, encode_row, load_processor, trainer_worker
from proctree import watch, window_cpu_per_step

ROOT = Path(__file__).resolve().parents[1]


# -- the varied dataset -----------------------------------------------------------------------------
def write_varied_dataset(out: Path, n_train: int, n_heldout: int, seed: int = 0, tile: int = 32) -> Path:
    """``out/{train,heldout}/llava.json`` and ``images/``: half short records (one image, one turn),
    half long ones (2-4 images in turns of their own and 2-6 arithmetic turns, in random order).

    Images and answers come from `harmonia.data.synth.make_sample` (colour and count tasks), so the
    set is as learnable as the synthetic one; the same ``seed`` writes the same files.
    """
    import numpy as np

    from harmonia.data.synth import make_sample

    rng = np.random.default_rng(seed)
    for split, n in (("heldout", n_heldout), ("train", n_train)):
        (out / split / "images").mkdir(parents=True, exist_ok=True)
        rows = []
        for i in range(n):
            long = rng.random() < 0.5
            n_images, n_text = (int(rng.integers(2, 5)), int(rng.integers(2, 7))) if long else (1, 0)
            kinds = ["image"] * n_images + ["text"] * n_text
            kinds = [kinds[j] for j in rng.permutation(len(kinds))]
            conversations, images = [], []
            for k, kind in enumerate(kinds):
                if kind == "image":
                    key = f"{split}{i:05d}-{k}"
                    rec, files = make_sample(rng, key, str(rng.choice(["colour", "count"])), tile)
                    for name, data in files.items():
                        (out / split / "images" / name).write_bytes(data)
                        images.append(f"images/{name}")
                    question, answer = rec["prompt"], rec["answer"]
                else:
                    a, b = int(rng.integers(0, 5)), int(rng.integers(0, 5))
                    question, answer = f"What is {a}+{b}?", str(a + b)
                conversations += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
            rows.append({"id": f"{split}{i:05d}", "task": "long" if long else "short",
                         "conversations": conversations, "image": images})
        (out / split / "llava.json").write_text(json.dumps(rows, indent=1))
    return out


# -- one run of each tool --------------------------------------------------------------------------
def run_harmonia(s: dict, procs: int, work: Path, env: dict, overrides: list[str], export: bool,
                 memory: bool = False) -> dict:
    """``harmonia train`` (then, with ``export``, ``harmonia export``); its numbers from ``summary.json``;
    its memory sampled with ``memory`` (`proctree.watch`)."""
    from harmonia.plan.layout_text import describe_layouts
    from harmonia.schedule.plan import Plan

    sections = {
        "model": {"hf": s["base"], "frozen": ["vision"]},
        "data": {"path": s["rows"]},
        "parallel": {"world_size": procs},
        "train": {"steps": s["steps"], "global_batch": s["global_batch"], "lr": s["lr"], "warmup": s["warmup"],
                  "lr_schedule": "cosine", "min_lr_ratio": s["min_lr_ratio"], "max_norm": 1.0, "seed": s["seed"]},
        "checkpoint": {"dir": str(work / "checkpoints")},
        "log": {"dir": str(work / "run"), "tensorboard": False, "every": s["log_every"]},
    }
    job = work / "job.toml"
    job.write_text("".join(f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()) + "\n"
                           for name, keys in sections.items()))
    cmd = [sys.executable, "-m", "harmonia", "train", "--config", str(job), *(f"--{o}" for o in overrides)]
    w = watch(cmd, env, work / "train.log", work / "run" / "metrics.jsonl", memory=memory)
    summary = json.loads((work / "run" / "summary.json").read_text())
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    n_first = min(w["marks"]) if w["marks"] else None
    first_step_at = w["marks"][n_first][0] - records[n_first - 1]["elapsed_s"] if n_first else None
    if export:
        subprocess.run([sys.executable, "-m", "harmonia", "export", "--checkpoint", str(work / "checkpoints"),
                        "--out", str(work / "export")], cwd=ROOT, env=env, check=True, capture_output=True)
    t = summary["throughput"]
    plan = Plan.from_json(json.dumps(summary["plan"]))
    logged = {n + 1: r["step"] + 1 for n, r in enumerate(records)}  # metrics.jsonl lines -> steps done
    return {"samples_per_s": t["samples_per_s"], "tokens_per_s": t["tokens_per_s"], "tokens": t["tokens"],
            "samples": t["samples"], "startup_s": first_step_at - w["started"] if first_step_at else None,
            "cpu_step_s": window_cpu_per_step({logged[n]: v for n, v in w["marks"].items() if n in logged}),
            "cpu_command_s": w["cpu_command_s"], "peak_mib": _mib(w["peak_bytes"]), "command_s": w["wall_s"],
            "model": work / "export", "phases": summary.get("startup") or {},
            "outside_steps_s": t["elapsed_s"] - t["in_steps_s"],
            "plan": f"{describe_layouts(plan.layouts)}; {plan.schedule}, {plan.n_microbatches} microbatches"}


def run_trainer(s: dict, procs: int, work: Path, env: dict, memory: bool = False) -> dict:
    """The Trainer worker on one process, or on ``procs`` under torchrun; its memory sampled with
    ``memory`` (`proctree.watch`)."""
    settings = work / "settings.json"
    settings.write_text(json.dumps({**s, "out": str(work)}))
    script = [str(Path(__file__).resolve()), "--trainer-worker", str(settings)]
    cmd = ([sys.executable, *script] if procs == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", *script])
    w = watch(cmd, env, work / "train.log", work / "steps.jsonl", memory=memory)
    ranks = [json.loads((work / f"rank-{r}.json").read_text()) for r in range(procs)]
    window = ranks[0]["end_at"] - ranks[0]["first_step_at"]
    samples, tokens = sum(r["samples"] for r in ranks), sum(r["tokens"] for r in ranks)
    return {"samples_per_s": samples / window, "tokens_per_s": tokens / window, "tokens": tokens, "samples": samples,
            "startup_s": ranks[0]["first_step_at"] - w["started"], "cpu_step_s": window_cpu_per_step(w["marks"]),
            "cpu_command_s": w["cpu_command_s"], "peak_mib": _mib(w["peak_bytes"]), "command_s": w["wall_s"],
            "model": work / "model", "outside_steps_s": window - ranks[0]["in_steps_s"],
            "padding": 1 - tokens / max(1, sum(r["padded"] for r in ranks)),
            "trainable": ranks[0]["trainable"], "threads": ranks[0]["threads"]}


def _mib(n_bytes: int | None) -> float | None:
    return None if n_bytes is None else n_bytes / 2**20


# -- the table -------------------------------------------------------------------------------------
COLUMNS = {  # key -> (header, format)
    "samples_per_s": ("samples/s", "{:.1f}"), "tokens_per_s": ("tokens/s", "{:.0f}"),
    "startup_s": ("start-up s", "{:.1f}"), "cpu_step_s": ("CPU-s/step", "{:.3f}"),
    "cpu_command_s": ("CPU-s command", "{:.1f}"), "peak_mib": ("peak RSS MiB", "{:.0f}"),
    "loss": ("answer loss", "{:.3f}"), "command_s": ("command s", "{:.1f}"),
}


LEGEND = ("samples/s, tokens/s: rank 0's wall-clock window from the first step's start to the last step's end; "
          "tokens: real LLM tokens (image tokens included, no padding). start-up: command start to the first step. "
          "CPU-s/step: the process tree's CPU between the first and the last step record, per step; CPU-s command: "
          "the whole command. peak RSS: the process tree's summed Pss, in a run of its own (sampling it slows the "
          "run). answer loss: transformers' cross-entropy per "
          "learned token on the held-out records (first run of each). command s: the training command end to end "
          "(harmonia's export not included).")


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def build_table(results: dict, datasets: list[str], processes: list[int], threads: dict[int, int]):
    from rich.table import Table

    table = Table(title="harmonia vs transformers' Trainer: median over runs; ratio = harmonia / Trainer")
    for col in ("dataset", "processes", "tool", *(h for h, _ in COLUMNS.values())):
        table.add_column(col, justify="left" if col in ("dataset", "tool") else "right")
    for name in datasets:
        for p in processes:
            med = {tool: {k: _median(results[name, p, tool], k) for k in COLUMNS} for tool in ("harmonia", "Trainer")}
            for tool in ("harmonia", "Trainer"):
                table.add_row(name, f"{p} (OMP {threads[p]})", tool,
                              *(_cell(med[tool][k], fmt) for k, (_, fmt) in COLUMNS.items()))
            ratio = {k: med["harmonia"][k] / med["Trainer"][k] if med["harmonia"][k] is not None
                     and med["Trainer"][k] else None for k in COLUMNS}
            table.add_row(name, str(p), "[bold]ratio[/bold]", *(_cell(ratio[k], "{:.2f}x") for k in COLUMNS),
                          end_section=True)
    return table


def run_lines(results: dict) -> list[str]:
    """Every run's numbers, and what each side reported about itself."""
    lines = []
    for (name, p, tool), runs in results.items():
        for i, r in enumerate(runs):
            if r.get("memory_run"):
                lines.append(f"{name} {p}p {tool} memory run: peak RSS MiB {_cell(r['peak_mib'], '{:.0f}')}")
                continue
            vals = ", ".join(f"{COLUMNS[k][0]} {_cell(r.get(k), COLUMNS[k][1])}" for k in COLUMNS)
            extra = (f"; {r['tokens'] / r['samples']:.1f} tokens/sample; {r['outside_steps_s']:.2f} s of the window "
                     "outside the steps")
            if tool == "harmonia":
                phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
                before = r["startup_s"] - sum(r["phases"].values()) if r["startup_s"] is not None else None
                extra += (f"; plan {r['plan']}; start-up phases (s): not in them (interpreter, imports, config) "
                          f"{_cell(before, '{:.2f}')}, {phases}")
            else:
                extra += (f"; padding {r['padding']:.0%} of batch tokens; {r['trainable']:,} trainable parameters; "
                          f"{r['threads']} threads")
            lines.append(f"{name} {p}p {tool} run {i + 1}: {vals}{extra}")
    return lines


# -- main ------------------------------------------------------------------------------------------
MODELS = ("llava", "qwen2_5_vl")


def prepare(tmp: Path, n_train: int, n_heldout: int, models: list[str]) -> tuple[dict[str, Path], dict[str, Path]]:
    """Each model's checkpoint and each dataset's directory (``train/llava.json``, ``heldout/llava.json``)."""
    from harmonia.data.synth import write_synthetic_dataset
    from harmonia.train.tiny_llava import write_tiny_llava
    from harmonia.train.tiny_qwen_vl import write_tiny_qwen_vl

    writers = {"llava": lambda out: write_tiny_llava(out), "qwen2_5_vl": lambda out: write_tiny_qwen_vl(out)}
    bases = {m: writers[m](tmp / ("base" if m == "llava" else m)) for m in models}
    n = n_train + n_heldout
    llava = write_synthetic_dataset(tmp / "llava", n, seed=0, heldout=n_heldout / n, tile=32, fmt="llava")
    varied = write_varied_dataset(tmp / "varied", n_train, n_heldout, seed=0, tile=32)
    return bases, {"llava": llava, "varied": varied}


def row_name(dataset: str, model: str) -> str:
    """A table row's name: the dataset, and the model where it is not the tiny LLaVA."""
    return dataset if model == "llava" else f"{dataset} ({model})"


def run_dataset(a: argparse.Namespace, dataset: str, model: str, base: Path, root: Path, work: Path,
                console) -> dict:
    """Every process count's runs on one dataset, the tools alternating (ABBA), then each tool's memory
    run; the first run of each tool scored by transformers on the held-out records (both tools train
    deterministically from the same seed). Returns (dataset, processes, tool) -> runs (a memory run:
    ``memory_run`` and ``peak_mib`` only)."""
    name = row_name(dataset, model)
    processor = load_processor(base)
    heldout_path = root / "heldout" / "llava.json"
    heldout = [encode_row(processor, row, heldout_path.parent) for row in json.loads(heldout_path.read_text())]
    console.print(f"{name}: answer loss of the initial checkpoint {answer_loss(base, heldout):.3f}", highlight=False)
    s = {"base": str(base), "rows": str(root / "train" / "llava.json"), "steps": a.steps,
         "global_batch": a.global_batch, "lr": a.lr, "warmup": a.warmup, "min_lr_ratio": 0.1, "seed": 0,
         "log_every": a.log_every}
    results: dict[tuple[str, int, str], list[dict]] = {}
    for procs in a.processes:
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads[procs]), "HF_HUB_OFFLINE": "1"}
        for rep in range(a.reps):
            for tool in (("harmonia", "Trainer") if rep % 2 == 0 else ("Trainer", "harmonia")):
                run_dir = work / f"{dataset}-{model}-{procs}p-{tool}-{rep}"
                run_dir.mkdir(parents=True)
                r = (run_harmonia(s, procs, run_dir, env, a.harmonia_set, export=rep == 0) if tool == "harmonia"
                     else run_trainer(s, procs, run_dir, env))
                r["loss"] = answer_loss(r["model"], heldout) if rep == 0 else None
                results.setdefault((name, procs, tool), []).append(r)
                console.print(f"{name} {procs}p {tool} run {rep + 1}: {r['samples_per_s']:.1f} samples/s, start-up "
                              f"{_cell(r['startup_s'], '{:.1f}')} s, answer loss {_cell(r['loss'], '{:.3f}')}",
                              highlight=False)
        for tool in ("harmonia", "Trainer"):  # memory alone: sampling it slows the run (`proctree`)
            run_dir = work / f"{dataset}-{model}-{procs}p-{tool}-memory"
            run_dir.mkdir(parents=True)
            r = (run_harmonia(s, procs, run_dir, env, a.harmonia_set, export=False, memory=True)
                 if tool == "harmonia" else run_trainer(s, procs, run_dir, env, memory=True))
            results[name, procs, tool].append({"memory_run": True, "peak_mib": r["peak_mib"]})
            console.print(f"{name} {procs}p {tool} memory run: peak RSS {r['peak_mib']:.0f} MiB", highlight=False)
    return results


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="6 steps, one run each, 8 held-out records; nothing saved")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 40; --quick 6)")
    p.add_argument("--global-batch", type=int, default=8, help="samples per step over all processes")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 4; --quick 2)")
    p.add_argument("--samples", type=int, default=160, help="training records per dataset")
    p.add_argument("--heldout", type=int, default=None, help="held-out records for the answer loss (default 24)")
    p.add_argument("--reps", type=int, default=None, help="runs per configuration and tool (default 2; --quick 1)")
    p.add_argument("--processes", default="1,2", help="process counts, comma-separated")
    p.add_argument("--datasets", default="llava,varied", help="llava and/or varied, comma-separated")
    p.add_argument("--models", default=",".join(MODELS),
                   help="tiny checkpoints: llava (CLIP + Llama) and/or qwen2_5_vl (Qwen2.5-VL), comma-separated")
    p.add_argument("--log-every", type=int, default=10, help="both tools log every N steps (default 10)")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS per process (0 = cores // processes)")
    p.add_argument("--harmonia-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a config override for every harmonia run (repeatable), e.g. parallel.llm_pp=1")
    p.add_argument("--keep", default=None, help="keep the checkpoint, data and run directories here")
    p.add_argument("--trainer-worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    a.steps = a.steps or (6 if a.quick else 40)
    a.warmup = a.warmup if a.warmup is not None else (2 if a.quick else 4)
    a.reps = a.reps or (1 if a.quick else 2)
    a.heldout = a.heldout or (8 if a.quick else 24)
    a.processes = [int(x) for x in a.processes.split(",")]
    a.datasets = a.datasets.split(",")
    unknown = set(a.datasets) - {"llava", "varied"}
    if unknown:
        p.error(f"unknown datasets {sorted(unknown)}: expected llava and/or varied")
    a.models = a.models.split(",")
    unknown = set(a.models) - set(MODELS)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}: expected {' and/or '.join(MODELS)}")
    a.threads = {n: a.threads or max(1, (os.cpu_count() or 1) // n) for n in a.processes}
    return a


def main() -> int:
    a = parse_args()
    if a.trainer_worker:
        trainer_worker(a.trainer_worker)
        # what it measured is written: no teardown (DDP's gloo group, freed at exit under torch 2.13 and
        # transformers 5.24, aborted one rank and hung another joining its threads)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    import torch
    import transformers
    from rich.console import Console

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    console = Console(record=True, width=170)
    console.print(f"$ {shlex.join(['python', 'benchmarks/peer.py', *sys.argv[1:]])}", highlight=False)
    console.print(f"harmonia vs transformers' Trainer on tiny VLMs ({', '.join(a.models)}; vision frozen), "
                  f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, torch {torch.__version__}, transformers "
                  f"{transformers.__version__}, fp32, gloo", highlight=False)
    console.print(f"{a.steps} steps, global batch {a.global_batch}, AdamW lr {a.lr:g}, {a.warmup} warm-up steps, "
                  f"cosine to 0.1 x lr, clip 1.0, seed 0, both logging every {a.log_every} steps; {a.samples} training "
                  f"and {a.heldout} held-out records per dataset; {a.reps} run(s) per tool and configuration, "
                  f"alternating; OMP_NUM_THREADS "
                  f"{', '.join(f'{t} at {n} process(es)' for n, t in a.threads.items())}, for both tools"
                  + (f"; harmonia overrides: {' '.join(a.harmonia_set)}" if a.harmonia_set else ""), highlight=False)
    with tempfile.TemporaryDirectory(prefix="harmonia-peer-") as scratch:
        tmp = Path(a.keep or scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        bases, dirs = prepare(tmp, a.samples, a.heldout, a.models)
        results = {}
        for model in a.models:
            for dataset in a.datasets:
                results.update(run_dataset(a, dataset, model, bases[model], dirs[dataset], tmp / "runs", console))
    rows = [row_name(d, m) for m in a.models for d in a.datasets]
    console.print(build_table(results, rows, a.processes, a.threads))
    for line in run_lines(results):
        console.print(line, highlight=False, soft_wrap=True)
    console.print(LEGEND, highlight=False)
    if not a.quick:
        from saved import save_table

        save_table(console, "peer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
