"""The error media decoding raises: a bad record of a named kind."""

from __future__ import annotations

from harmonia.errors import SampleError

KINDS = ("corrupt_media", "missing_file", "too_large", "unsupported_media", "shape_mismatch")


class MediaError(SampleError):
    """A media file cannot be used. ``kind`` (one of `KINDS`) names the failure for the run's metrics.

    ``corrupt_media``: it does not decode; ``missing_file``: it is not there; ``too_large``: over the
    configured size limit (found from the header); ``unsupported_media``: a format or layout harmonia
    cannot turn into encoder inputs; ``shape_mismatch``: the header and the decoded content disagree.
    """

    def __init__(self, kind: str, message: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown media error kind {kind!r}; expected one of {KINDS}")
        super().__init__(message)
        self.kind = kind
