"""transformers' side of `benchmarks/peer.py`: each record rendered, tokenised and labelled as harmonia
labels it, collated, the checkpoints' models and processors, the answer loss, and the ``Trainer``
worker (``python benchmarks/peer.py --trainer-worker SETTINGS``, one process per rank)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

IMAGE = "<image>"
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


# -- transformers' inputs, labelled as harmonia labels them -----------------------------------------
def chat_messages(conversations: list[dict]) -> list[dict]:
    """Chat messages of a LLaVA conversation, each ``<image>`` an image part."""
    msgs = []
    for turn in conversations:
        parts: list[dict] = []
        for i, piece in enumerate(turn["value"].split(IMAGE)):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        msgs.append({"role": ROLES[turn["from"]], "content": parts})
    return msgs


def assistant_spans(processor, msgs: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and, per assistant turn, the characters from the end of the
    rendering of the turns before it with the generation prompt to the end of its own rendering
    (trailing whitespace dropped): its content and the end-of-turn token."""
    text = processor.apply_chat_template(msgs)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            before = processor.apply_chat_template(msgs[:i], add_generation_prompt=True)
            upto = processor.apply_chat_template(msgs[: i + 1])
            spans.append((len(before), len(upto.rstrip())))
    return text, spans


def encode_row(processor, row: dict, root: Path) -> dict:
    """One record as the processor makes it (``input_ids`` with each image's tokens, ``pixel_values``)
    and ``labels``: the tokens overlapping an assistant span, image tokens never.

    Raises:
        ValueError: the labelled tokens are not the processor's tokens.
    """
    import torch
    from PIL import Image

    text, spans = assistant_spans(processor, chat_messages(row["conversations"]))
    names = row.get("image") or []
    names = names if isinstance(names, list) else [names]
    images = [Image.open(root / n).convert("RGB") for n in names]
    batch = processor(images=images or None, text=[text], return_tensors="pt")
    want = batch["input_ids"][0].tolist()
    tok = processor.tokenizer
    image_id = tok.convert_tokens_to_ids(getattr(processor, "image_token", IMAGE))
    counts = iter(_image_runs(want, image_id, len(images)))
    enc = tok(text, return_offsets_mapping=True)
    ids, labels = [], []
    for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]):
        if t == image_id:
            n = next(counts)
            ids += [t] * n
            labels += [-100] * n
        else:
            ids.append(t)
            labels.append(t if any(a < e and b > s for s, e in spans) else -100)
    if ids != want:
        raise ValueError(f"record {row.get('id')}: tokenising the rendered text does not give the processor's tokens")
    out = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}
    if images:
        out["pixel_values"] = batch["pixel_values"]  # (n_images, 3, H, W); Qwen-VL: (patches, C T P P)
        if "image_grid_thw" in batch:
            out["image_grid_thw"] = batch["image_grid_thw"]  # (n_images, 3)
    if "mm_token_type_ids" in batch:
        out["mm_token_type_ids"] = (out["input_ids"] == image_id).long()  # (T,) 1 on image tokens
    return out


