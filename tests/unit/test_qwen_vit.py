"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision towers against transformers' (tiny random configs, fp32, CPU)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
    get_vision_window_index,
)

from harmonia.errors import ConfigError, SampleError
from harmonia.model.hf.qwen_vision import hf_key, state_from_hf, state_to_hf
from harmonia.model.qwen_spec import spec_from_hf
from harmonia.model.attention import PackedAttention
from harmonia.model.qwen_vit import (
    PatchCache,
    build_qwen_vision_tower,
    frame_lengths,
    plan_pos_interpolation,
    plan_positions,
    plan_windows,
    rope_tables,
)

TOL = {"atol": 1e-5, "rtol": 1e-5}
PATCH, MERGE, WINDOW = 4, 2, 16  # windows of 16 px = 2 x 2 merged tokens = 4 x 4 patches
# (t, h, w) patch grids: an image, a very wide and a very tall one, a video of 3 frames, and one image
# of more patches than a query block of the `segments` kernel (256)
GRIDS = [(1, 6, 8), (1, 2, 20), (1, 18, 2), (3, 6, 4), (1, 16, 18)]

CONFIGS = {
    "qwen2_vl": lambda: transformers.Qwen2VLVisionConfig(
        depth=3, embed_dim=32, hidden_size=24, num_heads=4, mlp_ratio=2, patch_size=PATCH,
        spatial_merge_size=MERGE, temporal_patch_size=2),
    "qwen2_5_vl": lambda: transformers.Qwen2_5_VLVisionConfig(
        depth=4, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
        temporal_patch_size=2, window_size=WINDOW, fullatt_block_indexes=[1], out_hidden_size=24),
    "qwen3_vl": lambda: transformers.Qwen3VLVisionConfig(
        depth=3, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=PATCH, spatial_merge_size=MERGE,
        temporal_patch_size=2, num_position_embeddings=36, deepstack_visual_indexes=[0, 2], out_hidden_size=24),
}
MODELS = {"qwen2_vl": Qwen2VisionTransformerPretrainedModel, "qwen2_5_vl": Qwen2_5_VisionTransformerPretrainedModel,
          "qwen3_vl": Qwen3VLVisionModel}


def _randomize(model: torch.nn.Module) -> None:
    """Non-trivial norms and biases too, so that a swapped or dropped tensor shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))


def _pair(family: str):
    """transformers' tower with random weights, and ours built from its config and loaded from its state."""
    config = CONFIGS[family]()
    config._attn_implementation = "sdpa"
    hf = MODELS[family](config).eval()
    _randomize(hf)
    spec = spec_from_hf(config.to_dict())
    ours = build_qwen_vision_tower(spec).eval()
    ours.load_state_dict(state_from_hf(hf.state_dict(), spec), strict=True)
    return hf, ours, spec


def _inputs(spec, grids=GRIDS):
    torch.manual_seed(1)
    grid_thw = torch.tensor(grids)
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, spec.patch_dim), grid_thw


def _hf_outputs(hf, pixels, grid_thw) -> list[torch.Tensor]:
    out = hf(pixels, grid_thw)
    return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]


