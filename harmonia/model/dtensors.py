"""DTensor checks that do not import ``torch.distributed.tensor``.

Importing it costs about 0.6 s of every process's start (it pulls in much of ``torch._dynamo``'s
machinery), and a job without tensor parallelism, FSDP or a distributed checkpoint never needs it.
No tensor can be a DTensor before that module is imported (its class lives there), so the check
reads the class from ``sys.modules`` and answers False while it is absent.
"""

from __future__ import annotations

import sys


def is_dtensor(t: object) -> bool:
    """``isinstance(t, DTensor)``, without importing DTensor where no process made one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)
