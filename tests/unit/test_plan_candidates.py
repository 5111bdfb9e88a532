"""Planner candidates: valid factorisations, memory filter, work-proportional rank sets."""

from harmonia.model.presets import mllm_preset
from harmonia.plan.candidates import (_divisors, balanced_split, check_memory, disjoint_sizes, encoder_layouts,
                                      llm_layouts, lower_bound_s)
from harmonia.plan.profiling import profile_batches
from harmonia.schedule.layout import Layout
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import cluster_from_string, device_preset
from harmonia.workload.traces import synthesize_trace
from harmonia.workload.work import ModuleLoad


def test_llm_factorisations_are_valid() -> None:
    mllm = mllm_preset("internvl-8b")  # Qwen2.5-7B: 28 heads, 4 KV heads
    cluster = cluster_from_string("h100:2x8")
    layouts = list(llm_layouts(CostModel(mllm, cluster.device), cluster, 16, 0, global_batch=128, n_microbatches=8))
    assert layouts and all(lay.size == 16 for lay in layouts)
    assert {lay.tp for lay in layouts} <= {1, 2, 4}  # 8 does not divide 28 heads
    assert all(lay.dp * 8 <= 128 for lay in layouts)
    assert all(e.size == 4 for e in encoder_layouts(mllm, "vision", cluster, 4, 12))


def test_divisors_are_every_divisor_in_order() -> None:
    for n in [*range(1, 200), 1024, 4096, 32768, 99991, 3 * 5 * 7 * 11 * 13]:  # squares, primes, powers of 2
        assert list(_divisors(n)) == [d for d in range(1, n + 1) if n % d == 0], n


def test_memory_filter_rejects_70b_on_one_gpu_and_accepts_it_sharded() -> None:
    cost = CostModel(mllm_preset("internvl-76b"), device_preset("h100"))
    cap = device_preset("h100").mem_bytes
    load = ModuleLoad(8192, 8192 * 4096, 1)
    assert not check_memory(cost, "llm", Layout(), load, 8, cap).fits
    assert check_memory(cost, "llm", Layout(tp=8, pp=4, dp=8, fsdp=True), load, 8, cap).fits
    # FSDP keeps the step's bf16 weights and fp32 gradients whole: over 2 replicas it shards too little
    assert not check_memory(cost, "llm", Layout(tp=8, pp=4, dp=2, fsdp=True), load, 8, cap).fits
    assert check_memory(cost, "llm", Layout(tp=8, pp=4, dp=2, fsdp=True), load, 8, cap, recompute=True).fits


def test_disjoint_sizes_follow_work_share_and_bound() -> None:
    cost = CostModel(mllm_preset("omni-8b"), device_preset("h100"))
    profile = profile_batches(synthesize_trace(512, seed=0), cost, 128, 4)
    sizes = list(disjoint_sizes(profile, ["vision", "audio"], 32))
    assert sizes and all(sum(s.values()) < 32 for s in sizes)
    layouts = {"vision": Layout(dp=sizes[0]["vision"]), "audio": Layout(dp=sizes[0]["audio"]),
               "llm": Layout(dp=32 - sum(sizes[0].values()))}
    bound = lower_bound_s(profile, layouts)
    assert bound >= profile.mean_costs()["llm"] / layouts["llm"].size
    llm = balanced_split(cost, "llm", Layout(pp=4, dp=2), profile.sample_load("llm"))
    assert sum(llm.stage_layers) == 32 and llm.stage_layers[-1] <= llm.stage_layers[1]


def test_even_split_of_a_frozen_aware_split() -> None:
    """Llama-3.1 70B over 8 stages: the frozen-aware split moves a block off the head's stage (it
    evens out compute alone); its even form is every baseline's split. Splits already even have none."""
    from harmonia.plan.candidates import even_split

    cost = CostModel(mllm_preset("llama3-70b"), device_preset("h100"))
    load = ModuleLoad(8192, 8192 * 8193 // 2, 1)  # one causal sequence of 8192 tokens
    balanced = balanced_split(cost, "llm", Layout(tp=4, cp=2, pp=8), load)
    assert balanced.stage_layers is not None and balanced.stage_split(80) != Layout(pp=8).stage_split(80)
    assert even_split(cost, "llm", balanced) == Layout(tp=4, cp=2, pp=8)
    assert even_split(cost, "llm", Layout(tp=4, pp=8)) is None
    assert even_split(cost, "llm", Layout(pp=8, stage_layers=(10,) * 8)) is None
