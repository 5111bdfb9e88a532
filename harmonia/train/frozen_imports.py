"""Imported last by the ranks' fork server (`harmonia.launch.warm_ranks`), after torch, the trainer and
transformers: every object the imports made frozen (``gc.freeze``), and the garbage collector (paused
by `harmonia.train.gc_paused`) on again.

Ranks forked from it then never walk those objects (about 0.37 million) in a full garbage collection
(0.2 s each), and share their memory pages with the fork server instead of copying each page the
collector would touch. The imports leave almost no garbage (about 500 objects here), frozen with
the rest.
"""

from __future__ import annotations

import gc

gc.freeze()
gc.enable()
