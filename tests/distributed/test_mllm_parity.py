"""The MLLM executor trains tiny-omni (vision + audio encoders, projectors, LLM) exactly as one process does.

Every layout (on 1, 2, 4 or 8 processes) runs 3 optimizer steps (SGD with momentum, a global-norm
clip over all modules that binds) on variable microbatches: each step's samples differ in text
length, image tiles and audio length, each global microbatch in sample count (at random, or from
the balancer), and each encoder deals its samples to its own DP replicas independently of the LLM
(or leaves one replica idle, to check that its collectives still match its peers'). Two training setups cover the frozen paths: ``audio-frozen``
(frozen audio encoder, trainable projector: W only on its last stage) and ``vision-frozen`` (frozen
vision encoder and projector: no backward at all). The ``llava`` cases run an HF architecture instead:
a LLaVA (CLIP tower cut at ``vision_feature_layer=-2``, CLS dropped, GELU projector, causal image
tokens) over a Qwen3 text model (per-head q/k norms, tied embeddings), its spec read from the config
as for a checkpoint, with the tower frozen as LLaVA's instruction tuning does. The ``qwen`` cases run
a Qwen2.5-VL (native-resolution tower with windows over packed patches of images of any size, the
merger as projector, multimodal RoPE with three position rows per token), every module training. Loss, gradient norm and final parameters must
match a one-process run on the same samples (relative difference <= 1e-5; parameters elementwise,
with an absolute floor of 1e-7 for zero-initialised biases whose gradient is ~0). All layouts of one world
size share one spawned process group.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass, field, replace

import pytest
import torch

from harmonia.model.batch import ItemInputs, TokenizedSample, pack_samples
from harmonia.model.mllm import build_mllm_model
from harmonia.model.presets import mllm_preset
from harmonia.schedule.costs import CostTable, PhaseCost
from harmonia.schedule.layout import Layout
from tests.distributed._spawn import LAYOUT_TIMEOUT_S, check_timeout, run_workers

pytestmark = pytest.mark.distributed

TRAINING = {"audio-frozen": {"audio": "frozen"}, "vision-frozen": {"vision": "frozen", "vision_proj": "frozen"},
            "llava": {"vision": "frozen"}, "qwen": {}, "qwen3": {}}
HF_ARCHS = ("llava", "qwen", "qwen3")  # trainings of an HF architecture: a vision tower and the LLM, no audio
STEPS = 3
MAX_NORM = 0.5
RTOL = 1e-5
BF16_RTOL = 2e-2  # bf16 keeps 8 mantissa bits: a few ulps of drift over 3 steps
N_SAMPLES = 12


def L(**kw) -> Layout:
    return Layout(**kw)


@dataclass(frozen=True)
class Case:
    """One placement: vision, audio and LLM layouts, schedule family, global microbatches, training."""

    name: str
    vision: Layout
    audio: Layout
    llm: Layout
    family: str = "1f1b"
    n_microbatches: int = 3
    training: str = "audio-frozen"
    n_sub: dict = field(default_factory=dict)
    idle: tuple[str, ...] = ()  # encoders whose last DP replica gets no sample in any step
    cp_block: int = 4  # tokens per block of the balanced CP assignment (llm cp > 1)
    balanced: bool = False  # LLM replicas and microbatches from the balancer (`balance_dp`)
    recompute: tuple[str, ...] = ()  # modules whose blocks recompute in backward ("llm:0.5": the first half)
    bf16: bool = False  # mixed precision (autocast; FSDP's bf16 parameters): compared at BF16_RTOL
    placed: bool = False  # encoder replicas' own costs uneven: ranks move encoder work (`encoder_slots`)
    tiles: int = 1  # tiles of every image; with more than 1, an image per microbatch is cut over two
    # vision replicas (`harmonia.schedule.item_cuts`), its tiles encoded apart

    def layouts(self) -> dict[str, Layout]:
        if self.training in HF_ARCHS:
            return {"vision": self.vision, "llm": self.llm}
        return {"vision": self.vision, "audio": self.audio, "llm": self.llm}


TIED_CASES = [  # tied embeddings under every schedule family, the LLM whole on each rank and pipelined
    Case(f"llava tied: vision dp2 -> llm {name}, {family}", L(dp=2), L(), llm, family, training="llava",
         n_microbatches=4)
    for family in ("gpipe", "1f1b", "interleaved", "zb")
    for name, llm in (("dp2", L(dp=2, virtual_stages=2 if family == "interleaved" else 1)),
                      ("pp2", L(pp=2, virtual_stages=2 if family == "interleaved" else 1)))
]

QWEN_CASES = [  # Qwen2.5-VL: native-resolution images of several sizes, windows, 3-row rotary positions
    Case("qwen2.5-vl: vision dp2 -> llm pp2 zb", L(dp=2), L(), L(pp=2), "zb", training="qwen"),
    Case("qwen2.5-vl: vision dp2 -> llm tp2", L(dp=2), L(), L(tp=2), training="qwen"),
    Case("qwen2.5-vl: vision dp2 -> llm cp2", L(dp=2), L(), L(cp=2), training="qwen"),
    Case("qwen2.5-vl: vision tp2 -> llm dp2 fsdp", L(tp=2), L(), L(dp=2, fsdp=True), training="qwen"),
    # Qwen3-VL: learned tower positions, interleaved rotary rows, DeepStack features across the boundary
    Case("qwen3-vl: vision dp2 -> llm pp2 zb", L(dp=2), L(), L(pp=2), "zb", training="qwen3"),
    Case("qwen3-vl: vision dp2 -> llm cp2", L(dp=2), L(), L(cp=2), training="qwen3"),
    Case("qwen3-vl: vision pp2 (DeepStack carried across its stages) -> llm dp2", L(pp=2), L(), L(dp=2),
         n_microbatches=2, training="qwen3"),
]

CASES: dict[int, list[Case]] = {
    1: [
        Case("one process, zb, vision and audio subs", L(), L(), L(), "zb", n_sub={"vision": 2, "audio": 2}),
    ],
    2: [
        Case("dis enc (r0) -> llm (r1)", L(), L(), L(rank_offset=1)),
        Case("co all dp2, balanced", L(dp=2), L(dp=2), L(dp=2), training="vision-frozen", balanced=True),
        Case("co enc dp2 -> llm pp2 zb, vision subs", L(dp=2), L(dp=2), L(pp=2), "zb",
             n_sub={"vision": 2}),
        Case("co enc pp2 -> llm dp2", L(pp=2), L(), L(dp=2), n_microbatches=2),
        Case("co enc dp2 -> llm pp2 zb, bf16", L(dp=2), L(dp=2), L(pp=2), "zb", bf16=True),
        Case("co all tp2, llm recompute", L(tp=2), L(tp=2), L(tp=2), training="vision-frozen", recompute=("llm",)),
        Case("co enc dp2 -> llm cp2", L(dp=2), L(dp=2), L(cp=2)),
        Case("co enc dp2 -> llm cp2, encoder work placed by replica", L(dp=2), L(dp=2), L(cp=2), n_microbatches=4,
             placed=True),
        Case("co enc dp2 -> llm cp2, images cut over vision replicas", L(dp=2), L(dp=2), L(cp=2), tiles=3),
        Case("llava clip+qwen3: vision tp2 -> llm cp2 tp1", L(tp=2), L(), L(cp=2), training="llava"),
        *TIED_CASES,
        *QWEN_CASES,
    ],
    4: [
        Case("dis vision r0, audio r1 -> llm pp2", L(), L(rank_offset=1), L(pp=2, rank_offset=2)),
        Case("dis enc dp2 -> llm pp2", L(dp=2), L(dp=2), L(pp=2, rank_offset=2), training="vision-frozen"),
        Case("dis vision pp2 -> llm dp2, audio on llm", L(pp=2), L(dp=2, rank_offset=2),
             L(dp=2, rank_offset=2), "gpipe"),
        Case("co vision dp4, audio pp2 dp2 -> llm pp2 dp2, balanced", L(dp=4), L(pp=2, dp=2), L(pp=2, dp=2),
             balanced=True),
        Case("co enc dp4 -> llm dp2 fsdp pp2 zb, all recompute", L(dp=4), L(dp=4), L(pp=2, dp=2, fsdp=True), "zb",
             training="vision-frozen", n_sub={"audio": 2}, recompute=("vision", "audio", "llm")),
        Case("dis vision tp2, audio dp2 -> llm pp2", L(tp=2), L(dp=2), L(pp=2, rank_offset=2)),
        Case("co vision tp2 dp2, audio dp4 -> llm pp2 tp2 zb", L(tp=2, dp=2), L(dp=4), L(pp=2, tp=2), "zb",
             n_sub={"vision": 2}),
        Case("co enc pp2 tp2 -> llm dp2 tp2 fsdp", L(pp=2, tp=2), L(pp=2, tp=2), L(dp=2, tp=2, fsdp=True),
             training="vision-frozen"),
        Case("co vision fsdp dp2 tp2 (dp1 idle), audio pp2 tp2 -> llm dp2 tp2", L(dp=2, tp=2, fsdp=True),
             L(pp=2, tp=2), L(dp=2, tp=2), idle=("vision",)),
        Case("co vision dp4, audio pp2 dp2 -> llm cp2 pp2 zb, audio subs", L(dp=4), L(pp=2, dp=2),
             L(pp=2, cp=2), "zb", n_sub={"audio": 2}),
        Case("co enc dp4 -> llm cp2 dp2, llm recompute half", L(dp=4), L(dp=4), L(dp=2, cp=2),
             training="vision-frozen", recompute=("llm:0.5",)),
        Case("co vision tp2 dp2, audio dp4 -> llm cp2 tp2", L(tp=2, dp=2), L(dp=4), L(cp=2, tp=2),
             n_sub={"vision": 2}),
        Case("co enc dp4 (dp3 idle) -> llm cp2 dp2 fsdp", L(dp=4), L(dp=4), L(dp=2, cp=2, fsdp=True),
             idle=("audio",)),
        Case("co enc dp4 -> llm cp4", L(dp=4), L(dp=4), L(cp=4), cp_block=3),
        Case("co enc dp4 -> llm cp2 dp2 fsdp, vision subs, encoder work placed by replica", L(dp=4), L(dp=4),
             L(dp=2, cp=2, fsdp=True), n_microbatches=4, n_sub={"vision": 2}, placed=True),
        Case("co vision tp2 dp2 fsdp, audio dp4 -> llm dp2 tp2, images cut, vision subs", L(tp=2, dp=2, fsdp=True),
             L(dp=4), L(dp=2, tp=2), n_sub={"vision": 2}, tiles=2),
        Case("dis vision tp2, audio dp2 -> llm cp2", L(tp=2), L(dp=2), L(cp=2, rank_offset=2)),
        Case("co vision dp4, frozen audio dp4 fsdp -> llm pp2 dp2 fsdp, bf16", L(dp=4), L(dp=4, fsdp=True),
             L(pp=2, dp=2, fsdp=True), bf16=True),
        Case("co enc dp4 -> llm pp2 interleaved v2", L(dp=4), L(dp=4), L(pp=2, dp=2, virtual_stages=2),
             "interleaved", n_microbatches=4),
        Case("co enc dp4 -> llm pp2 v2 dp2 fsdp reshard, interleaved", L(dp=4), L(dp=4),
             L(pp=2, dp=2, virtual_stages=2, fsdp=True, reshard=True), "interleaved", n_microbatches=4),
        Case("co enc dp4 (dp3 idle) -> llm cp2 dp2 fsdp reshard, llm recompute", L(dp=4), L(dp=4),
             L(dp=2, cp=2, fsdp=True, reshard=True), training="vision-frozen", recompute=("llm",), idle=("audio",)),
        Case("llava clip+qwen3: vision dp4 -> llm pp2 tp2 zb (tied)", L(dp=4), L(), L(pp=2, tp=2), "zb",
             training="llava", balanced=True),
        Case("qwen2.5-vl: dis vision dp2 (r0-1) -> llm pp2 (r2-3)", L(dp=2), L(), L(pp=2, rank_offset=2),
             training="qwen"),
    ],
    8: [
        Case("co enc dp8 -> llm pp2 dp2 tp2 zb, balanced", L(dp=8), L(dp=8), L(pp=2, dp=2, tp=2), "zb",
             balanced=True),
        Case("dis vision tp2 dp2 (r0-3), audio dp2 (r4-5) -> llm cp2 (r6-7)", L(tp=2, dp=2),
             L(dp=2, rank_offset=4), L(cp=2, rank_offset=6), n_sub={"vision": 2}),
        Case("co vision pp2 dp4, audio tp2 dp4 -> llm pp2 v2 dp2 tp2 interleaved", L(pp=2, dp=4),
             L(tp=2, dp=4), L(pp=2, dp=2, tp=2, virtual_stages=2), "interleaved", n_microbatches=4),
        Case("co vision dp8 fsdp, audio dp8 -> llm pp4 dp2 fsdp zb", L(dp=8, fsdp=True), L(dp=8),
             L(pp=4, dp=2, fsdp=True), "zb", training="vision-frozen"),
    ],
}


# -- data and the one-process reference ----------------------------------------------------------
def llava_config() -> dict:
    """A tiny LLaVA's completed config.json: CLIP 16 px / 4 px patches (16 image tokens) + Qwen3."""
    import transformers

    vision = transformers.CLIPVisionConfig(hidden_size=24, intermediate_size=40, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=16, patch_size=4)
    text = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                    num_key_value_heads=2, num_hidden_layers=4, head_dim=8,
                                    tie_word_embeddings=True)
    return transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=95,
                                    vision_feature_layer=-2, tie_word_embeddings=True).to_dict()


