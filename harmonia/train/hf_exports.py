"""HF exports of a run's checkpoints while it trains (``checkpoint.export_every``).

Rank 0 exports a saved step (`harmonia.train.export.export_checkpoint`: the merged model in the
source's HF format) in a thread beside training, into ``<checkpoint.dir>/hf/step-N``, written under
``step-N.partial`` and renamed when complete, so a directory named ``step-N`` is always whole. One
export runs at a time; the next save waits for it (a newer save may delete the older checkpoint it
reads). An export that fails is logged with its reason and training goes on.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

log = logging.getLogger(__name__)


class BackgroundExports:
    """Exports of every ``every``-th saved step of ``checkpoint_dir``, one at a time in a thread.

    Args:
        checkpoint_dir: the job's ``checkpoint.dir``.
        every: export steps that are multiples of this (0 = none).
    """

    def __init__(self, checkpoint_dir: str | Path, every: int) -> None:
        self.root, self.every = Path(checkpoint_dir), every
        self._thread: threading.Thread | None = None
        self.written: list[Path] = []

    def after_save(self, step: int) -> None:
        """Start exporting ``step`` when it is one to export (the previous export finished first)."""
        if not self.every or step % self.every:
            return
        self.wait()
        self._thread = threading.Thread(target=self._export, args=(step,), name=f"hf-export-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the running export, if any, has finished."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _export(self, step: int) -> None:
        from harmonia.train.export import export_checkpoint

        out = self.root / "hf" / f"step-{step}"
        partial = out.with_name(out.name + ".partial")
        try:
            shutil.rmtree(partial, ignore_errors=True)
            export_checkpoint(self.root / f"step-{step}", partial)
            if out.exists():
                shutil.rmtree(out)
            os.replace(partial, out)
            self.written.append(out)
            log.info("exported step %d to %s", step, out)
        except Exception as e:  # an export must not stop training; it says why it failed
            shutil.rmtree(partial, ignore_errors=True)
            log.warning("the HF export of step %d failed (%s: %s); training goes on, and `harmonia export "
                        "--checkpoint %s` can write it later", step, type(e).__name__, e, self.root / f"step-{step}")