def _our_outputs(ours, pixels, grid_thw) -> list[torch.Tensor]:
    out = ours(pixels, grid_thw)
    return [out.tokens, *out.deepstack]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_outputs_match_transformers(family):
    hf, ours, spec = _pair(family)
    pixels, grid_thw = _inputs(spec)
    with torch.no_grad():
        want, got = _hf_outputs(hf, pixels, grid_thw), _our_outputs(ours, pixels, grid_thw)
    n_tokens = sum(t * h * w for t, h, w in GRIDS) // MERGE ** 2
    assert len(got) == len(want) == 1 + len(spec.deepstack_layers)
    for g, w in zip(got, want):
        assert g.shape == w.shape == (n_tokens, 24)
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_gradients_match_transformers(family):
    hf, ours, spec = _pair(family)
    pixels, grid_thw = _inputs(spec)
    torch.manual_seed(2)
    weights = [torch.randn(sum(t * h * w for t, h, w in GRIDS) // MERGE ** 2, 24)
               for _ in range(1 + len(spec.deepstack_layers))]
    grads = {}
    for name, model, run in (("hf", hf, _hf_outputs), ("ours", ours, _our_outputs)):
        x = pixels.clone().requires_grad_(True)
        sum((out * w).sum() for out, w in zip(run(model, x, grid_thw), weights)).backward()
        grads[name] = x.grad
    torch.testing.assert_close(grads["ours"], grads["hf"], **TOL)
    want = state_from_hf({k: p.grad for k, p in hf.named_parameters()}, spec)
    got = {k: p.grad for k, p in ours.named_parameters()}
    assert got.keys() == want.keys()
    for k in got:
        assert got[k] is not None and got[k].abs().sum() > 0, k
        # weight gradients sum over hundreds of tokens and reach ~100: 1e-5 of their scale (fp32 sums)
        scale = max(1.0, want[k].abs().max().item())
        torch.testing.assert_close(got[k], want[k], atol=1e-5 * scale, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("family", list(CONFIGS))
def test_items_attend_only_themselves(family):
    """Packing items in one call gives each item what it gets alone (no attention across items or frames)."""
    _, ours, spec = _pair(family)
    pixels, grid_thw = _inputs(spec)
    with torch.no_grad():
        packed = _our_outputs(ours, pixels, grid_thw)
        alone = [_our_outputs(ours, px, grid_thw[i:i + 1])
                 for i, px in enumerate(pixels.split([t * h * w for t, h, w in GRIDS]))]
    for j, out in enumerate(packed):
        torch.testing.assert_close(out, torch.cat([a[j] for a in alone]), **TOL)


def test_plans_match_transformers():
    grid_thw = torch.tensor(GRIDS)
    order, lengths = plan_windows(GRIDS, MERGE, WINDOW // MERGE // PATCH)
    window_index, cu_windows = get_vision_window_index(grid_thw, MERGE, WINDOW, PATCH)
    unit = MERGE ** 2
    assert torch.equal(order, (window_index[:, None] * unit + torch.arange(unit)).flatten())
    assert torch.equal(torch.tensor([0, *lengths]).cumsum(0), cu_windows.long())
    assert len(lengths) > len(frame_lengths(GRIDS))  # windows do cut the frames
    assert torch.equal(torch.tensor([0, *frame_lengths(GRIDS)]).cumsum(0), get_vision_cu_seqlens(grid_thw).long())
    assert torch.equal(plan_positions(GRIDS, MERGE), get_vision_position_ids(grid_thw, MERGE))
    rows, weights = plan_pos_interpolation(GRIDS, MERGE, 6)
    hf_rows, hf_weights = get_vision_interpolation_indices_and_weights(
        grid_thw, 6, mode="bilinear", align_corners=True, spatial_merge_size=MERGE)
    assert torch.equal(rows, hf_rows)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_a_batch_plan_from_its_items_equals_the_batch_planned_whole(family):
    """Items' plans, kept and reused in other batches, give the plan of the whole batch's grids."""
    _, ours, spec = _pair(family)
    ours.plan(GRIDS[2:4], torch.device("cpu"))  # items planned in another batch first
    grids = GRIDS + GRIDS[:2]
    plan = ours.plan(grids, torch.device("cpu"))
    positions = plan_positions(grids, MERGE)
    if family == "qwen2_5_vl":
        order, lengths = plan_windows(grids, MERGE, spec.window_tokens)
        assert torch.equal(plan.order, order) and torch.equal(plan.back, torch.argsort(order))
        assert torch.equal(plan.windows.packed.keys.sample, PackedAttention.sequences(lengths).keys.sample)
        positions = positions[order]
    else:
        assert plan.order is plan.back is plan.windows is None
    want = rope_tables(positions, spec.body.dim_head, spec.rope_theta)
    assert all(torch.equal(a, b) for a, b in zip(plan.rope, want))
    assert torch.equal(plan.frames.packed.keys.sample, PackedAttention.sequences(frame_lengths(grids)).keys.sample)
    assert len(ours._item_plans) == len(set(grids))


def test_kept_plans_stay_within_their_patch_budget():
    cache, built = PatchCache(100), []

    def get(key, patches):
        return cache.get(key, patches, lambda: built.append(key) or key)

    assert get("a", 40) == "a" and get("b", 40) == "b" and get("a", 40) == "a"  # a used last
    get("c", 40)  # 120 > 100: b, the least recently used, goes
    assert len(cache) == 2 and get("a", 40) == "a" and built == ["a", "b", "c"]
    get("b", 40)
    assert built == ["a", "b", "c", "b"]
    get("huge", 101)  # alone over the budget: everything goes, itself included
    assert len(cache) == 0


@pytest.mark.parametrize("family", list(CONFIGS))
def test_checkpoint_names_round_trip(family):
    hf, ours, spec = _pair(family)
    hf_state = hf.state_dict()
    back = state_to_hf(state_from_hf(hf_state, spec), spec)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    assert {hf_key(k, family) for k in ours.state_dict()} == set(hf_state)
    assert hf_key("layers.2.attn.k_proj.bias", family) == "blocks.2.attn.qkv.bias"
    with pytest.raises(ConfigError, match="not a tensor"):
        hf_key("layers.0.attn.nope.weight", family)


def test_whole_model_config_is_read():
    vision = CONFIGS["qwen2_5_vl"]().to_dict()
    whole = transformers.Qwen2_5_VLConfig(vision_config=vision).to_dict()
    assert spec_from_hf(whole) == spec_from_hf(vision)
    hub = {"model_type": "qwen2_vl", "vision_config": {"depth": 2, "embed_dim": 64, "mlp_ratio": 4, "num_heads": 4,
                                                       "in_chans": 3, "hidden_size": 96, "patch_size": 14}}
    spec = spec_from_hf(hub)  # a hub config.json: defaults filled in as transformers does
    assert (spec.body.hidden, spec.body.ffn_hidden, spec.out_dim, spec.body.gelu_approximate) == (64, 256, 96, "quick")


@pytest.mark.parametrize("family, field, value", [
    ("qwen2_vl", "hidden_act", "relu"),
    ("qwen2_5_vl", "hidden_act", "gelu"),
    ("qwen3_vl", "hidden_act", "swish"),
    ("qwen2_5_vl", "window_size", 4),
    ("qwen2_5_vl", "fullatt_block_indexes", [1, 7]),
    ("qwen3_vl", "deepstack_visual_indexes", [2, 0]),
    ("qwen3_vl", "num_position_embeddings", 35),
    ("qwen2_vl", "patch_size", [4, 4]),
    ("qwen2_vl", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}),
])
def test_unimplemented_config_values_are_refused(family, field, value):
    config = {**CONFIGS[family]().to_dict(), field: value}
    spec_from_hf(CONFIGS[family]().to_dict())  # the unchanged config is fine
    with pytest.raises(ConfigError, match=field):
        spec_from_hf(config)


def test_unknown_model_type_is_refused():
    with pytest.raises(ConfigError, match="model_type"):
        spec_from_hf({"model_type": "qwen4_vl_vision"})


def test_bad_grids_are_refused():
    _, ours, spec = _pair("qwen2_vl")
    pixels, grid_thw = _inputs(spec)
    with pytest.raises(SampleError, match="patches"):
        ours(pixels[1:], grid_thw)
    with pytest.raises(SampleError, match="merge_size"):
        ours(pixels[:15], torch.tensor([[1, 3, 5]]))


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("cuts", [(1,), (2,), (1, 2)])
def test_pipeline_stages_carry_deepstack_outputs_and_equal_the_whole_encoder(family, cuts):
    """The tower's blocks split into stages at ``cuts``: each inner stage sends its hidden state and the
    deepstack outputs so far, and the last stage's rows equal the one-stage encoder's (gradients too)."""
    from harmonia.model.qwen_vit import build_qwen_vision_encoder

    _, _, spec = _pair(family)
    whole = build_qwen_vision_encoder(spec)
    bounds = [0, *cuts, spec.body.n_layers]
    stages = [build_qwen_vision_encoder(spec, (a, b)) for a, b in zip(bounds, bounds[1:])]
    state = whole.state_dict()
    for stage in stages:
        own = stage.state_dict()
        stage.load_state_dict({k: state[k] for k in own}, strict=True)
    pixels, grid_thw = _inputs(spec)
    want = whole(pixels, grid_thw)
    x = pixels
    for a, stage in zip(bounds, stages):
        if a:
            assert x.shape[1] == spec.body.hidden * (1 + len(spec.carried_taps(a)))
        x = stage(x, grid_thw)
    torch.testing.assert_close(x, want, **TOL)
    g = torch.randn_like(want)
    grads_whole = torch.autograd.grad(want, list(whole.parameters()), g)
    grads_staged = torch.autograd.grad(x, [p for s in stages for p in s.parameters()], g)
    by_name = dict(zip([n for n, _ in whole.named_parameters()], grads_whole))
    staged = [n for s in stages for n, _ in s.named_parameters()]
    for name, grad in zip(staged, grads_staged):
        torch.testing.assert_close(grad, by_name[name], **TOL)
