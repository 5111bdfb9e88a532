"""HF-format checkpoints in and out: whole multimodal models (LLaVA) and compositions of an LLM
(Llama / Qwen2 / Mistral) with encoders (CLIP / SigLIP vision, Whisper audio).

The training job's interface is `harmonia.model.hf.mllm`: `mllm_spec_from_hf`,
`load_module_state`, `export_hf`. The per-part loaders and savers below serve single modules.
"""

from harmonia.model.hf.llama import load_hf_llm, save_hf_llm
from harmonia.model.hf.siglip import load_hf_siglip, save_hf_siglip
from harmonia.model.hf.whisper import load_hf_whisper, save_hf_whisper

__all__ = ["load_hf_llm", "load_hf_siglip", "load_hf_whisper", "save_hf_llm", "save_hf_siglip", "save_hf_whisper"]
