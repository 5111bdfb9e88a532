"""Reading the real traces, malformed CSVs, and synthesized mixtures."""

from collections import Counter

import pytest

from harmonia.errors import TraceError
from harmonia.workload.traces import load_trace, read_trace, synthesize_trace, write_trace


def test_real_traces_match_their_readme(shared_traces) -> None:
    ai2d = read_trace(shared_traces / "ai2d.csv")
    chartqa = read_trace(shared_traces / "chartqa.csv")
    assert len(ai2d) == 12413 and len(chartqa) == 18317
    tiles = Counter(s.items[0].tiles for s in ai2d)
    assert tiles == {1: 5793, 3: 3710, 4: 603, 5: 2307}
    text = [s.text_tokens for s in ai2d]
    assert (min(text), max(text), round(sum(text) / len(text))) == (37, 347, 54)


@pytest.mark.parametrize(
    "content, match",
    [
        ("image_tiles,llm_tokens\n1,300\nx,300\n", "row 3: column 'image_tiles' is 'x'"),
        ("image_tiles,llm_tokens\n-1,300\n", "row 2: column 'image_tiles' is -1"),
        ("image_tiles,llm_tokens\n5,300\n", "row 2: llm_tokens=300 is less than"),
        ("image_tiles,llm_tokens\n1\n", "row 2: expected 2 comma-separated fields"),
        ("tiles,tokens\n1,300\n", "not a known form"),
        ("image_tiles,llm_tokens\n", "no rows"),
    ],
)
def test_malformed_csv_names_the_row(tmp_path, content, match) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(TraceError, match=match):
        read_trace(path)


def test_a_dataset_given_as_a_trace_is_told_how_to_be_profiled(tmp_path) -> None:
    path = tmp_path / "llava.json"
    path.write_text('[{"image": "a.png", "conversations": []}]')
    with pytest.raises(TraceError, match=r"not a known form.*it looks like a dataset: .*--data\.path="):
        read_trace(path)
    (tmp_path / "other.csv").write_text("tiles,tokens\n1,300\n")
    with pytest.raises(TraceError, match="not a known form") as err:
        read_trace(tmp_path / "other.csv")
    assert "looks like a dataset" not in str(err.value)  # a CSV of other columns: no such hint


def test_synthesis_is_deterministic_and_follows_the_mix(tmp_path) -> None:
    a = synthesize_trace(2000, {"video": 0.5, "audio": 0.5}, seed=3)
    assert a == synthesize_trace(2000, {"video": 0.5, "audio": 0.5}, seed=3)
    assert a != synthesize_trace(2000, {"video": 0.5, "audio": 0.5}, seed=4)
    kinds = Counter(next(iter(s.modalities())) for s in a)
    assert set(kinds) == {"video", "audio"} and abs(kinds["video"] / 2000 - 0.5) < 0.05
    path = tmp_path / "mixed.csv"
    write_trace(a, path)
    assert [(s.text_tokens, s.items) for s in read_trace(path)] == [(s.text_tokens, s.items) for s in a]


def test_default_mix_has_every_modality() -> None:
    samples = load_trace("synthetic", n_samples=1000, seed=0)
    mods = Counter(m for s in samples for m in s.modalities())
    assert {"image", "video", "audio"} <= set(mods)
    assert any(not s.items for s in samples)


def test_bad_mix() -> None:
    with pytest.raises(TraceError, match="unknown sample kinds"):
        synthesize_trace(10, {"hologram": 1.0})
    with pytest.raises(TraceError, match="kind=proportion"):
        load_trace("synthetic:image=lots")