def qwen_config() -> dict:
    """A tiny Qwen2.5-VL's completed config.json: a 2-block tower of 2 px patches with 4 px windows (one
    full-attention block), a Qwen2 text model with multimodal RoPE."""
    import transformers

    text = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "mrope_section": [1, 1, 2]})
    vision = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=8, fullatt_block_indexes=[1], out_hidden_size=32)
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=95, video_token_id=94,
                                         vision_start_token_id=93, vision_end_token_id=92).to_dict()


def qwen3_config() -> dict:
    """A tiny Qwen3-VL's completed config.json: a 2-block tower with learned positions whose two blocks
    both feed DeepStack, a Qwen3 text model with interleaved multimodal RoPE."""
    import transformers

    text = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, num_hidden_layers=4, rope_parameters={
                    "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2], "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=95, video_token_id=94,
                                      vision_start_token_id=93, vision_end_token_id=92).to_dict()


def spec(training: str):
    if training in ("qwen", "qwen3"):
        from harmonia.model.families.qwen_vl import qwen_vl_spec_from_hf

        return qwen_vl_spec_from_hf(qwen_config() if training == "qwen" else qwen3_config())
    if training == "llava":
        from harmonia.model.families.llava import llava_spec_from_hf

        return llava_spec_from_hf(llava_config()).with_training(**TRAINING[training])
    return mllm_preset("tiny-omni", training=TRAINING[training])


