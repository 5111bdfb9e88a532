"""Loading an exported HF directory the way a user would, and asserting it loads cleanly."""

from __future__ import annotations

import logging
import warnings


def load_cleanly(cls, path):
    """``cls.from_pretrained(path)`` in eval mode, asserting no missing / unexpected keys and no
    warnings at all (Python warnings or transformers' log)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, info = cls.from_pretrained(path, output_loading_info=True)
    finally:
        logger.removeHandler(handler)
    assert not any(info.values()), info
    assert not caught, [str(w.message) for w in caught]
    assert not records, [r.getMessage() for r in records]
    return model.eval()