def _image_runs(ids: list[int], image_id: int, n_images: int) -> list[int]:
    """Each image's number of tokens in the processor's ``ids``: its run of ``image_id`` (images of
    different sizes, Qwen-VL's native resolution), or an even share where runs touch."""
    runs, previous = [], None
    for t in ids:
        if t == image_id:
            if previous == image_id:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = t
    return runs if len(runs) == n_images else [sum(runs) // max(1, n_images)] * n_images


def collate(features: list[dict], pad_id: int) -> dict:
    """Right-pad a batch to its longest record; images of all records in order."""
    import torch

    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(features), longest), -100, dtype=torch.long)
    mask = torch.zeros((len(features), longest), dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = f["input_ids"], f["labels"], 1
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if "mm_token_type_ids" in features[0]:
        types = torch.zeros((len(features), longest), dtype=torch.long)
        for i, f in enumerate(features):
            types[i, :len(f["input_ids"])] = f["mm_token_type_ids"]
        batch["mm_token_type_ids"] = types
    for key in ("pixel_values", "image_grid_thw"):
        found = [f[key] for f in features if key in f]
        if found:
            batch[key] = torch.cat(found)
    return batch


class QwenImageProcessor:
    """Qwen2.5-VL's processor for images alone (transformers' whole one builds a video processor that
    needs torchvision): the checkpoint's tokenizer and chat template and its image processor, each
    image pad repeated for its grid (``t h w / merge_size**2`` tokens), as ``Qwen2_5_VLProcessor``
    does; ``mm_token_type_ids`` 1 on image tokens."""

    image_token = "<|image_pad|>"

    def __init__(self, path: Path | str) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.image_processor = AutoImageProcessor.from_pretrained(path)

    def apply_chat_template(self, msgs: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=False)

    def __call__(self, images, text: list[str], return_tensors: str = "pt") -> dict:
        media = dict(self.image_processor(images=images, return_tensors=return_tensors)) if images else {}
        (rendered,) = text
        merge = self.image_processor.merge_size ** 2
        for grid in media.get("image_grid_thw", []):
            rendered = rendered.replace(self.image_token, "\0" * (int(grid.prod()) // merge), 1)
        enc = self.tokenizer([rendered.replace("\0", self.image_token)], return_tensors=return_tensors)
        image_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        return {**enc, **media, "mm_token_type_ids": (enc["input_ids"] == image_id).long()}


def load_processor(model_dir: Path | str):
    """The checkpoint's processor (`QwenImageProcessor` for Qwen-VL)."""
    from transformers import AutoConfig, AutoProcessor

    if AutoConfig.from_pretrained(model_dir).model_type.startswith("qwen"):
        return QwenImageProcessor(model_dir)
    return AutoProcessor.from_pretrained(model_dir)


def load_model(model_dir: Path | str):
    """transformers' image-text-to-text model of a checkpoint (LLaVA, Qwen2.5-VL), in fp32."""
    import torch
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)


def freeze_vision(model) -> None:
    """``requires_grad`` off for what harmonia's ``model.frozen = ["vision"]`` freezes: LLaVA's vision
    tower; Qwen-VL's tower without its merger (harmonia's trained projector ``vision_proj``)."""
    inner = model.model
    if hasattr(inner, "vision_tower"):
        inner.vision_tower.requires_grad_(False)
        return
    for name, param in inner.visual.named_parameters():
        param.requires_grad_(name.startswith("merger."))


def answer_loss(model_dir: Path, encoded: list[dict]) -> float:
    """Cross-entropy per learned token over ``encoded`` records, by transformers' model from ``model_dir``."""
    import torch

    model = load_model(model_dir).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for r in encoded:
            inputs = {k: v.unsqueeze(0) if k in ("input_ids", "mm_token_type_ids") else v for k, v in r.items()
                      if k != "labels"}
            logits = model(**inputs).logits[0, :-1]  # (T-1, vocab)
            target = r["labels"][1:]
            total += float(torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum"))
            count += int((target != -100).sum())
    return total / max(count, 1)


# -- the Trainer's side (run as its own process, or one per rank under torchrun) --------------------
def trainer_worker(settings_path: str) -> None:
    """Train with transformers' ``Trainer`` as ``settings`` say; rank 0 saves the model and every
    rank writes its window, samples and tokens to ``out/rank-<r>.json``."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    s = json.loads(Path(settings_path).read_text())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    out = Path(s["out"])
    model = load_model(s["base"])
    freeze_vision(model)
    processor = load_processor(s["base"])
    rows_path = Path(s["rows"])
    dataset = [encode_row(processor, row, rows_path.parent) for row in json.loads(rows_path.read_text())]
    seen = {"samples": 0, "tokens": 0, "padded": 0}

    def count(_module, _args, kwargs):
        seen["samples"] += int(kwargs["input_ids"].shape[0])
        seen["tokens"] += int(kwargs["attention_mask"].sum())
        seen["padded"] += int(kwargs["input_ids"].numel())

    model.register_forward_pre_hook(count, with_kwargs=True)

    class Clock(TrainerCallback):
        """Wall clock of the first step's start, of the training's end and of the time inside steps;
        rank 0 writes one line per finished step to ``steps.jsonl`` (what the parent samples CPU
        time against)."""

        first = end = begun = None
        in_steps = 0.0

        def on_step_begin(self, args, state, control, **kw):
            Clock.begun = time.time()
            if Clock.first is None:
                Clock.first = Clock.begun

        def on_step_end(self, args, state, control, **kw):
            Clock.in_steps += time.time() - Clock.begun
            if rank == 0:
                with open(out / "steps.jsonl", "a") as f:
                    f.write(json.dumps({"step": state.global_step, "elapsed_s": time.time() - Clock.first}) + "\n")

        def on_train_end(self, args, state, control, **kw):
            Clock.end = time.time()

    args = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=s["steps"], per_device_train_batch_size=s["global_batch"] // world,
        learning_rate=s["lr"], warmup_steps=s["warmup"], lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": s["min_lr_ratio"]}, weight_decay=0.0, max_grad_norm=1.0,
        seed=s["seed"], use_cpu=True, ddp_backend="gloo" if world > 1 else None, dataloader_num_workers=0,
        logging_strategy="steps", logging_steps=s["log_every"], save_strategy="no", eval_strategy="no",
        report_to="none", disable_tqdm=True,
        remove_unused_columns=False)
    pad = processor.tokenizer.pad_token_id
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=lambda f: collate(f, pad),
                      callbacks=[Clock()])
    trainer.train()
    trainer.save_model(str(out / "model"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    (out / f"rank-{rank}.json").write_text(json.dumps({
        "first_step_at": Clock.first, "end_at": Clock.end, "in_steps_s": Clock.in_steps, **seen,
        "trainable": trainable, "threads": torch.get_num_threads()}))
