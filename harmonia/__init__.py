"""harmonia: training multimodal LLMs with per-module parallel layouts and per-iteration balancing."""

from harmonia.errors import HarmoniaError

__version__ = "0.1.0"
__all__ = ["HarmoniaError", "__version__"]
