"""Under torchrun every rank checks the job's shared paths before the model is built, and all agree:
a rank that cannot read data.path ends every rank with the same line, naming it, its host and the
path (`harmonia.train.worker.agree_on_storage`)."""

from __future__ import annotations

import socket

import pytest

from tests.distributed._spawn import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _agree(rank: int, world: int, root: str, missing_on: int) -> str | None:
    from harmonia.config import load_config
    from harmonia.train.worker import SharedStorageError, agree_on_storage

    data = f"{root}/{'not-mounted' if rank == missing_on else 'data'}"  # this rank's host lacks the mount
    config = load_config(None, [f"--data.path={data}", f"--checkpoint.dir={root}/ck"])
    try:
        agree_on_storage(config, world)
    except SharedStorageError as err:
        return str(err)
    return None


def test_a_rank_that_cannot_read_the_data_ends_every_rank_with_one_line(tmp_path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "ck").mkdir()
    assert run_workers(_agree, 3, (str(tmp_path), -1), timeout=60) == [None] * 3
    lines = run_workers(_agree, 3, (str(tmp_path), 2), timeout=60)
    assert lines == [f"rank 2 on host {socket.gethostname()} cannot read data.path={tmp_path}/not-mounted (no such "
                     "path on this host): put it on storage every node mounts"] * 3
