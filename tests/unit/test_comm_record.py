"""`comm_record` records what a process really issues, once per call, and the record replays."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harmonia.errors import ConfigError
from harmonia.runtime.comm_record import (ENV, maybe_record_from_env, read_record, record_comms,
                                          uninstall_recorder, write_record)
from harmonia.sim.nccl_replay import Collective, Issue, P2POp, Wait, read_record_dir, replay_dir
from tests.distributed._spawn import free_port

ORIGINALS = {name: getattr(dist, name) for name in ("isend", "batch_isend_irecv", "all_reduce")}


def test_collectives_are_recorded_once_and_patches_undone(one_process_group, tmp_path: Path) -> None:
    with record_comms() as rec:
        assert dist.isend is not ORIGINALS["isend"]
        assert dist.distributed_c10d.all_reduce is dist.all_reduce  # the module's own calls are seen too
        t = torch.ones(6, dtype=torch.bfloat16)
        dist.all_reduce(t)
        dist.all_reduce(torch.ones(2), async_op=True).wait()
        dist.barrier()
        out: list = [None]
        dist.all_gather_object(out, {"a": 1})  # its inner all_gathers are not recorded again
        path = write_record(tmp_path / "rank0.jsonl")
    assert {name: getattr(dist, name) for name in ORIGINALS} == ORIGINALS
    assert dist.distributed_c10d.isend is ORIGINALS["isend"]
    world = dist.group.WORLD.group_name  # each event names its communicator
    assert rec.events == [Collective((0,), "all_reduce", 6, "bfloat16", comm=world),
                          Collective((0,), "all_reduce", 2, "float32", blocking=False, comm=world),
                          Collective((0,), "barrier", 0, "", comm=world),
                          Collective((0,), "all_gather_object", 0, "", comm=world)]
    assert read_record(path) == rec.events
    assert str(replay_dir(tmp_path)) == "1 ranks, 0 p2p ops (0 batched), 4 collectives: no deadlock, sizes match"


def test_a_second_recorder_is_refused() -> None:
    with record_comms(), pytest.raises(ConfigError, match="already on"):
        with record_comms():
            pass
    with pytest.raises(ConfigError, match="no comm recorder is installed"):
        write_record("unused.jsonl")


def _two_ranks(rank: int, port: int, directory: str) -> None:
    """Rank 0 and 1 swap a buffer in one batch, reduce, then 0 sends 1 a blocking message."""
    os.environ[ENV] = directory
    maybe_record_from_env()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        peer = 1 - rank
        mine, theirs = torch.full((3,), float(rank)), torch.empty(3)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer),
                                        dist.P2POp(dist.irecv, theirs, peer)])
        for work in works:
            work.wait()
        assert theirs.tolist() == [float(peer)] * 3
        dist.all_reduce(mine)
        if rank == 0:
            dist.send(torch.ones(2, dtype=torch.int64), 1)
        else:
            dist.recv(torch.empty(2, dtype=torch.int64), 0)
        dist.barrier()  # neither rank tears its pair down while the other still reads from it
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_ranks_record_a_batch_once_and_replay_clean(tmp_path: Path) -> None:
    context = mp.start_processes(_two_ranks, args=(free_port(), str(tmp_path)), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + 60
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the two ranks did not finish within 60 s"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    events = read_record_dir(tmp_path)
    g, w = (0, 1), events[0][3].comm  # the default group's name
    assert w
    assert events[0] == [Issue((P2POp(g, 1, True, 3, "float32", w), P2POp(g, 1, False, 3, "float32", w)), True),
                         Wait(0), Wait(1), Collective(g, "all_reduce", 3, "float32", comm=w),
                         Issue((P2POp(g, 1, True, 2, "int64", w),), False), Wait(2),
                         Collective(g, "barrier", 0, "", comm=w)]
    assert events[1][-3:] == [Issue((P2POp(g, 0, False, 2, "int64", w),), False), Wait(2),
                              Collective(g, "barrier", 0, "", comm=w)]
    report = replay_dir(tmp_path)
    assert (report.ranks, report.p2p_ops, report.batched_ops, report.batches, report.collectives) == (2, 6, 4, 2, 4)


def teardown_module() -> None:
    uninstall_recorder()
