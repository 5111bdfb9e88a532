"""Layouts: rank grids, groups, stage splits, and bad input."""

import json

import pytest

from harmonia.errors import LayoutError
from harmonia.schedule.layout import Layout


def test_grid_order_tp_fastest() -> None:
    layout = Layout(tp=2, cp=1, dp=2, pp=2, rank_offset=4)
    assert layout.size == 8 and layout.rank_list() == tuple(range(4, 12))
    assert layout.rank_at(pp=1, dp=0, tp=1) == 4 + 5
    assert layout.coords(9) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert layout.group_ranks("tp") == [(4, 5), (6, 7), (8, 9), (10, 11)]
    assert layout.group_ranks("pp") == [(4, 8), (5, 9), (6, 10), (7, 11)]


def test_explicit_ranks_and_stage_split() -> None:
    layout = Layout(dp=2, pp=2, ranks=(7, 3, 5, 1), virtual_stages=2)
    assert layout.rank_at(pp=1, dp=1) == 1
    assert [r for r in range(9) if layout.holds(r)] == [1, 3, 5, 7]
    assert [r for r in range(9) if Layout(dp=3, rank_offset=4).holds(r)] == [4, 5, 6]
    assert layout.stage_split(10) == (3, 3, 2, 2)
    with pytest.raises(LayoutError, match="sum to"):
        Layout(pp=2, stage_layers=(3, 3)).stage_split(7)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tp=0), "tp=0"),
        (dict(dp=2, ranks=(0,)), "exactly 2"),
        (dict(dp=2, ranks=(1, 1)), "distinct"),
        (dict(pp=2, stage_layers=(1,)), "stage chunks"),
        (dict(dp=2, reshard=True), "without fsdp"),
    ],
)
def test_bad_layouts(kwargs, match) -> None:
    with pytest.raises(LayoutError, match=match):
        Layout(**kwargs)


def test_describe_names_only_the_degrees_in_use() -> None:
    assert Layout(tp=2, pp=8, dp=4, virtual_stages=4, fsdp=True).describe() == "tp2 pp8 v4 dp4 fsdp"
    assert Layout(tp=1, cp=2, dp=1, fsdp=True).describe() == "tp1 cp2 pp1 dp1"
    assert Layout(tp=2, dp=4, fsdp=True, reshard=True).describe() == "tp2 pp1 dp4 fsdp reshard"
    assert Layout(dp=1, fsdp=True, reshard=True).describe() == "tp1 pp1 dp1"


def test_reshard_text_round_trips_and_is_refused_where_the_runtime_cannot_run_it() -> None:
    from harmonia.plan.layout_text import parse_layout
    from harmonia.schedule.plan import Plan

    layout = parse_layout("tp2 pp2 dp4 fsdp reshard")
    assert (layout.fsdp, layout.reshard, layout.describe()) == (True, True, "tp2 pp2 dp4 fsdp reshard")
    assert Plan.from_json(Plan("m", {"llm": layout}, global_batch=64).to_json()).layouts["llm"] == layout
    for text in ("dp4 reshard", "dp4 fsdp reshard reshard"):
        with pytest.raises(LayoutError, match="unknown or repeated"):
            parse_layout(text)
    llm = Layout(dp=2, fsdp=True, reshard=True)
    with pytest.raises(LayoutError, match="zero bubble splits the backward"):
        Plan("m", {"llm": llm}, schedule="zb", global_batch=64)
    with pytest.raises(LayoutError, match="vision: fsdp reshard is for the LLM only"):
        Plan("m", {"vision": llm, "llm": llm}, global_batch=64)
    raw = json.loads(Plan("m", {"llm": Layout(dp=2)}, global_batch=64).to_json())
    raw["layouts"]["llm"]["reshard"] = True  # a plan file edited by hand
    with pytest.raises(LayoutError, match="without fsdp"):
        Plan.from_json(json.dumps(raw))
