"""Record every p2p op and collective this process issues, for `harmonia.sim.nccl_replay`.

A recorder wraps the functions of ``torch.distributed`` that communicate (``isend``, ``irecv``,
``send``, ``recv``, ``batch_isend_irecv`` and the collectives in `COLLECTIVES`) and appends one event
per call to its list, in call order, then forwards the call unchanged:

- ``isend``/``irecv``: an unbatched `Issue`; the returned work is wrapped (`RecordedWork`) so
  that its ``wait()`` records a `Wait` first. ``send``/``recv`` (blocking): `Issue` then `Wait`.
- ``batch_isend_irecv``: one batched `Issue`; each returned work waits for its op (for all of the
  batch's ops where the backend returns one work per batch, as NCCL's coalescing does).
- collectives: a `Collective` with the group's ranks, the size of the buffer every member passes
  alike (none for object collectives and uneven ``all_to_all_single``) and whether it blocks.

Calls made from inside a recorded call (``send`` calls ``isend``, ``batch_isend_irecv`` calls each
op's ``isend``/``irecv``, ``all_gather_object`` calls ``all_gather``) are not recorded again. Calls
on a group this rank is not in communicate nothing and are not recorded.

The recorder patches the attributes of ``torch.distributed`` (and the same objects on
``torch.distributed.distributed_c10d``), so it is process-wide by nature: one at a time. Build the
``dist.P2POp`` objects of a batch while it is installed (``P2POp`` checks its ``op`` against the
module's current ``isend``/``irecv``).

Usage: ``with record_comms() as rec: ...; write_record(path, rec)``, or set
``HARMONIA_COMM_RECORD=<dir>`` and call `maybe_record_from_env` at process start: each rank writes
``<dir>/rank<N>.jsonl`` at exit, and ``harmonia.sim.nccl_replay.replay_dir(<dir>)`` replays them.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from harmonia.errors import ConfigError
from harmonia.sim.nccl_replay import Collective, Event, Issue, P2POp, Wait, read_record, to_json

__all__ = ["COLLECTIVES", "ENV", "CommRecorder", "RecordedWork", "install_recorder",
           "maybe_record_from_env", "read_record", "record_comms", "uninstall_recorder",
           "write_record"]

ENV = "HARMONIA_COMM_RECORD"
"""A directory: `maybe_record_from_env` records this process into ``<dir>/rank<N>.jsonl``."""

P2P = {"isend": (True, False), "irecv": (False, False), "send": (True, True), "recv": (False, True)}
"""Each p2p function: (sends, blocks)."""

COLLECTIVES: dict[str, str | None] = {
    "all_reduce": "tensor", "all_gather": "tensor", "all_gather_into_tensor": "input_tensor",
    "reduce_scatter_tensor": "input", "broadcast": "tensor", "barrier": None,
    "all_to_all_single": "input", "gather": "tensor", "scatter": "tensor",
    "all_gather_object": None, "broadcast_object_list": None,
}
"""Each wrapped collective: the argument whose size every member passes alike (None: no size)."""

_active: CommRecorder | None = None


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class RecordedWork:
    """A ``dist.Work`` whose ``wait()`` records a `Wait` for each of its p2p ops, then waits."""

    __slots__ = ("_ids", "_recorder", "_work")

    def __init__(self, work: Any, ids: Sequence[int], recorder: CommRecorder) -> None:
        self._work = work
        self._ids = tuple(ids)
        self._recorder = recorder

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._recorder.add_waits(self._ids)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommRecorder:
    """The events of this process, and the patches that record them.

    Attributes:
        events: every recorded event, in call order.
        rank: this process's global rank, known from its first recorded call (None before).
    """

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.rank: int | None = None
        self._next_id = 0
        self._groups: dict[Any, tuple[int, ...] | None] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._patched: list[tuple[Any, str, Any]] = []
        self._writes_at_exit = False

    # -- recording --

    @contextlib.contextmanager
    def _inside(self) -> Iterator[None]:
        """Calls made in this block are not recorded (they are part of a recorded one)."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def _recording(self) -> bool:
        return getattr(self._local, "depth", 0) == 0

    def group_name(self, group: Any) -> str:
        """The process group's name (each group is its own communicator, whatever its ranks)."""
        return str(getattr(group if group is not None else dist.group.WORLD, "group_name", ""))

    def group_ranks(self, group: Any) -> tuple[int, ...] | None:
        """The sorted global ranks of ``group`` (None: the default group), or None where this rank
        is not in it."""
        key = group if group is not None else dist.group.WORLD
        if key not in self._groups:
            try:
                ranks = tuple(sorted(dist.get_process_group_ranks(key)))
            except (RuntimeError, ValueError):
                ranks = None
            if self.rank is None:
                self.rank = dist.get_rank()
            self._groups[key] = ranks if ranks is not None and self.rank in ranks else None
        return self._groups[key]

    def add_issue(self, ops: tuple[P2POp, ...], batched: bool) -> list[int]:
        """Record one `Issue` of ``ops``; their per-rank ids."""
        with self._lock:
            ids = list(range(self._next_id, self._next_id + len(ops)))
            self._next_id += len(ops)
            self.events.append(Issue(ops, batched))
        return ids

    def add_waits(self, ids: Sequence[int]) -> None:
        with self._lock:
            self.events.extend(Wait(i) for i in ids)

    def add_collective(self, call: Collective) -> None:
        with self._lock:
            self.events.append(call)

    # -- the wrappers --

    def _p2p(self, original: Callable, name: str) -> Callable:
        sends, blocks = P2P[name]
        signature = inspect.signature(original)
        peer_arg, group_peer_arg = ("dst", "group_dst") if sends else ("src", "group_src")

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            op = self._bind_p2p(signature, args, kwargs, sends, peer_arg, group_peer_arg)
            if op is None:
                with self._inside():
                    return original(*args, **kwargs)
            ids = self.add_issue((op,), batched=False)
            if blocks:
                self.add_waits(ids)
            with self._inside():
                result = original(*args, **kwargs)
            return result if blocks or result is None else RecordedWork(result, ids, self)

        return wrapper

    def _bind_p2p(self, signature: inspect.Signature, args: tuple, kwargs: dict, sends: bool,
                  peer_arg: str, group_peer_arg: str) -> P2POp | None:
        """The op of one ``isend``/``irecv``/``send``/``recv`` call, None if not to record."""
        if not self._recording():
            return None
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:
            return None  # the original raises the error
        group = bound.get("group")
        ranks = self.group_ranks(group)
        if ranks is None:
            return None
        peer = bound.get(peer_arg)
        if peer is None and bound.get(group_peer_arg) is not None:
            pg = group if group is not None else dist.group.WORLD
            peer = dist.get_global_rank(pg, bound[group_peer_arg])
        tensor = bound["tensor"]
        return P2POp(ranks, -1 if peer is None else int(peer), sends, tensor.numel(), _dtype(tensor),
                     self.group_name(group))

    def _batch(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(p2p_op_list: list, *args: Any, **kwargs: Any) -> Any:
            ops = self._batch_ops(p2p_op_list) if self._recording() else None
            if not ops:
                with self._inside():
                    return original(p2p_op_list, *args, **kwargs)
            ids = self.add_issue(ops, batched=True)
            with self._inside():
                works = original(p2p_op_list, *args, **kwargs)
            if len(works) == len(ids):
                return [RecordedWork(w, [i], self) for w, i in zip(works, ids)]
            return [RecordedWork(w, ids, self) for w in works]

        return wrapper

    def _batch_ops(self, p2p_op_list: Any) -> tuple[P2POp, ...] | None:
        """The ops of one ``batch_isend_irecv`` call, None if not to record."""
        try:
            ranks = self.group_ranks(p2p_op_list[0].group)
            if ranks is None:
                return None
            name = self.group_name(p2p_op_list[0].group)
            return tuple(P2POp(ranks, int(op.peer), getattr(op.op, "__name__", "") == "isend",
                               op.tensor.numel(), _dtype(op.tensor), name) for op in p2p_op_list)
        except (AttributeError, IndexError, TypeError):
            return None  # not a list of P2POp: the original raises the error

    def _collective(self, original: Callable, name: str) -> Callable:
        signature = inspect.signature(original)
        sized = COLLECTIVES[name]

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._recording():
                self._record_collective(signature, name, sized, args, kwargs)
            with self._inside():
                return original(*args, **kwargs)

        return wrapper

    def _record_collective(self, signature: inspect.Signature, name: str, sized: str | None,
                           args: tuple, kwargs: dict) -> None:
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:
            return
        ranks = self.group_ranks(bound.get("group"))
        if ranks is None:
            return
        splits = (bound.get("output_split_sizes"), bound.get("input_split_sizes"))
        tensor = bound.get(sized) if sized is not None and splits == (None, None) else None
        numel, dtype = (0, "")
        if isinstance(tensor, torch.Tensor):
            numel, dtype = tensor.numel(), _dtype(tensor)
        blocking = not bound.get("async_op", False)
        self.add_collective(Collective(ranks, name, numel, dtype, blocking, self.group_name(bound.get("group"))))

    # -- patching --

    def install(self) -> None:
        """Replace the communicating functions of ``torch.distributed`` with recording ones."""
        wrappers = {name: self._p2p(getattr(dist, name), name) for name in P2P if hasattr(dist, name)}
        if hasattr(dist, "batch_isend_irecv"):
            wrappers["batch_isend_irecv"] = self._batch(dist.batch_isend_irecv)
        wrappers |= {name: self._collective(getattr(dist, name), name)
                     for name in COLLECTIVES if hasattr(dist, name)}
        for name, wrapper in wrappers.items():
            original = getattr(dist, name)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._patched.append((module, name, original))
                    setattr(module, name, wrapper)

    def uninstall(self) -> None:
        """Put the original functions back."""
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched.clear()


def install_recorder() -> CommRecorder:
    """Install a process-wide recorder (or return the one installed)."""
    global _active
    if _active is None:
        _active = CommRecorder()
        _active.install()
    return _active


def uninstall_recorder() -> None:
    """Restore ``torch.distributed`` and forget the installed recorder (if any)."""
    global _active
    if _active is not None:
        _active.uninstall()
        _active = None


@contextlib.contextmanager
def record_comms() -> Iterator[CommRecorder]:
    """Record this process's communication inside the block.

    Raises:
        ConfigError: a recorder is already installed (``HARMONIA_COMM_RECORD``).
    """
    if _active is not None:
        raise ConfigError(f"comm recording is already on (install_recorder or {ENV}); read its "
                          "events instead of starting a second recorder")
    recorder = install_recorder()
    try:
        yield recorder
    finally:
        uninstall_recorder()


def write_record(path: str | Path, recorder: CommRecorder | None = None) -> Path:
    """Write ``recorder``'s events (default: the installed one's) to ``path`` as JSON lines.

    Raises:
        ConfigError: no recorder is given or installed.
    """
    recorder = recorder or _active
    if recorder is None:
        raise ConfigError("no comm recorder is installed: call install_recorder() or record_comms()")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with recorder._lock:
        text = to_json(recorder.events)
    path.write_text(text)
    return path


def _write_at_exit(recorder: CommRecorder, directory: Path) -> None:
    rank = recorder.rank if recorder.rank is not None else int(os.environ.get("RANK", "0"))
    write_record(directory / f"rank{rank}.jsonl", recorder)


def maybe_record_from_env() -> CommRecorder | None:
    """If ``HARMONIA_COMM_RECORD`` names a directory, record this process and write
    ``<dir>/rank<global rank>.jsonl`` at exit; the recorder, or None when the variable is unset."""
    directory = os.environ.get(ENV)
    if not directory:
        return None
    recorder = install_recorder()
    if not recorder._writes_at_exit:
        recorder._writes_at_exit = True
        atexit.register(_write_at_exit, recorder, Path(directory))
    return recorder


@contextlib.contextmanager
def recording_from_env(rank: int) -> Iterator[CommRecorder | None]:
    """Record this rank's communication where ``HARMONIA_COMM_RECORD`` names a directory, and write
    ``<dir>/rank<rank>.jsonl`` when the block ends without an error (a failed attempt's partial record
    would not replay); the recorder, or None when the variable is unset."""
    directory = os.environ.get(ENV)
    if not directory:
        yield None
        return
    recorder = install_recorder()
    try:
        yield recorder
        write_record(Path(directory) / f"rank{rank}.jsonl", recorder)
    finally:
        uninstall_recorder()
