"""What the runtime's FSDP holds through a step is what the cost model charges (`harmonia.workload.cost`):
bf16 weights gathered whole once, before the first microbatch, fp32 gradients accumulated whole,
the fp32 weights sharded over ``dp``; resharding per microbatch (``fsdp reshard``), only shards
between microbatches. One process, torch's fake process group of 4 ranks."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harmonia.runtime.grads import start_fsdp_backward, start_fsdp_resharding, wait_fsdp_gathers
from harmonia.runtime.parallelize import apply_fsdp
from harmonia.workload.memory_cost import GRAD_BYTES, MASTER_BYTES, PARAM_BYTES

DP = 4


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(32, 32) for i in range(3)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


@pytest.fixture
def fake_dp_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=DP, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (DP,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


def _held(module: nn.Module) -> dict[str, int]:
    """Bytes of every FSDP parameter's whole bf16 copy, fp32 shard and accumulated gradient."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    out = {"whole": 0, "shard": 0, "grads": 0, "grad_shards": 0}
    for sub in module.modules():
        group = fully_shard.state(sub)._fsdp_param_group if isinstance(sub, FSDPModule) else None
        for p in group.fsdp_params if group else ():
            if hasattr(p, "_unsharded_param"):  # made by the first gather
                out["whole"] += p._unsharded_param.untyped_storage().nbytes()
            out["shard"] += p.sharded_param._local_tensor.untyped_storage().nbytes()
            if p.unsharded_accumulated_grad is not None:
                out["grads"] += p.unsharded_accumulated_grad.untyped_storage().nbytes()
            if p.sharded_param.grad is not None:  # views of one group's reduce-scatter output
                shard = p.sharded_param.grad._local_tensor
                out["grad_shards"] += shard.numel() * shard.element_size()
    return out


def test_fsdp_step_holds_whole_bf16_weights_and_fp32_gradients(fake_dp_mesh) -> None:
    torch.manual_seed(0)
    model = _Blocks()
    n = sum(p.numel() for p in model.parameters())
    apply_fsdp(model, fake_dp_mesh, mixed_precision=True)
    wait_fsdp_gathers(start_fsdp_backward(model))  # the step's one gather, before any microbatch
    assert _held(model) == {"whole": PARAM_BYTES * n, "shard": MASTER_BYTES * n // DP, "grads": 0,
                            "grad_shards": 0}
    for _ in range(3):  # microbatches gather nothing more and accumulate whole fp32 gradients
        model(torch.randn(4, 32)).float().sum().backward()
        assert _held(model) == {"whole": PARAM_BYTES * n, "shard": MASTER_BYTES * n // DP,
                                "grads": GRAD_BYTES * n, "grad_shards": 0}


