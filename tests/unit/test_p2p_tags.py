"""P2P tags: a send and its receive agree, and no two messages between two ranks share a tag."""

import pytest

from harmonia.runtime.p2p import message_tag
from harmonia.schedule import StageGraph, build_schedule, lower
from harmonia.schedule.layout import Layout


@pytest.mark.parametrize("family, layout", [("1f1b", Layout(pp=4)), ("zb", Layout(pp=2)),
                                            ("interleaved", Layout(pp=2, virtual_stages=2))])
def test_tags_match_and_are_unique(family, layout):
    graph = StageGraph.from_layouts({"llm": layout}, {"llm": True})
    schedule = lower(build_schedule(graph, 8, family))
    sends, recvs = {}, {}
    for rank, acts in schedule.orders.items():
        for a in acts:
            if a.kind.is_send:
                key = (rank, a.peer_rank, message_tag(a))
                assert key not in sends, f"{a} reuses a tag"
                sends[key] = a
            elif a.kind.is_recv:
                recvs[(a.peer_rank, rank, message_tag(a))] = a
    assert sends and set(sends) == set(recvs)
