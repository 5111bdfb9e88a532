"""Training config: TOML, overrides, and errors that name the field before anything starts."""

import pytest

from harmonia.config import help_lines, load_config
from harmonia.errors import ConfigError


def test_defaults_file_and_overrides(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[train]\nsteps = 7\nlr = 1\n[model]\nfrozen = ["audio"]\n')
    cfg = load_config(path, ["--train.global_batch=16", "--log.tensorboard=false", "--model.lora=llm"])
    assert (cfg.train.steps, cfg.train.lr, cfg.train.global_batch) == (7, 1.0, 16)
    assert cfg.model.frozen == ["audio"] and cfg.model.lora == ["llm"] and cfg.log.tensorboard is False
    assert cfg.to_dict()["train"]["steps"] == 7
    as_list = load_config(path, ['--model.lora=["llm"]', '--model.frozen= [ "vision" , "audio" ] '])
    assert as_list.model.lora == ["llm"] and as_list.model.frozen == ["vision", "audio"]  # as TOML writes lists
    assert any(line.startswith("--train.steps=") for line in help_lines())


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["--train.steps=0"], "train.steps=0"),
        (["--train.steps=ten"], "train.steps='ten'.*int"),
        (["--trian.steps=3"], "unknown config section"),
        (["--train.stepz=3"], "unknown config key train.stepz"),
        (["--model.preset=gpt5"], "model.preset='gpt5'"),
        (["--model.frozen=visoin"], "model.frozen=.*module names"),
        (["--model.lora=lm"], r"model.lora=\['lm'\] is invalid: expected module names"),
        (["--model.lora=[llm"], "model.lora='\\[llm' is invalid: expected list .*comma-separated"),
        (["--model.frozen=[1]"], "model.frozen='\\[1\\]' is invalid: expected list"),
        (["--data.on_error=ignore"], "data.on_error"),
        (["--parallel.plan=missing.json"], "parallel.plan"),
        (["steps=3"], "expected --section.key=value"),
        (["--parallel.schedule_search=-2"], "parallel.schedule_search=-2"),
        (["--parallel.prepare_timeout_s=0"], r"prepare_timeout_s=0.0 is invalid: expected a finite number > 0"),
        (["--parallel.prepare_timeout_s=inf"], "parallel.prepare_timeout_s=inf"),
        (["--parallel.collective_timeout_s=-1"], "parallel.collective_timeout_s=-1.0"),
    ],
)
def test_bad_values_name_the_field(overrides, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_the_wait_for_rank_0s_preparation_is_a_field() -> None:
    assert load_config(None, []).parallel.prepare_timeout_s == 1800.0
    assert load_config(None, ["--parallel.prepare_timeout_s=90"]).parallel.prepare_timeout_s == 90.0
    assert any(line.startswith("--parallel.prepare_timeout_s=1800.0: under torchrun") for line in help_lines())


def test_bad_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_schedule_search_auto_is_off_on_cpu_and_on_with_gpus() -> None:
    """Every rank runs the per-batch search beside its compute: on CPU ranks it would take their time."""
    from harmonia.train import backend

    assert backend.schedule_search(load_config(None, ["--parallel.schedule_search=5"])) == 5
    assert backend.schedule_search(load_config(None, ["--parallel.backend=gloo"])) == 0
    assert backend.schedule_search(load_config(None, ["--parallel.backend=nccl"])) == backend.SCHEDULE_SEARCH_GPU


def test_the_default_warmup_fits_any_number_of_steps() -> None:
    from harmonia.train.loop import learning_rate

    short = load_config(None, ["--train.steps=3"])
    assert short.train.warmup_steps == 1
    assert [round(learning_rate(short, s) / short.train.lr, 3) for s in range(3)] == [1.0, 1.0, 0.55]
    assert load_config(None, []).train.warmup_steps == 4  # 3% of 120 steps, rounded up
    assert load_config(None, ["--train.warmup=0"]).train.warmup_steps == 0
    with pytest.raises(ConfigError, match="train.warmup"):
        load_config(None, ["--train.steps=3", "--train.warmup=4"])


def test_the_world_size_and_the_cluster_follow_each_other() -> None:
    from harmonia.train.planning import with_world_size

    def parallel(*args):
        p = with_world_size(load_config(None, list(args))).parallel
        return p.world_size, p.cluster

    assert parallel() == (4, "cpu:1x4")
    assert parallel("--parallel.world_size=2") == (2, "cpu:1x2")
    assert parallel("--parallel.cluster=h100:2x8") == (16, "h100:2x8")
    assert parallel("--parallel.world_size=3", "--parallel.cluster=cpu:1x4") == (3, "cpu:1x4")  # refused at start


def test_a_gpu_job_on_a_cpu_cluster_is_refused(monkeypatch) -> None:
    from harmonia.train.planning import check_cluster

    config = load_config(None, ["--parallel.world_size=8", "--parallel.backend=nccl"])
    with pytest.raises(ConfigError, match="models CPUs but this job runs on GPUs .* --parallel.cluster=h100:1x8"):
        check_cluster(config)
