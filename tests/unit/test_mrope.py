"""M-RoPE against transformers' Qwen2-VL, Qwen2.5-VL and Qwen3-VL on tiny random configs (CPU, fp32).

`rope_index` must equal ``get_rope_index`` position by position for prompts written the way each
processor writes them (``<|vision_start|>`` pads ``<|vision_end|>``; Qwen3-VL videos frame by frame
behind timestamp text), and `mrope_cos_sin` + `apply_rope` must equal each model's text rotary
embedding + ``apply_rotary_pos_emb``.
"""

import pytest
import torch

from harmonia.errors import ConfigError, SampleError
from harmonia.model.layers import apply_rope
from harmonia.model.mrope import item_tokens, mrope_axes, mrope_cos_sin, rope_index
from harmonia.model.spec import RopeScaling

VARIANTS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
MERGE = 2
IMAGE, VIDEO, VISION_START, VISION_END = 90, 91, 92, 93  # token ids; plain text draws from [0, 80)
TIMESTAMP_TOKENS = 5  # "<1.5 seconds>" before each Qwen3-VL frame
TEXT_MODEL = dict(vocab_size=100, hidden_size=64, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def hf():
    """transformers' Qwen-VL configs, models and rotary functions, imported once."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from transformers.models.qwen2_vl import modeling_qwen2_vl
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    return {
        "qwen2_vl": (transformers.Qwen2VLConfig, modeling_qwen2_vl.Qwen2VLModel,
                     modeling_qwen2_vl.Qwen2VLRotaryEmbedding, modeling_qwen2_vl.apply_rotary_pos_emb),
        "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, modeling_qwen2_5_vl.Qwen2_5_VLModel,
                       modeling_qwen2_5_vl.Qwen2_5_VLRotaryEmbedding, modeling_qwen2_5_vl.apply_rotary_pos_emb),
        "qwen3_vl": (transformers.Qwen3VLConfig, modeling_qwen3_vl.Qwen3VLModel,
                     modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding, modeling_qwen3_vl.apply_rotary_pos_emb),
    }


def hf_config(hf, variant, head_dim=32, theta=10000.0, mrope_section=(4, 6, 6), tokens_per_second=2, rope=None):
    """A tiny config of ``variant``: 1 text layer, 1 vision block, the given rotary parameters."""
    rope = {"rope_type": "default"} if rope is None else rope
    text = TEXT_MODEL | {"head_dim": head_dim, "hidden_size": 2 * head_dim,
                         "rope_parameters": rope | {"rope_theta": theta, "mrope_section": list(mrope_section)}}
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START)
    if variant == "qwen2_vl":
        vision = dict(depth=1, embed_dim=16, hidden_size=2 * head_dim, num_heads=2, mlp_ratio=1,
                      spatial_merge_size=MERGE)
    elif variant == "qwen2_5_vl":
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=2 * head_dim,
                      spatial_merge_size=MERGE, tokens_per_second=tokens_per_second, fullatt_block_indexes=[0])
    else:
        text["rope_parameters"]["mrope_interleaved"] = True
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=2 * head_dim,
                      spatial_merge_size=MERGE, deepstack_visual_indexes=[])
        tokens.pop("vision_start_token_id")
    return hf[variant][0](text_config=text, vision_config=vision, **tokens)


class Prompt:
    """One sample written twice: the token ids (and processor outputs) that transformers reads, and
    the segments harmonia reads. ``<|vision_start|>`` / ``<|vision_end|>`` and timestamps are text."""

    def __init__(self, variant: str, seed: int = 0) -> None:
        self.variant = variant
        self.rng = torch.Generator().manual_seed(seed)
        self.ids: list[int] = []
        self.segments: list[tuple] = []
        self.image_grids: list[tuple] = []
        self.video_grids: list[tuple] = []
        self.seconds: list[float] = []

    def text(self, n: int) -> "Prompt":
        self._text_tokens(torch.randint(0, 80, (n,), generator=self.rng).tolist())
        return self

    def image(self, grid: tuple) -> "Prompt":
        self.image_grids.append(grid)
        self._item(IMAGE, ("image", grid))
        return self

    def video(self, grid: tuple, second_per_grid_t: float = 1.0) -> "Prompt":
        self.video_grids.append(grid)
        self.seconds.append(second_per_grid_t)
        if self.variant != "qwen3_vl":
            self._item(VIDEO, ("video", grid, second_per_grid_t))
            return self
        for _ in range(grid[0]):  # Qwen3-VL: "<t seconds><|vision_start|>frame<|vision_end|>" per frame
            self.text(TIMESTAMP_TOKENS)
            self._item(VIDEO, ("video", (1, grid[1], grid[2])))
        return self

    def _item(self, pad: int, segment: tuple) -> None:
        self._text_tokens([VISION_START])
        self.ids += [pad] * item_tokens(segment[1], MERGE)
        self.segments.append(segment)
        self._text_tokens([VISION_END])

    def _text_tokens(self, tokens: list[int]) -> None:
        self.ids += tokens
        if self.segments and self.segments[-1][0] == "text":
            self.segments[-1] = ("text", self.segments[-1][1] + len(tokens))
        else:
            self.segments.append(("text", len(tokens)))

    def hf_inputs(self) -> dict:
        """``get_rope_index``'s keyword arguments for this one sample (batch of 1)."""
        ids = torch.tensor([self.ids])
        types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()  # the processor's mm_token_type_ids
        inputs = {"input_ids": ids, "mm_token_type_ids": types,
                  "image_grid_thw": torch.tensor(self.image_grids) if self.image_grids else None,
                  "video_grid_thw": torch.tensor(self.video_grids) if self.video_grids else None}
        if self.variant == "qwen2_5_vl" and self.seconds:
            inputs["second_per_grid_ts"] = torch.tensor(self.seconds)  # float32, as the processor returns
        return inputs


def hf_positions(hf, variant: str, prompt: Prompt, **config) -> torch.Tensor:
    model = hf[variant][1](hf_config(hf, variant, **config)).eval()
    position_ids, _ = model.get_rope_index(**prompt.hf_inputs())
    return position_ids[:, 0]  # (3, T)


def ours(prompt: Prompt, tokens_per_second: int = 2) -> torch.Tensor:
    return rope_index(prompt.segments, MERGE, prompt.variant, tokens_per_second)


PROMPTS = {
    "text_only": lambda p: p.text(7),
    "one_image": lambda p: p.text(3).image((1, 4, 6)).text(5),
    "wide_and_tall_images": lambda p: p.text(2).image((1, 2, 16)).text(4).image((1, 12, 4)).text(3),
    "image_and_video": lambda p: p.text(3).image((1, 6, 4)).text(2).video((4, 4, 6), 0.5).text(5),
    "video_longer_than_wide": lambda p: p.text(2).video((6, 2, 4), 2.0).text(3).image((2, 4, 4)).text(1),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", PROMPTS)
def test_rope_index_equals_transformers_get_rope_index(hf, variant, case) -> None:
    prompt = PROMPTS[case](Prompt(variant))
    got = ours(prompt)
    assert got.dtype == torch.int64 and got.shape == (3, len(prompt.ids))
    assert torch.equal(got, hf_positions(hf, variant, prompt))


def test_rope_index_by_hand() -> None:
    """Two text tokens, a 4 x 6 patch image (2 x 3 tokens after the 2 x 2 merge), two text tokens:
    the image starts at 2 on every row; text goes on at 2 + max(2, 3) = 5."""
    got = rope_index([("text", 2), ("image", (1, 4, 6)), ("text", 2)], MERGE, "qwen2_vl")
    assert got.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
                            [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
                            [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]]


def test_qwen2_5_vl_video_frames_are_spaced_by_seconds_times_tokens_per_second_in_float32(hf) -> None:
    """25 tokens per second, 2-frame patches at 1.2 fps: a step of 41.666668 in float32, so frame 3
    sits at int(125.00000x) or int(124.99999x) depending on rounding; transformers gives 124."""
    prompt = Prompt("qwen2_5_vl").text(2).video((8, 2, 2), 2 / 1.2).text(2).image((1, 2, 2)).text(1)
    got = ours(prompt, tokens_per_second=25)
    assert torch.equal(got, hf_positions(hf, "qwen2_5_vl", prompt, tokens_per_second=25))
    video_start = 3  # 2 text tokens and <|vision_start|>
    assert got[0, video_start:video_start + 8].tolist() == [3 + t for t in (0, 41, 83, 124, 166, 208, 249, 291)]
    assert got[0, video_start + 8] == 3 + 1  # <|vision_end|>: after max(h, w) / merge = 1, not after frame 7


def test_qwen2_5_vl_images_and_qwen2_vl_videos_ignore_seconds(hf) -> None:
    for variant in ("qwen2_5_vl", "qwen2_vl"):
        prompt = Prompt(variant).text(1).image((3, 2, 2)).text(1).video((3, 2, 2), 3.0)
        got = ours(prompt)
        assert torch.equal(got, hf_positions(hf, variant, prompt))
        step = 6 if variant == "qwen2_5_vl" else 1  # 2 tokens per second * 3.0 s for the Qwen2.5-VL video
        assert got[0, 2:5].tolist() == [2, 3, 4]  # image frames: 1 apart
        assert got[0, 8:11].tolist() == [6, 6 + step, 6 + 2 * step]  # video after 2 + 1 (image), 3 text tokens


def test_positions_restart_per_packed_sample(hf) -> None:
    """Packing calls rope_index per sample and concatenates: each sample counts from 0, and the pack
    equals transformers' positions for the same samples as rows of a (right-padded) batch."""
    for variant in VARIANTS:
        a = Prompt(variant, seed=1).text(3).image((1, 4, 8)).text(4)
        b = Prompt(variant, seed=2).text(2).video((2, 4, 4), 0.5).text(6)
        packed = torch.cat([ours(a), ours(b)], dim=1)  # (3, Ta + Tb)
        assert torch.equal(packed[:, len(a.ids):], ours(b)) and packed[:, len(a.ids)].tolist() == [0, 0, 0]
        continued = rope_index(a.segments + b.segments, MERGE, variant, 2)
        assert not torch.equal(packed, continued)  # one sample of both would count on
        model = hf[variant][1](hf_config(hf, variant)).eval()
        ia, ib = a.hf_inputs(), b.hf_inputs()
        T = max(len(a.ids), len(b.ids))
        batch = {"input_ids": _right_pad([ia["input_ids"], ib["input_ids"]], T),
                 "mm_token_type_ids": _right_pad([ia["mm_token_type_ids"], ib["mm_token_type_ids"]], T),
                 "attention_mask": _right_pad([torch.ones_like(ia["input_ids"]), torch.ones_like(ib["input_ids"])], T),
                 "image_grid_thw": ia["image_grid_thw"], "video_grid_thw": ib["video_grid_thw"]}
        if variant == "qwen2_5_vl":
            batch["second_per_grid_ts"] = ib["second_per_grid_ts"]
        want, _ = model.get_rope_index(**batch)  # (3, 2, T)
        assert torch.equal(packed, torch.cat([want[:, 0, :len(a.ids)], want[:, 1, :len(b.ids)]], dim=1))


def _right_pad(rows: list[torch.Tensor], T: int) -> torch.Tensor:
    return torch.cat([torch.nn.functional.pad(r, (0, T - r.shape[1])) for r in rows])


# (variant, head_dim, mrope_section): the released layouts scaled down, and uneven ones
ROTARY = [("qwen2_vl", 32, (4, 6, 6)), ("qwen2_5_vl", 64, (8, 12, 12)), ("qwen2_5_vl", 16, (2, 3, 3)),
          ("qwen3_vl", 32, (6, 5, 5)), ("qwen3_vl", 128, (24, 20, 20)), ("qwen3_vl", 16, (2, 3, 3))]


def _mixed_positions(variant: str, offset: int) -> torch.Tensor:
    """(3, 2, T): two samples of the same length, positions shifted far out to stress fp32 angles."""
    a = rope_index(PROMPTS["image_and_video"](Prompt(variant)).segments, MERGE, variant, 2)
    b = rope_index(PROMPTS["wide_and_tall_images"](Prompt(variant)).segments, MERGE, variant, 2)
    T = min(a.shape[1], b.shape[1])
    return torch.stack([a[:, :T], b[:, :T] + offset], dim=1)


@pytest.mark.parametrize("variant,head_dim,section", ROTARY)
def test_mrope_cos_sin_and_apply_rope_equal_transformers(hf, variant, head_dim, section) -> None:
    theta = 1e6 if head_dim >= 64 else 5000.0
    config = hf_config(hf, variant, head_dim=head_dim, theta=theta, mrope_section=section).text_config
    rotary, apply_hf = hf[variant][2](config), hf[variant][3]
    position_ids = _mixed_positions(variant, offset=40000)  # (3, B, T)
    torch.manual_seed(0)
    B, T = position_ids.shape[1:]
    q, k = torch.randn(B, 4, T, head_dim), torch.randn(B, 2, T, head_dim)
    cos_hf, sin_hf = rotary(q, position_ids)  # (B, T, hd)
    cos, sin = mrope_cos_sin(position_ids, head_dim, theta, section, interleaved=variant == "qwen3_vl")
    assert cos.dtype == torch.float32 and cos.shape == (B, T, head_dim)
    assert torch.equal(cos, cos_hf) and torch.equal(sin, sin_hf)
    q_hf, k_hf = apply_hf(q, k, cos_hf, sin_hf)
    torch.testing.assert_close(apply_rope(q, cos, sin), q_hf, atol=1e-6, rtol=0)
    torch.testing.assert_close(apply_rope(k, cos, sin), k_hf, atol=1e-6, rtol=0)
    assert not torch.allclose(q_hf, q, atol=1e-3)  # the rotation does turn q


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_sample_tables_and_linear_scaling_equal_transformers(hf, variant) -> None:
    """(3, T) positions give (T, hd) tables; linear scaling divides the frequencies as transformers'."""
    rope = {"rope_type": "linear", "factor": 4.0}
    config = hf_config(hf, variant, rope=rope).text_config
    position_ids = rope_index(PROMPTS["image_and_video"](Prompt(variant)).segments, MERGE, variant, 2)  # (3, T)
    cos_hf, sin_hf = hf[variant][2](config)(torch.zeros(1), position_ids[:, None])  # (1, T, hd)
    cos, sin = mrope_cos_sin(position_ids, 32, 10000.0, (4, 6, 6), variant == "qwen3_vl", RopeScaling("linear", 4.0))
    assert cos.shape == (position_ids.shape[1], 32)
    assert torch.equal(cos, cos_hf[0]) and torch.equal(sin, sin_hf[0])
    plain, _ = mrope_cos_sin(position_ids, 32, 10000.0, (4, 6, 6), variant == "qwen3_vl")
    assert not torch.equal(cos, plain)


def test_mrope_axes_blocks_and_interleaved() -> None:
    assert mrope_axes(16, (2, 3, 3), interleaved=False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    # h at j % 3 == 1 below 3 * 3, w at j % 3 == 2 below 3 * 3, t elsewhere (section[0] is implied)
    assert mrope_axes(16, (2, 3, 3), interleaved=True).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    axes = mrope_axes(128, (24, 20, 20), interleaved=True)
    assert [int((axes == row).sum()) for row in range(3)] == [24, 20, 20]
    assert axes[60:].tolist() == [0, 0, 0, 0]


def test_text_only_is_plain_rope() -> None:
    from harmonia.model.layers import rope_cos_sin

    for variant in VARIANTS:
        position_ids = rope_index([("text", 9)], MERGE, variant)
        assert torch.equal(position_ids, torch.arange(9).expand(3, 9))
        cos, sin = mrope_cos_sin(position_ids, 32, 1e6, (4, 6, 6), variant == "qwen3_vl")
        want_cos, want_sin = rope_cos_sin(torch.arange(9), 32, 1e6)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


@pytest.mark.parametrize("segments,variant,error", [
    ([("video", (2, 4, 4))], "qwen3_vl", SampleError),  # Qwen3-VL frames go one per segment
    ([("video", (2, 4, 4), 0.5)], "qwen2_5_vl", ConfigError),  # tokens_per_second missing
    ([("image", (1, 3, 4))], "qwen2_vl", SampleError),  # h not a multiple of the merge size
    ([("audio", 4)], "qwen2_vl", SampleError),
    ([("image", 4)], "qwen2_vl", SampleError),  # a token count where the grid belongs
    ([("text", -1)], "qwen2_vl", SampleError),
    ([("text", 3)], "qwen4_vl", ConfigError),
])
def test_bad_samples_and_configs_raise(segments, variant, error) -> None:
    with pytest.raises(error):
        rope_index(segments, MERGE, variant)


def test_bad_mrope_section_raises() -> None:
    with pytest.raises(ConfigError):
        mrope_cos_sin(torch.zeros(3, 4, dtype=torch.int64), 32, 1e4, (4, 6, 5), False)
    with pytest.raises(ConfigError):
        mrope_cos_sin(torch.zeros(4, dtype=torch.int64), 32, 1e4, (4, 6, 6), False)
