"""A `harmonia train` job's communication replayed under NCCL's rules.

``with nccl_replayed(directory): run_training(...)`` makes every rank of the job record the
point-to-point operations and collectives it issues (``HARMONIA_COMM_RECORD``,
`harmonia.runtime.comm_record`), then replays the records (`harmonia.sim.nccl_replay`: one stream per
pair of ranks, as PyTorch issues unbatched sends and receives on lazily created communicators, and
one per process group, collectives included, as it issues everything once communicators are created
eagerly, `device_id`): a deadlock, a size or dtype mismatch, or collectives in different orders
fail the test.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from harmonia.runtime.comm_record import ENV
from harmonia.sim.nccl_replay import ReplayReport, replay_dir


@contextlib.contextmanager
def nccl_replayed(directory: Path) -> Iterator[list[ReplayReport]]:
    """Record the job run inside the block into ``directory``; the replays' reports are appended to
    the yielded list once the block ends."""
    directory.mkdir(parents=True, exist_ok=True)
    before = os.environ.get(ENV)
    os.environ[ENV] = str(directory)
    reports: list[ReplayReport] = []
    try:
        yield reports
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
    assert any(directory.glob("rank*.jsonl")), f"no rank wrote its record into {directory}"
    reports += [replay_dir(directory, streams=streams) for streams in ("pair", "group")]
