"""What a layer's kernels move besides its matmuls: memory-bound elementwise traffic, and the
activations tensor parallelism leaves replicated.

Between its matmuls (`harmonia.workload.layers`) a transformer block runs kernels that do a few
FLOPs per element and are bound by device memory bandwidth, so they take time of their own: the
cost model adds ``elements x bytes / bandwidth`` to the matmul and attention time
(`harmonia.workload.cost`). Elements per token, each read or write of an element counted once
(``h`` width, ``q``/``kv`` query and key widths, ``f`` MLP width, ``V`` vocabulary):

- forward: two norms (read ``h``, write ``h`` each: ``4h``), two residual adds (read ``2h``, write
  ``h`` each: ``6h``), the MLP activation (SwiGLU reads gate and up, writes their product: ``3f``;
  GELU ``2f``), per-channel layer scales (``4h``), the LLM's rotary embedding on q and k
  (``2(q + kv)``) and q/k norms (``2(q + kv)``);
- input gradient (B): each kernel reads what it saved and the upstream gradient and writes the input
  gradient: norms ``6h``, the residual stream's gradient adds ``6h``, SwiGLU ``5f`` (GELU ``3f``),
  layer scales ``6h``, rotary ``2(q + kv)``, q/k norms ``3(q + kv)``;
- weight gradient (W): matmuls only, except the embedding's scatter-add (``3h``: read the gradient,
  read and write the row);
- the LM head's loss reads the logits (``V``) forward and writes their gradient (``2V``) in B,
  beside its final norm (``2h``, ``3h``). The front ends, encoder post layers and projectors are
  matmul-bound and left out.

Under tensor parallelism the rotary embedding, q/k norms, MLP activation and vocabulary run on each
rank's ``1/tp`` of the heads, columns or vocabulary (``sharded``). The norms, residual adds and layer
scales run on the full width on every TP rank (``replicated``), unless sequence parallelism
(Korthikanti et al. 2022) splits them over tokens; so do the activations they keep: each block's two
norm inputs (``2h``) and, where it trains, the inputs of its qkv and MLP-up matmuls (``2h``), which
without sequence parallelism every TP rank holds whole.
"""

from __future__ import annotations

import numpy as np

from harmonia.model.spec import MLLMSpec, TransformerSpec
from harmonia.workload.layers import LayerCost


def _body(mllm: MLLMSpec, module: str) -> TransformerSpec | None:
    if module == "llm":
        return mllm.llm.body
    if module in mllm.encoders:
        return mllm.encoders[module].body
    return None


def elementwise_elems(mllm: MLLMSpec, module: str, layer: LayerCost) -> np.ndarray:
    """Elements per token of a layer's memory-bound kernels (see the module docstring).

    Returns:
        array (3 phases F/B/W, 2): column 0 TP-sharded, column 1 replicated over TP (split by
        sequence parallelism).
    """
    out = np.zeros((3, 2))
    has_b = layer.b_tok > 0 or layer.b_pair > 0
    if layer.kind == "block":
        spec = _body(mllm, module)
        h, qk = spec.hidden, spec.q_dim + spec.kv_dim
        swiglu = spec.mlp == "swiglu"
        rope = module == "llm"
        rotary, norms = (2 * qk if rope else 0), (qk if spec.qk_norm else 0)
        out[0] = [(3 if swiglu else 2) * spec.ffn_hidden + rotary + 2 * norms, 10 * h + (4 * h if spec.layer_scale else 0)]
        if has_b:
            out[1] = [(5 if swiglu else 3) * spec.ffn_hidden + rotary + 3 * norms,
                      12 * h + (6 * h if spec.layer_scale else 0)]
    elif layer.kind == "embed":
        h = mllm.llm.hidden
        out[0, 1] = 2 * h
        out[2, 1] = 3 * h if layer.needs_w else 0.0
    elif layer.kind == "head" and module == "llm":
        h, vocab = mllm.llm.hidden, mllm.llm.vocab_size
        out[0] = [vocab, 2 * h]
        if has_b:
            out[1] = [2 * vocab, 3 * h]
    return out


def replicated_activation_elems(mllm: MLLMSpec, module: str, layer: LayerCost) -> float:
    """Activation elements per token a block keeps on every TP rank whole without sequence
    parallelism: its norm inputs (``2h``) when it keeps activations, and the inputs of its qkv and
    MLP-up matmuls (``2h``) when it trains."""
    if layer.kind != "block" or layer.act_elems_tok == 0:
        return 0.0
    h = _body(mllm, module).hidden
    return 2.0 * h + (2.0 * h if layer.needs_w else 0.0)
