"""What each rank does under torchrun before the model is built: wait for rank 0's preparation (as
long as ``parallel.prepare_timeout_s`` says, saying so) and check the job's shared paths, refusing
with one line that names the rank, its host and the path."""

from __future__ import annotations

import datetime
import logging
import pickle
import socket
import threading
import time

import pytest
import torch.distributed as dist

from harmonia.config import load_config
from harmonia.errors import ConfigError
from harmonia.train.worker import (PREPARED_KEY, PreparationTimeout, _shared_plan, storage_refusal,
                                   unreachable_path)


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def _config(tmp_path, *extra: str):
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "ck").mkdir(exist_ok=True)
    return load_config(None, [f"--data.path={tmp_path / 'data'}", f"--checkpoint.dir={tmp_path / 'ck'}", *extra])


class _Plan:
    def to_json(self) -> str:
        return '{"plan": 1}'


def _ranks(store, config, prepare) -> dict[int, object]:
    """Rank 0 and rank 1 of `_shared_plan`, each in its own thread: what each returned or raised."""
    seen: dict[int, object] = {}

    def rank(r: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10))
        try:
            seen[r] = _shared_plan(config, r, 2, client, prepare)[:2]
        except Exception as err:  # noqa: BLE001 -- what the rank would end with
            seen[r] = err

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return seen


def test_the_ranks_wait_for_rank_0_as_long_as_the_config_says(store, tmp_path, caplog, monkeypatch) -> None:
    config = _config(tmp_path, "--parallel.prepare_timeout_s=20")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")

    def slow(config):
        time.sleep(1.5)  # longer than a short collective timeout would allow; the config's wait does
        return _Plan(), config, None

    with caplog.at_level(logging.INFO, logger="harmonia.train.worker"):
        seen = _ranks(store, config, slow)
    assert seen[0] == seen[1] == ('{"plan": 1}', config)
    assert (f"rank 1 waits for rank 0 to prepare the data and the plan (up to 20 s: parallel.prepare_timeout_s); "
            f"so do the other 3 ranks on host {socket.gethostname()}") in caplog.messages


def test_a_wait_that_expires_names_what_it_waited_for(store, tmp_path) -> None:
    config = _config(tmp_path, "--parallel.prepare_timeout_s=0.5")
    t0 = time.monotonic()
    with pytest.raises(PreparationTimeout) as err:
        _shared_plan(config, 1, 2, store, prepare=None)
    assert 0.5 <= time.monotonic() - t0 < 5
    assert str(err.value) == ("rank 1 waited 0.5 s for rank 0 to prepare the data and the plan (the shape pass over "
                              "data.path, the plan search), which it has not finished: see rank 0's output for where "
                              "it is, and raise parallel.prepare_timeout_s where it needs longer")


def test_rank_0s_error_ends_every_rank(store, tmp_path) -> None:
    def refused(config):
        raise ConfigError("data.path='x' does not exist")

    seen = _ranks(store, _config(tmp_path), refused)
    assert all(isinstance(e, ConfigError) and str(e) == "data.path='x' does not exist" for e in seen.values())
    assert pickle.loads(store.get(PREPARED_KEY)).args == ("data.path='x' does not exist",)


def test_the_shared_paths_a_rank_cannot_use_are_named(tmp_path) -> None:
    config = _config(tmp_path)
    assert unreachable_path(config) is None
    missing = tmp_path / "elsewhere"
    assert unreachable_path(_config(tmp_path, f"--data.path={missing}")) == (
        f"cannot read data.path={missing} (no such path on this host)")
    assert unreachable_path(_config(tmp_path, f"--data.media_root={missing}")) == (
        f"cannot read data.media_root={missing} (no such path on this host)")
    (tmp_path / "ck").rmdir()
    assert unreachable_path(config) == (f"cannot write checkpoint.dir={tmp_path / 'ck'} (no such directory on this "
                                        "host, though rank 0 created it)")


def test_one_line_names_the_first_rank_its_host_and_the_path() -> None:
    problem = "cannot read data.path=/shared/x (no such path on this host)"
    assert storage_refusal([("node-a", None)] * 9) is None
    assert storage_refusal([("node-a", None)] * 9 + [("node-b", problem)]) == (
        "rank 9 on host node-b cannot read data.path=/shared/x (no such path on this host): put it on storage every "
        "node mounts (rank 0 runs on host node-a)")
    assert storage_refusal([("node-a", None), ("node-b", problem), ("node-b", problem), ("node-c", problem)]) == (
        "rank 1 on host node-b cannot read data.path=/shared/x (no such path on this host): put it on storage every "
        "node mounts (rank 0 runs on host node-a); 2 more ranks cannot either (hosts node-b, node-c)")