def test_fsdp_reshard_holds_only_shards_between_microbatches(fake_dp_mesh) -> None:
    torch.manual_seed(0)
    model = _Blocks()
    n = sum(p.numel() for p in model.parameters())
    apply_fsdp(model, fake_dp_mesh, mixed_precision=True)
    start_fsdp_resharding(model)
    for _ in range(3):  # each unit gathers and frees; gradients accumulate as fp32 shards
        y = model(torch.randn(4, 32))
        assert _held(model)["whole"] == 0, "the root frees its weights after forward too"
        y.float().sum().backward()
        assert _held(model) == {"whole": 0, "shard": MASTER_BYTES * n // DP, "grads": 0,
                                "grad_shards": GRAD_BYTES * n // DP}


def test_fsdp_reshard_of_a_frozen_module_gathers_again_for_the_input_gradient(fake_dp_mesh) -> None:
    """A frozen LLM under a trained projector: its backward computes input gradients only, with
    weights gathered again for it and freed after; no gradient of its own is made."""
    torch.manual_seed(0)
    model = _Blocks().requires_grad_(False)
    apply_fsdp(model, fake_dp_mesh, mixed_precision=True)
    start_fsdp_resharding(model)
    for _ in range(2):
        x = torch.randn(4, 32, requires_grad=True)
        y = model(x)
        assert _held(model)["whole"] == 0
        y.float().sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
        assert _held(model)["whole"] == 0 and _held(model)["grad_shards"] == 0


def test_frozen_weights_are_held_in_bf16_and_sharded_as_bf16(fake_dp_mesh) -> None:
    """Under mixed precision a frozen module holds its weights in bf16 (2 B, what the cost model
    charges per frozen weight on a GPU); FSDP keeps the step's whole bf16 copy and bf16 shards
    (2 + 2/dp B: it never saves a frozen module memory without resharding)."""
    from harmonia.runtime.parallelize import hold_frozen_in

    torch.manual_seed(0)
    model = _Blocks().requires_grad_(False)
    n = sum(p.numel() for p in model.parameters())
    assert hold_frozen_in(model, torch.bfloat16) == 6
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    apply_fsdp(model, fake_dp_mesh, mixed_precision=True)
    wait_fsdp_gathers(start_fsdp_backward(model))
    assert _held(model) == {"whole": PARAM_BYTES * n, "shard": PARAM_BYTES * n // DP, "grads": 0, "grad_shards": 0}
    x = torch.randn(4, 32, requires_grad=True)
    model(x).float().sum().backward()
    assert x.grad is not None and _held(model)["grads"] == 0


def test_holding_frozen_linears_in_bf16_changes_nothing_autocast_computes() -> None:
    """Autocast casts a linear's weight and bias to bf16 for the matmul anyway: holding them in bf16
    gives the same numbers; trained parameters keep their fp32 master weights."""
    from harmonia.runtime.parallelize import hold_frozen_in

    torch.manual_seed(0)
    frozen, trained = nn.Linear(32, 32).requires_grad_(False), nn.Linear(32, 32)
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = trained(frozen(x))
    assert hold_frozen_in(nn.Sequential(frozen, trained), torch.bfloat16) == 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        after = trained(frozen(x))
    assert frozen.weight.dtype == torch.bfloat16 and trained.weight.dtype == torch.float32
    assert torch.equal(before, after)


def test_the_gathers_overlap_the_first_forward_and_the_last_backward_reduces_block_by_block(fake_dp_mesh) -> None:
    """The step's gathers are issued up front and each block waits for its own in its first forward;
    the chunk's last backward reduce-scatters each block's accumulated gradient as soon as that
    block's backward is done (the later blocks' are shards before the first block's backward runs),
    then frees the whole weights; every microbatch before it accumulated whole gradients."""
    from harmonia.runtime.grads import reduce_in_last_backward

    torch.manual_seed(0)
    model = _Blocks()
    n = sum(p.numel() for p in model.parameters())
    apply_fsdp(model, fake_dp_mesh, mixed_precision=True)
    handles = start_fsdp_backward(model)
    assert len(handles) == 4, "one gather per block and one for the root, in flight"
    for _ in range(2):
        model(torch.randn(4, 32)).float().sum().backward()
    assert _held(model)["grads"] == GRAD_BYTES * n and _held(model)["grad_shards"] == 0
    seen = {}

    def first_block_backward(*_) -> None:  # block 0's backward runs last
        from torch.distributed.tensor import DTensor

        blocks = [model.layers[i] for i in "012"]  # sharded weights registered: resharded after their reduction
        seen["sharded"] = [isinstance(b.weight, DTensor) and isinstance(b.weight.grad, DTensor) for b in blocks]

    model.layers["0"].register_full_backward_pre_hook(first_block_backward)
    reduce_in_last_backward(model)
    model(torch.randn(4, 32, requires_grad=True)).float().sum().backward()
    wait_fsdp_gathers(handles)
    assert seen["sharded"] == [False, True, True], "blocks 2 and 1 reduce-scattered before block 0's backward"
    assert _held(model) == {"whole": 0, "shard": MASTER_BYTES * n // DP, "grads": 0,
                            "grad_shards": GRAD_BYTES * n // DP}
