"""Sample shapes, token conversions from module specs, and the multimodal attention pair count."""

import numpy as np
import pytest

from harmonia.errors import SampleError
from harmonia.model.presets import encoder_preset, mllm_preset
from harmonia.workload.shapes import (
    ModalityItem,
    SampleShape,
    encoder_sequences,
    find_tile_grid,
    image_tiles,
    llm_tokens_of_item,
)
from harmonia.workload.work import attended_pairs, llm_segments, sample_loads


def test_internvit_tile_conversions() -> None:
    enc = encoder_preset("internvit-300m-448")
    item = ModalityItem.image(tiles=5)
    assert encoder_sequences(item, enc) == [1025] * 5  # 32x32 patches + class token per tile
    assert llm_tokens_of_item(item, enc) == 5 * 256  # pixel shuffle 0.5: 1024 / 4


def test_dynamic_tiling_follows_aspect_ratio() -> None:
    enc = encoder_preset("internvit-300m-448")
    assert find_tile_grid(448, 448 * 3, 448, 12) == (3, 1)
    assert find_tile_grid(1000, 1000, 448, 12) == (3, 3)  # ties go to more tiles while > half covered
    assert find_tile_grid(800, 800, 448, 12) == (2, 2)
    assert image_tiles(ModalityItem.image(height=448, width=1344), enc) == 4  # 3 tiles + thumbnail
    assert image_tiles(ModalityItem.image(height=300, width=300), enc) == 1  # no thumbnail for 1 tile


def test_video_and_audio_conversions() -> None:
    vit = encoder_preset("internvit-300m-448")
    assert llm_tokens_of_item(ModalityItem.video(frames=8, tiles=1), vit) == 8 * 256
    whisper = encoder_preset("whisper-large-v3-encoder")
    assert encoder_sequences(ModalityItem.audio(30.0), whisper) == [1500]  # 3000 mel frames / 2
    assert encoder_sequences(ModalityItem.audio(45.0), whisper) == [1500, 1500]  # padded 30 s chunks
    with pytest.raises(SampleError, match="encodes"):
        encoder_sequences(ModalityItem.audio(3.0), vit)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(modality="smell"), "unknown modality"),
        (dict(modality="image", tiles=-1), "tiles=-1"),
        (dict(modality="audio"), "seconds"),
        (dict(modality="video", tiles=1), "frames"),
        (dict(modality="audio", seconds=-2.0), "seconds=-2.0"),
    ],
)
def test_bad_items_name_the_field(kwargs, match) -> None:
    with pytest.raises(SampleError, match=match):
        ModalityItem(**kwargs)


def test_bad_samples() -> None:
    with pytest.raises(SampleError, match="text_tokens=-3"):
        SampleShape(-3)
    with pytest.raises(SampleError, match="empty"):
        SampleShape(0)
    with pytest.raises(SampleError, match="item_offsets"):
        SampleShape(10, (ModalityItem.image(tiles=1),), item_offsets=(11,))


def brute_force_pairs(segments: list[tuple[str, int]]) -> int:
    """Build the boolean mask token by token and count it."""
    kinds, item_of = [], []
    for idx, (kind, n) in enumerate(segments):
        kinds += [kind] * n
        item_of += [idx if kind == "item" else -1] * n
    n = len(kinds)
    mask = np.zeros((n, n), dtype=bool)
    for q in range(n):
        for k in range(n):
            mask[q, k] = k <= q or (item_of[q] >= 0 and item_of[q] == item_of[k])
    return int(mask.sum())


@pytest.mark.parametrize("seed", range(6))
def test_attended_pairs_match_the_mask(seed: int) -> None:
    rng = np.random.default_rng(seed)
    segments = [(str(rng.choice(["text", "item"])), int(rng.integers(1, 9))) for _ in range(5)]
    assert attended_pairs(segments) == brute_force_pairs(segments)


def test_sample_loads_place_items_by_offset() -> None:
    mllm = mllm_preset("tiny-omni")
    s = SampleShape(10, (ModalityItem.image(tiles=2), ModalityItem.audio(1.0)), item_offsets=(3, 7))
    segs = llm_segments(s, mllm)
    assert [k for k, _ in segs] == ["text", "item", "text", "item", "text"]
    loads = sample_loads(s, mllm)
    assert loads["vision"].sequences == 2 and loads["audio"].sequences == 1
    assert loads["llm"].tokens == 10 + loads["vision_proj"].tokens + loads["audio_proj"].tokens
    assert loads["llm"].pairs == brute_force_pairs(segs)


def test_a_total_of_loads_is_their_sum() -> None:
    from harmonia.workload.work import ModuleLoad

    loads = [ModuleLoad(3, 7, 1), ModuleLoad(5, 11, 2, window_pairs=4), ModuleLoad(2, 9, 1)]
    assert ModuleLoad.total(loads) == loads[0] + loads[1] + loads[2] == ModuleLoad(10, 27, 4, 4 + 7 + 9)
    assert ModuleLoad.total(loads[::2]) == ModuleLoad(5, 16, 2) and ModuleLoad.total([]) == ModuleLoad()


def test_a_shapes_kept_hash_is_its_fields_hash_and_never_travels() -> None:
    import pickle

    shape = SampleShape(12, (ModalityItem("image", tiles=3), ModalityItem("audio", seconds=2.5)), (0, 4), sample_id=7)
    twin = SampleShape(12, (ModalityItem("image", tiles=3), ModalityItem("audio", seconds=2.5)), (0, 4), sample_id=7)
    assert hash(shape) == hash(twin) == hash((12, shape.items, (0, 4), 7)) and shape == twin
    assert {shape: 1}[twin] == 1
    copy = pickle.loads(pickle.dumps(shape))  # another process hashes its strings differently
    assert "_hash" not in copy.__dict__ and copy == shape and hash(copy) == hash(shape)
    assert SampleShape(12, shape.items, (0, 4), sample_id=8) != shape