def base_training(training: str) -> str:
    """The training setup whose initial state a setup shares (one per architecture)."""
    return training if training in HF_ARCHS else "audio-frozen"


def qwen_samples(step: int, training: str = "qwen") -> list[TokenizedSample]:
    """The step's global batch for a Qwen architecture: text runs around 0-2 images of random patch
    grids (2..8 x 2..8 patches, very wide and very tall ones among them), rotary positions per sample."""
    from harmonia.model.mrope import item_rope_positions

    s = spec(training)
    tower = s.encoders["vision"].native
    rng, g = random.Random(2000 + step), torch.Generator().manual_seed(step)
    out = []
    for i in range(N_SAMPLES):
        items, segments = [], [("text", rng.randint(1, 4))]
        for _ in range(rng.randint(0, 2)):
            h, w = 2 * rng.randint(1, 4), 2 * rng.randint(1, 4)
            items.append(ItemInputs("vision", torch.randn(h * w, tower.patch_dim, generator=g),
                                    grid=torch.tensor([[1, h, w]])))
            segments += [("item", h * w // 4), ("text", 1)]
        segments.append(("text", rng.randint(2, 8)))
        n = sum(k for _, k in segments)
        ids = torch.randint(4, 90, (n,), generator=g)
        labels = torch.roll(ids, -1)
        labels[-1] = -100
        out.append(TokenizedSample(ids, labels, segments, items, sample_id=i, causal_items=True,
                                   rope_positions=item_rope_positions(s, segments, items)))
    return out


def samples(step: int, training: str = "audio-frozen", tiles: int = 1) -> list[TokenizedSample]:
    """The step's global batch: text of 3..12 tokens, 0-2 images of ``tiles`` tiles, an audio clip of
    1-2 chunks (no audio for the LLaVA architecture)."""
    if training in ("qwen", "qwen3"):
        return qwen_samples(step, training)
    s = spec(base_training(training))
    vit, aud = s.encoders["vision"], s.encoders.get("audio")
    img_tokens = vit.llm_tokens_per_tile()
    rng = random.Random(1000 + step)
    g = torch.Generator().manual_seed(step)
    out = []
    for i in range(N_SAMPLES):
        items, segments = [], [("text", rng.randint(1, 4))]
        for _ in range(rng.randint(0, 2)):
            items.append(ItemInputs("vision", torch.randn(tiles, 3, 16, 16, generator=g)))
            segments.append(("item", img_tokens * tiles))
        if aud is not None and rng.random() < 0.5:  # 1-2 fixed-length chunks (2 s, 100 mel frames each)
            chunks = rng.randint(1, 2)
            items.append(ItemInputs("audio", torch.randn(chunks, aud.n_mels, 100, generator=g)))
            segments.append(("item", chunks * math.ceil(100 / aud.conv_stride)))
        segments.append(("text", rng.randint(2, 8)))
        n = sum(k for _, k in segments)
        ids = torch.randint(4, s.llm.vocab_size, (n,), generator=g)
        labels = torch.roll(ids, -1)
        labels[-1] = -100
        out.append(TokenizedSample(ids, labels, segments, items, sample_id=i,
                                   causal_items=s.item_attention == "causal"))
    return out


def placement(step: int, case: Case) -> tuple[list[list[TokenizedSample]], list, dict]:
    """Global microbatches of variable size; LLM replicas take contiguous runs, encoders deal theirs."""
    batch = samples(step, case.training, case.tiles)
    rng = random.Random(step)
    n, dp = case.n_microbatches, case.llm.dp
    if case.balanced:
        micro, llm_split = balanced_placement(batch, n, dp)
    else:
        sizes = [dp] * n  # every LLM replica gets a sample of every microbatch; the rest at random
        for _ in range(len(batch) - dp * n):
            sizes[rng.randrange(n)] += 1
        bounds = [0, *itertools.accumulate(sizes)]
        micro = [batch[a:b] for a, b in itertools.pairwise(bounds)]
        llm_split = [[list(range(len(mb) * d // dp, len(mb) * (d + 1) // dp)) for d in range(dp)] for mb in micro]
    encoders = {e: layout for e, layout in case.layouts().items() if e != "llm"}
    enc_split = {e: [] for e in encoders}
    for mb in micro:
        k = len(mb)
        for e, layout in encoders.items():
            order = list(range(k))
            rng.shuffle(order)
            split = [sorted(order[d::layout.dp]) for d in range(layout.dp)]
            if e in case.idle:
                split[0], split[-1] = sorted(split[0] + split[-1]), []
            enc_split[e].append(split)
    return micro, llm_split, enc_split


def image_cuts(micro: list[list[TokenizedSample]], enc_split: dict, case: Case) -> dict | None:
    """Per microbatch, the first image of some sample cut after its first tile: the replica holding
    the sample keeps the items before and that tile, the next replica the rest (None: no cut)."""
    if case.tiles == 1:
        return None
    per_tile = spec(case.training).encoders["vision"].llm_tokens_per_tile()
    cuts = []
    for m, mb in enumerate(micro):
        shares = {}
        split = enc_split["vision"][m]
        for p, sample in enumerate(mb):
            lengths = [n for kind, n in sample.segments if kind == "item"]
            rows = [n for item, n in zip(sample.items, lengths) if item.module == "vision"]
            if rows:
                r = next(r for r, held in enumerate(split) if p in held)
                other = (r + 1) % len(split)
                shares[(r, p)] = ((0, 0), (0, 1), per_tile)
                shares[(other, p)] = ((0, 1), (len(rows), 0), sum(rows) - per_tile)
                split[other] = sorted(split[other] + [p])
                break
        cuts.append(shares)
    return {"vision": cuts}


def balanced_placement(batch: list[TokenizedSample], n: int, dp: int) -> tuple[list, list]:
    """Global microbatches from `balance_dp` on each sample's work (LLM tokens, image tiles,
    audio chunks): microbatch ``k`` is every replica's ``k``-th, in replica order."""
    from harmonia.schedule.dp_balance import balance_dp

    work = torch.tensor([[len(s.input_ids), sum(i.module == "vision" for i in s.items),
                          sum(i.inputs.shape[0] for i in s.items if i.module == "audio")] for s in batch])
    per_replica = balance_dp(work.double().numpy(), dp, n_microbatches=n).microbatches
    micro, llm_split = [], []
    for k in range(n):
        groups = [per_replica[d][k] for d in range(dp)]
        micro.append([batch[i] for g in groups for i in g])
        offsets = [0, *itertools.accumulate(len(g) for g in groups)]
        llm_split.append([list(range(a, b)) for a, b in itertools.pairwise(offsets)])
    return micro, llm_split


def cp_assignment(micro: list[list[TokenizedSample]], llm_split: list, case: Case) -> list | None:
    """Per microbatch and LLM replica, the balanced CP rank of every token (`plan_cp_shards`; None
    when llm cp == 1)."""
    if case.llm.cp == 1:
        return None
    from harmonia.runtime.mllm_inputs import cp_token_ranks

    return [[cp_token_ranks([mb[i] for i in replica], case.llm.cp, block=case.cp_block, tile_cost=4.0)
             for replica in split] for mb, split in zip(micro, llm_split)]


def initial_state(training: str = "audio-frozen") -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return build_mllm_model(spec(base_training(training)), apply_training_modes=False).state_dict()


def optimizer(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def reference(training: str, tiles: int = 1) -> dict:
    """Losses, gradient norms and final parameters of one process on whole batches."""
    model = build_mllm_model(spec(training))
    model.load_state_dict(initial_state(training))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params)
    losses, norms = [], []
    for step in range(STEPS):
        batch = pack_samples(samples(step, training, tiles))
        opt.zero_grad()
        loss = model.loss(batch, batch.n_targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# -- the distributed side ------------------------------------------------------------------------
PREFIX = {"llm": "llm.", "vision": "encoders.vision.", "audio": "encoders.audio."}


def run_case(case: Case, rank: int) -> dict:
    from harmonia.model.lora import apply_training
    from harmonia.model.mllm import build_module
    from harmonia.runtime.meshes import build_module_meshes
    from harmonia.runtime.mllm_executor import MLLMExecutor
    from harmonia.train.rank import boundary_widths
    from harmonia.runtime.mllm_inputs import build_rank_batch
    from harmonia.runtime.parallelize import build_stage_modules, parallelize_stage
    from harmonia.schedule import StageGraph, build_schedule, lower
    from harmonia.schedule.graph import fused_backward
    from harmonia.schedule.rank_actions import plan_rank_actions

    from harmonia.schedule.plan import parse_recompute

    s, layouts = spec(case.training), case.layouts()
    state = initial_state(case.training)
    recomputed, shares = parse_recompute(case.recompute)
    meshes = build_module_meshes(layouts)
    chunks, projectors, named = {}, {}, {}
    for name in meshes.modules():
        layout, mesh = layouts[name], meshes.module_mesh(name)
        sub = {k[len(PREFIX[name]):]: v for k, v in state.items() if k.startswith(PREFIX[name])}
        chunks[name] = build_stage_modules(s, name, layout, rank, sub)
        for module in chunks[name].values():
            apply_training(module, s.training_of(name))
            parallelize_stage(module, mesh, recompute=shares.get(name, 1.0) if name in recomputed else 0.0,
                              mixed_precision=case.bf16)
            named.update({PREFIX[name] + n: p for n, p in module.named_parameters()})
        if name != "llm" and layout.n_stages - 1 in chunks[name]:
            proj = build_module(s, f"{name}_proj")
            pre = f"projectors.{name}_proj."
            proj.load_state_dict({k[len(pre):]: v for k, v in state.items() if k.startswith(pre)})
            apply_training(proj, s.training_of(f"{name}_proj"))
            projectors[name] = proj
            named.update({pre + n: p for n, p in proj.named_parameters()})
    executor = MLLMExecutor(meshes, chunks, s.llm.hidden, projectors, optimizer=optimizer, max_norm=MAX_NORM,
                            autocast=torch.bfloat16 if case.bf16 else None, row_widths=boundary_widths(s))
    flags = {"llm": s.training_of("llm").trains}
    for e in s.encoders:
        n = layouts[e].n_stages
        flags[e] = tuple(s.training_of(e).trains or (c == n - 1 and s.training_of(f"{e}_proj").trains)
                         for c in range(n))
    graph = StageGraph.from_layouts(layouts, flags, replica=0, fused=fused_backward(layouts, s.llm.tie_embeddings))
    costs = CostTable(replicas=uneven_replica_costs(case)) if case.placed else None
    schedule = lower(build_schedule(graph, case.n_microbatches, case.family, n_sub=case.n_sub or None, costs=costs))
    kept = replace(schedule, costs=replace(costs, replicas={}), chunk_actions=None, placements=None) if costs else schedule
    unplaced = plan_rank_actions(layouts, kept, [rank])[rank]  # the schedule's own order
    n_sub = {e: schedule.n_sub[e] for e in schedule.n_sub}
    losses, norms = [], []
    for step in range(STEPS):
        micro, llm_split, enc_split = placement(step, case)
        batch = build_rank_batch(layouts, rank, micro, llm_split, enc_split, n_sub,
                                 llm_cp=cp_assignment(micro, llm_split, case),
                                 encoder_cuts=image_cuts(micro, enc_split, case))
        result = executor.step(schedule, batch)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        # the step ran exactly this rank's list, the one the simulator times (tests/unit/test_rank_actions.py)
        assert executor.executed == plan_rank_actions(layouts, schedule, [rank])[rank], f"rank {rank} order"
    moved = executor.executed != unplaced
    from torch.distributed.tensor import DTensor

    params = {}
    for name, p in named.items():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        params[name] = full.detach().clone()
    return {"losses": losses, "norms": norms, "params": params, "moved": moved}


def uneven_replica_costs(case: Case) -> dict:
    """Each encoder replica's own durations, heavy on alternate microbatches per replica: every
    replica of a group idles while another encodes, and fills the slack with its next forward."""
    out = {}
    for e in ("vision", "audio"):
        layout = getattr(case, e)
        for replica in range(layout.dp):
            for m in range(case.n_microbatches):
                heavy = (replica + m) % 2 == 0
                for sub in ([None] if case.n_sub.get(e, 1) == 1 else range(case.n_sub[e])):
                    out[(e, replica, 0, m, sub)] = PhaseCost(4.0 if heavy else 0.5, 1.0, 2.0 if heavy else 0.5)
    return out


def worker(rank: int, world: int, cases: list[Case]) -> dict:
    out = {}
    for case in cases:
        start = time.perf_counter()
        with check_timeout(LAYOUT_TIMEOUT_S, f"layout {case.name}"):
            out[case.name] = run_case(case, rank)
        out[case.name]["seconds"] = time.perf_counter() - start
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    """World size -> rank values of `worker` (the spawn runs once per world size, lazily)."""
    cache: dict[int, list] = {}

    def get(world: int) -> list:
        if world not in cache:
            try:
                cache[world] = run_workers(worker, world, (CASES[world],), timeout=900)  # generous: a busy machine
            except AssertionError as e:
                cache[world] = e
        if isinstance(cache[world], AssertionError):
            raise cache[world]
        return cache[world]

    return get


def test_cp_cases_use_balanced_non_contiguous_shards() -> None:
    """The CP cases run the balancer's assignment, which is not one contiguous run per rank."""
    cases = [c for cs in CASES.values() for c in cs if c.llm.cp > 1]
    assert {c.llm.cp for c in cases} >= {2, 4} and any(c.family == "zb" for c in cases)
    for case in cases:
        runs = []
        for step in range(STEPS):
            micro, llm_split, _ = placement(step, case)
            for per_replica in cp_assignment(micro, llm_split, case):
                for ranks in per_replica:
                    assert sorted(set(ranks.tolist())) == list(range(case.llm.cp)), "every CP rank gets tokens"
                    runs.append(int((ranks[1:] != ranks[:-1]).sum()) + 1)
        assert max(runs) > case.llm.cp, f"{case.name}: some CP rank must hold several separate token runs"


_REFERENCES: dict[tuple[str, int], dict] = {}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("world, case", [(w, c) for w, cs in CASES.items() for c in cs],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_layout_matches_one_process(results, world: int, case: Case) -> None:
    got = [r[case.name] for r in results(world)]
    key = (case.training, case.tiles)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(*key)
    ref = _REFERENCES[key]
    assert ref["norms"][0] > MAX_NORM, "clipping must bind for the check to cover the global norm"
    rtol = BF16_RTOL if case.bf16 else RTOL
    assert any(g["moved"] for g in got) == case.placed, "placed cases move encoder work, no other does"
    for r, g in enumerate(got):
        assert g["losses"] == pytest.approx(ref["losses"], rel=rtol), f"rank {r} losses"
        assert g["norms"] == pytest.approx(ref["norms"], rel=rtol), f"rank {r} gradient norms"
    if case.bf16:
        assert got[0]["losses"] != pytest.approx(ref["losses"], rel=1e-6), "bf16 compute must actually run"
        for g in got:  # fp32 master weights: updates computed from bf16 activations
            for n, t in g["params"].items():
                b = ref["params"][n]  # zero-initialised key biases stay ~0: an absolute floor
                assert float((t - b).norm()) <= rtol * float(b.norm()) + 1e-6, f"parameter {n} after {STEPS} steps"
        return
    params = {n: t for g in got for n, t in g["params"].items()}
    assert set(params) == set(ref["params"]), "every parameter is held by some rank"
    for g in got:  # elementwise |a - b| <= atol + rtol |b|: zero-initialised key biases get ~0 gradient
        for n, t in g["params"].items():
            torch.testing.assert_close(t, ref["params"][n], rtol=RTOL, atol=1e-7,
                                       msg=lambda m, n=n: f"parameter {n} after {STEPS} steps: {m}")
    init = initial_state(case.training)
    trained = {"audio-frozen": ("llm.", "encoders.vision.", "projectors.audio_proj."),
               "vision-frozen": ("llm.", "encoders.audio.", "projectors.audio_proj."),
               "llava": ("llm.", "projectors.vision_proj."),
               "qwen": ("llm.", "projectors.vision_proj.", "encoders.vision."),
               "qwen3": ("llm.", "projectors.vision_proj.", "encoders.vision.")}[case.training]
    for module in trained:
        moved = max(_rel(ref["params"][n], init[n]) for n in params if n.startswith(module))
        assert moved > 1e-4, f"training must change {module}*"
    if case.training in ("qwen", "qwen3"):
        return  # every module trains
    frozen = "encoders.audio." if case.training == "audio-frozen" else "encoders.vision."
    assert all(torch.equal(params[n], init[n]) for n in params if n.startswith(frozen)), "frozen stays"
