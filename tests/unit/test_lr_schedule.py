"""Learning-rate schedules (cosine, linear, constant, wsd) and per-module peak lr and weight decay:
the schedule's values by hand, the config fields and their errors, and the param groups of the
optimizers a rank builds."""

import json
import math
from functools import partial

import pytest

from harmonia.config import load_config
from harmonia.errors import ConfigError
from harmonia.train.loop import build_optimizer, learning_rate, set_learning_rates
from harmonia.train.lr_schedule import LR_SCHEDULES, LRSchedule

STEPS, WARMUP, MIN_RATIO, DECAY_STEPS = 10, 2, 0.2, 4


def shape(kind: str) -> LRSchedule:
    """10 steps: 2 of warm-up, decay to 20% of the peak (wsd: over the last 4 steps)."""
    return LRSchedule(kind, STEPS, WARMUP, MIN_RATIO, DECAY_STEPS)


def modules_override(modules: dict) -> str:
    return f"--train.modules={json.dumps(modules)}"


@pytest.mark.parametrize(
    "kind, expected",
    [
        # the decay runs over steps 2..10 (8 steps); step 6 is half-way, step 9 is 7/8 of the way
        ("cosine", {2: 1.0, 6: 0.2 + 0.8 * 0.5, 9: 0.2 + 0.8 * (1 - math.cos(math.pi / 8)) / 2, 10: 0.2}),
        ("linear", {2: 1.0, 6: 0.6, 9: 0.3, 10: 0.2}),
        ("constant", {2: 1.0, 6: 1.0, 9: 1.0, 10: 1.0}),
        # stable on steps 2..6, then a linear decay over the last 4 steps (6..10)
        ("wsd", {2: 1.0, 5: 1.0, 6: 1.0, 7: 0.8, 8: 0.6, 9: 0.4, 10: 0.2}),
    ],
)
def test_each_schedule_by_hand(kind, expected) -> None:
    schedule = shape(kind)
    assert schedule.lr(3.0, 0) == pytest.approx(1.5)  # warm-up: step 0 at peak / 2, step 1 at the peak
    assert schedule.lr(3.0, 1) == pytest.approx(3.0)
    for step, ratio in expected.items():  # step 10, one past the last, is where the decay ends
        assert schedule.lr(3.0, step) == pytest.approx(3.0 * ratio), step


def _todays_cosine(peak: float, step: int, warm: int, total: int) -> float:
    """The warm-up then cosine to 10% that every existing config trains with."""
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize("steps, warmup, lr", [(120, -1, 3e-3), (3, -1, 1.0), (10, 0, 1e-4), (10, 10, 2e-5),
                                               (7, 3, 0.1)])
def test_the_default_is_the_cosine_of_before_at_every_step(steps, warmup, lr) -> None:
    config = load_config(None, [f"--train.steps={steps}", f"--train.warmup={warmup}", f"--train.lr={lr}"])
    assert config.train.lr_schedule == "cosine" and config.train.min_lr_ratio == 0.1
    warm = config.train.warmup_steps
    assert [learning_rate(config, s) for s in range(steps)] == [_todays_cosine(lr, s, warm, steps)
                                                                for s in range(steps)]


def test_wsd_holds_the_peak_and_decays_only_over_the_last_decay_ratio() -> None:
    config = load_config(None, ["--train.steps=100", "--train.warmup=5", "--train.lr_schedule=wsd",
                                "--train.decay_ratio=0.2", "--train.min_lr_ratio=0"])
    lrs = [learning_rate(config, s) for s in range(100)]
    peak = config.train.lr
    assert config.train.decay_steps == 20
    assert lrs[4:81] == [peak] * 77  # the warm-up's last step through the decay's first
    assert all(b < a for a, b in zip(lrs[80:], lrs[81:]))
    assert lrs[99] == pytest.approx(peak / 20)  # 1/20 of the way above 0


