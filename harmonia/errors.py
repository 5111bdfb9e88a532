"""Errors a user can cause. Each message says what was wrong and what to do."""


class HarmoniaError(Exception):
    """Base of every error harmonia raises for bad input, config or layout."""


class ConfigError(HarmoniaError):
    """A config, spec or command-line value is invalid."""


class SampleError(HarmoniaError):
    """A sample shape or modality item is invalid."""


class TraceError(HarmoniaError):
    """A trace file or trace specification is malformed."""


class LayoutError(HarmoniaError):
    """A parallel layout or plan cannot be realised."""


class ScheduleError(HarmoniaError):
    """A schedule is malformed or violates a dependency."""
