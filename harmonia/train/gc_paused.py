"""Imported first by the ranks' fork server (`harmonia.launch.warm_ranks`): the garbage collector off
while it imports torch, the trainer and transformers (`harmonia.train.frozen_imports`, imported last,
turns it back on). Imports only add objects that live as long as the process, and each full pass the
collector makes while they grow walks every object made so far: 0.7 s of the fork server's start.
"""

from __future__ import annotations

import gc

gc.disable()