@pytest.mark.parametrize("kind", LR_SCHEDULES)
def test_every_schedule_is_a_config_value(kind) -> None:
    config = load_config(None, [f"--train.lr_schedule={kind}", "--train.warmup=1", "--train.steps=4"])
    assert learning_rate(config, 0) == config.train.lr


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["--train.lr_schedule=step"], "train.lr_schedule='step'"),
        (["--train.min_lr_ratio=1.5"], "train.min_lr_ratio=1.5"),
        (["--train.min_lr_ratio=-0.1"], "train.min_lr_ratio=-0.1"),
        (["--train.decay_ratio=0"], "train.decay_ratio=0.0"),
        (["--train.decay_ratio=1.01"], "train.decay_ratio=1.01"),
        (["--train.steps=10", "--train.warmup=11"], "train.warmup=11"),
        ([modules_override({"vison_proj": {"lr": 0.01}})],
         r"train.modules=\['vison_proj'\].*\['vision', 'audio', 'vision_proj', 'audio_proj', 'llm'\]"),
        ([modules_override({"llm": {"lr": -1}})], "train.modules.llm.lr=-1"),
        ([modules_override({"llm": {"lr": True}})], "train.modules.llm.lr=True"),
        ([modules_override({"llm": {"weight_decay": -0.5}})], "train.modules.llm.weight_decay=-0.5"),
        ([modules_override({"llm": {"betas": [0.9, 0.95]}})], r"train.modules.llm=.*not \['betas'\]"),
        ([modules_override({"llm": 0.01})], "train.modules.llm=0.01.*a table of lr and/or weight_decay"),
    ],
)
def test_bad_values_name_the_field(overrides, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_the_ratios_bounds_are_valid() -> None:
    for overrides in (["--train.min_lr_ratio=0"], ["--train.min_lr_ratio=1"], ["--train.decay_ratio=1"]):
        load_config(None, overrides)
    flat = load_config(None, ["--train.min_lr_ratio=1", "--train.steps=10", "--train.warmup=0"])
    assert [learning_rate(flat, s) for s in range(10)] == pytest.approx([flat.train.lr] * 10)


def test_a_module_table_in_toml(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[train]\nlr = 1e-4\nweight_decay = 0.1\n[train.modules.vision_proj]\nlr = 1e-3\n"
                    "[train.modules.llm]\nweight_decay = 0\n")
    tc = load_config(path).train
    assert (tc.lr_of("vision_proj"), tc.weight_decay_of("vision_proj")) == (1e-3, 0.1)
    assert (tc.lr_of("llm"), tc.weight_decay_of("llm")) == (1e-4, 0.0)
    assert (tc.lr_of("vision"), tc.weight_decay_of("vision")) == (1e-4, 0.1)
    assert (tc.lr_of(None), tc.weight_decay_of(None)) == (1e-4, 0.1)


@pytest.mark.parametrize("kind", LR_SCHEDULES)
def test_a_module_lr_follows_the_schedule_from_its_own_peak(kind) -> None:
    config = load_config(None, ["--train.lr=1e-4", "--train.steps=50", "--train.warmup=5",
                                f"--train.lr_schedule={kind}", modules_override({"vision_proj": {"lr": 1e-3}})])
    for step in (0, 4, 5, 30, 46, 49):
        scheduled = learning_rate(config, step)
        assert learning_rate(config, step, "vision_proj") == pytest.approx(10 * scheduled, rel=1e-12)
        assert learning_rate(config, step, "llm") == scheduled
        assert learning_rate(config, step, "vision") == scheduled


def _rank_model(config):
    """tiny-vlm on a world of one rank, its optimizers built as `harmonia.train.loop.Trainer` builds them."""
    from harmonia.runtime.meshes import build_module_meshes
    from harmonia.schedule.layout import Layout
    from harmonia.schedule.plan import Plan
    from harmonia.train.planning import model_spec
    from harmonia.train.rank import build_rank_model

    layouts = {"vision": Layout(), "llm": Layout()}
    plan = Plan(model="tiny-vlm", layouts=layouts, placement="colocated", n_microbatches=1, global_batch=1)
    return build_rank_model(model_spec(config), plan, build_module_meshes(layouts), 0,
                            partial(build_optimizer, config), None)


def _groups(model) -> dict[str, dict]:
    """Module -> its param group, over every optimizer of the rank (each module in exactly one)."""
    groups = [g for opt in model.executor.optimizers.values() for g in opt.param_groups]
    assert len({g["module"] for g in groups}) == len(groups)
    return {g["module"]: g for g in groups}


def test_each_module_trains_at_its_own_lr_and_weight_decay(one_process_group) -> None:
    config = load_config(None, ["--model.preset=tiny-vlm", "--model.frozen=", "--train.lr=1e-4",
                                "--train.weight_decay=0.01", "--train.steps=20", "--train.warmup=2",
                                modules_override({"vision_proj": {"lr": 1e-3, "weight_decay": 0.0}})])
    model = _rank_model(config)
    groups = _groups(model)
    assert [g["module"] for g in model.executor.optimizers["vision"].param_groups] == ["vision", "vision_proj"]
    projector = {id(t) for n, t in model.trainable_named().items() if n.startswith("projectors.vision_proj.")}
    assert projector and {id(p) for p in groups["vision_proj"]["params"]} == projector
    assert {m: g["weight_decay"] for m, g in groups.items()} == {"vision": 0.01, "vision_proj": 0.0, "llm": 0.01}
    for step in (0, 1, 10, 19):
        set_learning_rates(model.executor.optimizers, config, step)
        scheduled = learning_rate(config, step)
        assert groups["vision_proj"]["lr"] == pytest.approx(10 * scheduled, rel=1e-12)
        assert groups["vision"]["lr"] == groups["llm"]["lr"] == scheduled


def test_a_frozen_encoder_leaves_its_projector_the_only_group(one_process_group) -> None:
    config = load_config(None, ["--model.preset=tiny-vlm", "--model.frozen=vision",
                                modules_override({"vision": {"lr": 1.0}, "vision_proj": {"weight_decay": 0.5}})])
    model = _rank_model(config)
    groups = _groups(model)
    assert sorted(groups) == ["llm", "vision_proj"]
    assert (groups["vision_proj"]["lr"], groups["vision_proj"]["weight_decay"]) == (config.train.lr, 0.5)
    trained = {id(p) for g in groups.values() for p in g["params"]}
    assert trained == {id(t) for t in model.trainable_named().values()}
