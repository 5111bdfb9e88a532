"""Per-layer cost coefficients of every module, frozen-aware.

Each layer is described by coefficients that multiply a load (tokens, attended pairs):
``F = f_tok * tokens + f_pair * pairs`` FLOPs, and likewise for B (input gradient) and W (weight
gradient). Counting follows Kaplan et al. 2020 / Narayanan et al. 2021 (Megatron-LM, eq. 3):

- A matmul with ``P`` weights costs ``2 P`` FLOPs per token forward, ``2 P`` for the input gradient
  and ``2 P`` for the weight gradient (the 6N rule split into F, B, W).
- Attention scores and the weighted sum cost ``2 d`` FLOPs each per attended (query, key) pair,
  ``d = n_heads * head_dim``, so ``4 d`` per pair forward; their backward (dQ, dK, dV, dP) is
  ``8 d`` per pair, all input gradient (no weights), as the 6N rule's 2x backward.

Frozen-aware rules (Zero Bubble, Qi et al. 2024, splits B and W; frozen modules drop them):
- W only where the layer has trainable weights (all of a ``full`` module; the adapters of ``lora``).
- B only where some trainable weight lies upstream of the layer's input. A trainable layer with
  nothing trainable upstream still runs the backward through its own interior (its W needs it), but
  not the input gradient of its first matmul.
- Activations are kept for backward only where B or W runs: linear inputs for W, nonlinearity
  inputs (norms, attention q/k/v/o, the MLP activation) for B. Frozen layers with no backward keep
  nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from harmonia.model.projector_spec import ProjectorSpec
from harmonia.model.spec import EncoderSpec, LLMSpec, MLLMSpec, TransformerSpec
from harmonia.model.training_mode import Trainability
from harmonia.workload.shapes import windowed_blocks


@dataclass(frozen=True)
class LayerCost:
    """FLOP and memory coefficients of one layer.

    Attributes:
        name: ``module.kind[index]``, e.g. ``llm.block3``.
        kind: ``patch_embed``, ``conv_stem``, ``block``, ``post``, ``proj``, ``embed``, ``head``.
        params: all parameters.
        trainable_params: parameters that get gradients (LoRA adapters only for ``lora``).
        f_tok, f_pair: forward FLOPs per token and per attended pair.
        b_tok, b_pair: input-gradient FLOPs per token and per pair (0 when B is not needed).
        w_tok: weight-gradient FLOPs per token (0 when frozen).
        act_elems_tok: activation elements per token kept for backward.
        work_elems_tok: elements per token a block's forward holds at once while it runs when it keeps
            nothing for backward (a frozen block without upstream training, run without autograd):
            its input and the larger of attention's and the MLP's intermediates (`block_cost`).
        io_elems_tok: elements per token read and written by the forward (memory traffic).
        needs_b: the layer runs an input-gradient backward.
        needs_w: the layer has a weight-gradient step.
        windowed: a sliding-window block: its pair terms count `ModuleLoad.windowed_pairs`.
        replicated, trainable_replicated: of ``params`` and ``trainable_params``, those tensor
            parallelism keeps whole on every TP rank (`harmonia.model.tp.plan_tp`: norms, biases of
            row-wise linears, layer scales, an encoder's front end and post layer, LoRA's ``A`` of
            column-wise and ``B`` of row-wise linears); the rest is split over ``tp``.
        wgrad_elems_tok, wgrad_replicated_tok: elements per token of the output gradients of the
            operations that use trained weights, split over ``tp`` and whole on every TP rank: what a
            split backward keeps from B until W beside the activations (torch.distributed.
            pipelining's ``stage_backward_input`` keeps the autograd graph and, for W, the gradient
            flowing into every operation that reaches a weight).
        top_weights: elements of the layer's two largest trained weight tensors (0 where it trains
            none): W makes each weight's gradient whole before adding it into the accumulated one.
    """

    name: str
    kind: str
    params: int
    trainable_params: int
    f_tok: float
    f_pair: float = 0.0
    b_tok: float = 0.0
    b_pair: float = 0.0
    w_tok: float = 0.0
    act_elems_tok: float = 0.0
    io_elems_tok: float = 0.0
    needs_b: bool = False
    needs_w: bool = False
    windowed: bool = False
    replicated: int = 0
    trainable_replicated: int = 0
    work_elems_tok: float = 0.0
    wgrad_elems_tok: float = 0.0
    wgrad_replicated_tok: float = 0.0
    top_weights: tuple[int, int] = (0, 0)


def _two_largest(sizes: list[int]) -> tuple[int, int]:
    """The two largest of ``sizes`` (0 for what is missing), largest first."""
    top = sorted(sizes, reverse=True)[:2] + [0, 0]
    return top[0], top[1]


def _wgrad_elems(spec: TransformerSpec, mode: Trainability, lora_rank: int) -> tuple[float, float]:
    """(split over TP, whole on every TP rank) output-gradient elements per token of a block's
    operations on trained weights (`LayerCost.wgrad_elems_tok`): fully trained, the column-wise q,
    k, v and MLP-up outputs and the q/k norms' (split), the row-wise output and down projections',
    the two norms' and layer scales' (``h`` each, whole); under LoRA each adapter's ``A`` output
    (``r``, whole) and ``B`` output (its base matrix's)."""
    h, q, kv, f = spec.hidden, spec.q_dim, spec.kv_dim, spec.ffn_hidden
    ups = 2 if spec.mlp == "swiglu" else 1
    if mode is Trainability.FULL:
        split = q + 2 * kv + ups * f + (q + kv if spec.qk_norm else 0)
        return float(split), float(2 * h + 2 * h + (2 * h if spec.layer_scale else 0))
    if mode is Trainability.LORA:
        return float(q + 2 * kv + ups * f), float(lora_rank * (3 + ups + 2) + 2 * h)
    return 0.0, 0.0


def _lora_params(spec: TransformerSpec, rank: int) -> int:
    """Adapter weights on q, k, v, o and the MLP matrices: ``r * (in + out)`` per matrix."""
    h, q, kv, f = spec.hidden, spec.q_dim, spec.kv_dim, spec.ffn_hidden
    attn = rank * ((h + q) + 2 * (h + kv) + (q + h))
    mlp = rank * ((h + f) * (3 if spec.mlp == "swiglu" else 2))
    return attn + mlp


def _block_replicated(spec: TransformerSpec, mode: Trainability, lora_rank: int) -> tuple[int, int]:
    """(all, trainable) parameters of a block that TP replicates: norms, row-wise biases (output and
    down projections), per-head q/k norms, layer scales; LoRA's A on the column-wise q, k, v and
    up projections (input ``h``) and B on the row-wise output and down projections (output ``h``)."""
    h = spec.hidden
    repl = 2 * spec.norm_params + (h if spec.out_bias else 0) + (h if spec.mlp_bias else 0)
    if spec.qk_norm and spec.qk_norm_per_head:
        repl += 2 * spec.dim_head * (1 if spec.norm == "rmsnorm" else 2)
    if spec.layer_scale:
        repl += 2 * h
    ups = 2 if spec.mlp == "swiglu" else 1
    lora = lora_rank * h * (3 + ups + 2) if mode is Trainability.LORA else 0
    return repl + lora, repl if mode is Trainability.FULL else lora


def block_cost(name: str, spec: TransformerSpec, mode: Trainability, lora_rank: int, upstream_trains: bool) -> LayerCost:
    """One transformer block. Derivation of the activation count (elements per token, bf16 = 2 B):

    W needs linear inputs: qkv input ``h``, attention output ``q`` (also the flash-attention O),
    MLP input ``h``, down-projection input ``f``. B needs nonlinearity inputs: two norm inputs
    ``2h``, q/k/v ``q + 2kv``, O ``q``, the activation input ``f`` (``2f`` for SwiGLU's gate and up),
    and the softmax statistics (fp32, ``2 n_heads`` elements). With ``f = 4h`` and MHA the union is
    16h elements = 32h bytes, Korthikanti et al. 2022's 34h less the dropout masks. The runtime's
    block keeps exactly these (`harmonia.model.lean_ops`; `tests/unit/test_lean_ops.py`).

    A block that keeps nothing still holds, while its forward runs, its input ``h`` and either
    attention's q, k, v and output (``2q + 2kv``) or the MLP's hidden and activated values
    (``act_in + f``): ``work_elems_tok``, the larger of the two on top of ``h``.
    """
    h, q, kv, f = spec.hidden, spec.q_dim, spec.kv_dim, spec.ffn_hidden
    matmul = spec.attention_matmul_params() + spec.mlp_matmul_params()
    params = spec.block_params()
    act_in = 2 * f if spec.mlp == "swiglu" else f
    b_elems = 2 * h + q + 2 * kv + q + act_in + 2 * spec.n_heads
    w_elems = h + q + h + f
    trains = mode is not Trainability.FROZEN
    lora = _lora_params(spec, lora_rank) if mode is Trainability.LORA else 0
    trainable = params if mode is Trainability.FULL else lora
    f_tok = 2.0 * (matmul + lora)
    needs_b = upstream_trains
    interior_b = trains  # W of the block needs the backward through the block's interior
    b_tok = 0.0
    if needs_b or interior_b:
        b_tok = 2.0 * (matmul + lora)
        if not needs_b:
            b_tok -= 2.0 * h * (q + 2 * kv)  # no input gradient of the first (qkv) matmul
    b_pair = 8.0 * q if (needs_b or interior_b) else 0.0
    w_tok = 2.0 * (matmul if mode is Trainability.FULL else lora) if trains else 0.0
    if trains:
        act = b_elems + w_elems - q  # O is both a B input and the out-proj's W input
    elif needs_b:
        act = b_elems
    else:
        act = 0.0
    io = 2 * (h + q + 2 * kv + q + h + h + act_in + f + h)
    work = h + max(2 * q + 2 * kv, act_in + f)
    repl, trainable_repl = _block_replicated(spec, mode, lora_rank)
    wgrad, wgrad_repl = _wgrad_elems(spec, mode, lora_rank)
    matrices = [h * q, h * kv, h * kv, q * h] + [h * f] * (2 if spec.mlp == "swiglu" else 1) + [f * h]
    top = (_two_largest(matrices) if mode is Trainability.FULL
           else _two_largest([lora_rank * max(h, f)] * 2) if mode is Trainability.LORA else (0, 0))
    return LayerCost(name, "block", params, trainable, f_tok, 4.0 * q, b_tok, b_pair, w_tok, act, io,
                     needs_b, trains, replicated=repl, trainable_replicated=trainable_repl, work_elems_tok=work,
                     wgrad_elems_tok=wgrad, wgrad_replicated_tok=wgrad_repl, top_weights=top)


def _dense(name: str, kind: str, params: int, matmul: int, trainable: bool, upstream: bool,
           in_elems: int, out_elems: int, wgrad_elems: int | None = None) -> LayerCost:
    """A layer of plain matmuls (patch embedding, projector, LM head); ``wgrad_elems``: its matmuls'
    output gradient elements per token (default ``out_elems``), kept from B to W where it trains."""
    act = (in_elems if trainable else 0) + (out_elems if (trainable or upstream) else 0)
    wgrad = float(out_elems if wgrad_elems is None else wgrad_elems) if trainable else 0.0
    return LayerCost(
        name, kind, params, params if trainable else 0, 2.0 * matmul, 0.0,
        2.0 * matmul if upstream else 0.0, 0.0, 2.0 * matmul if trainable else 0.0,
        act, in_elems + out_elems, upstream, trainable, wgrad_elems_tok=wgrad,
        top_weights=(matmul, 0) if trainable else (0, 0),  # its matrices as one bound
    )


def encoder_layers(name: str, enc: EncoderSpec, mode: Trainability, lora_rank: int,
                   upstream_trains: bool = False) -> list[LayerCost]:
    """Front end, blocks and post layer of an encoder, in order."""
    h = enc.body.hidden
    full = mode is Trainability.FULL
    if enc.is_audio:
        # conv1 (n_mels -> h, k=3) runs at 2x the token rate, conv2 (h -> h, k=3, stride 2) at 1x.
        matmul = 2 * enc.n_mels * 3 * h + 3 * h * h
        front = _dense(f"{name}.conv_stem", "conv_stem", enc.frontend_params(), matmul, full,
                       upstream_trains, 2 * enc.n_mels, h)
    else:  # a patch: C p^2 values, times the temporal patch of a native-resolution tower
        patch = enc.channels * enc.patch_size**2 * (enc.temporal_merge if enc.native is not None else 1)
        front = _dense(f"{name}.patch_embed", "patch_embed", enc.frontend_params(), patch * h, full,
                       upstream_trains, patch, h)
    front = replace(front, replicated=front.params, trainable_replicated=front.trainable_params)  # not split by TP
    layers = [front]
    trains_so_far = upstream_trains or front.needs_w
    windowed = windowed_blocks(enc)  # Qwen2.5-VL's window blocks count the windows' pairs
    for i in range(enc.body.n_layers):
        blk = block_cost(f"{name}.block{i}", enc.body, mode, lora_rank, trains_so_far)
        layers.append(replace(blk, windowed=i in windowed))
        trains_so_far = trains_so_far or blk.needs_w
    norms = (int(enc.pre_norm) + int(enc.post_norm)) * enc.body.norm_params
    # A pooling head (SigLIP's MAP) projects every token to keys and values: 2 h^2 weights per token.
    head_matmul = 2 * h * h if enc.head_params else 0
    post = _dense(f"{name}.post", "post", norms + enc.head_params, head_matmul, full, trains_so_far, h, h)
    layers.append(replace(post, replicated=post.params, trainable_replicated=post.trainable_params))
    return layers


def projector_layers(name: str, proj: ProjectorSpec, mode: Trainability, upstream_trains: bool) -> list[LayerCost]:
    """The projector as one layer (its MLP is small and never split: every TP rank runs it whole)."""
    trainable = mode is not Trainability.FROZEN
    layer = _dense(f"{name}.mlp", "proj", proj.n_params(), proj.matmul_params(), trainable,
                   upstream_trains, proj.in_dim, proj.out_dim + proj.hidden)
    # the runtime holds a projector whole on every rank of its encoder's last stage (no TP, no FSDP)
    return [replace(layer, replicated=layer.params, trainable_replicated=layer.trainable_params)]


def llm_layers(llm: LLMSpec, mode: Trainability, lora_rank: int, upstream_trains: bool) -> list[LayerCost]:
    """Embedding, blocks, and final norm + LM head of the LLM, in order.

    The embedding is a lookup (no FLOPs); its weight gradient is a scatter-add of ``h`` per token.
    The LM head is a ``h x V`` matmul over every position; its loss is computed in fp32.
    Sliding-window blocks are marked ``windowed``: their attention counts the window's pairs.
    """
    h, v = llm.hidden, llm.vocab_size
    full = mode is Trainability.FULL
    embed = LayerCost("llm.embed", "embed", llm.embedding_params(), llm.embedding_params() if full else 0,
                      0.0, 0.0, 0.0, 0.0, float(h) if full else 0.0, 0.0, float(h), False, full,
                      wgrad_replicated_tok=float(h) if full else 0.0,  # the embedded sequence's gradient
                      top_weights=(llm.embedding_params(), 0) if full else (0, 0))
    layers = [embed]
    trains_so_far = upstream_trains or full
    for i in range(llm.body.n_layers):
        blk = block_cost(f"llm.block{i}", llm.body, mode, lora_rank, trains_so_far)
        layers.append(replace(blk, windowed=llm.body.window_of(i) is not None))
        trains_so_far = trains_so_far or blk.needs_w
    head_params = llm.head_params() + llm.body.norm_params
    head = _dense("llm.head", "head", head_params, h * v, full, trains_so_far, h, 2 * v, wgrad_elems=v)
    norm = llm.body.norm_params  # the final norm stays whole under TP; the head is split over the vocabulary
    layers.append(replace(head, replicated=norm, trainable_replicated=norm if full else 0))
    return layers


def module_layers(mllm: MLLMSpec) -> dict[str, list[LayerCost]]:
    """Layer costs of every module of an MLLM, in graph order, with the frozen rules applied."""
    out: dict[str, list[LayerCost]] = {}
    trains = {m: mllm.training_of(m).trains for m in mllm.module_names}
    for name, enc in mllm.encoders.items():
        t = mllm.training_of(name)
        out[name] = encoder_layers(name, enc, t.mode, t.lora_rank)
    for name, proj in mllm.projectors.items():
        t = mllm.training_of(name)
        out[name] = projector_layers(name, proj, t.mode, trains[name.removesuffix("_proj")])
    t = mllm.training_of("llm")
    upstream = any(trains[m] for m in mllm.upstream("llm"))
    out["llm"] = llm_layers(mllm.llm, t.mode, t.lora_rank, upstream)
    return out
