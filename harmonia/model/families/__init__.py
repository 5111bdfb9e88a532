"""Model families: each kind of HF checkpoint harmonia reads, in a module of its own, registered here.

One `FAMILIES.register` line makes a family known to every command: `harmonia plan --model DIR`,
`harmonia train --model.hf=DIR`, `harmonia export`, `harmonia data inspect` and `harmonia hf` find
it from the checkpoint's ``model_type`` (`harmonia.model.hf.mllm.mllm_spec_from_hf`,
`harmonia.model.hf.names.module_names`). ``docs/adding-a-model.md`` walks through adding one.
"""

from harmonia.model.families import llava, llm, qwen_vl
from harmonia.model.families.base import Family, FamilyRegistry

__all__ = ["FAMILIES", "Family", "FamilyRegistry"]

FAMILIES = FamilyRegistry()
FAMILIES.register(llava.LLAVA)  # LlavaForConditionalGeneration, LlavaNextForConditionalGeneration
FAMILIES.register(llm.LLM)  # Llama, Mistral, Qwen2, Qwen3 alone: an MLLM without encoders
FAMILIES.register(qwen_vl.QWEN_VL)  # Qwen2VL-, Qwen2_5_VL-, Qwen3VLForConditionalGeneration
FAMILIES.refuse("llava_onevision", "LLaVA-OneVision (anyres tiling, image_newline, video pooling)")
FAMILIES.refuse("llava_next_video", "LLaVA-NeXT-Video (anyres tiling, video pooling)")
FAMILIES.refuse("vipllava", "VipLLaVA (a layer-normed multi-layer projector)")
FAMILIES.refuse("qwen3_vl_moe", "Qwen3-VL-MoE (a mixture-of-experts LLM)")
