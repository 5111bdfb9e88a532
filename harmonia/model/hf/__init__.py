"""HF-format checkpoint adapters: Llama / Qwen2 LLMs, SigLIP vision, Whisper encoder (load and save)."""

from harmonia.model.hf.llama import load_hf_llm, save_hf_llm
from harmonia.model.hf.siglip import load_hf_siglip, save_hf_siglip
from harmonia.model.hf.whisper import load_hf_whisper, save_hf_whisper

__all__ = ["load_hf_llm", "load_hf_siglip", "load_hf_whisper", "save_hf_llm", "save_hf_siglip", "save_hf_whisper"]
