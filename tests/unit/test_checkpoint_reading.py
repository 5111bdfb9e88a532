"""Reading HF checkpoints one tensor (or one shard's box) at a time, and the clear errors of bad ones."""

import json

import pytest
import torch
from safetensors.torch import save_file

from harmonia.errors import ConfigError
from harmonia.model.hf.io import CheckpointFiles
from harmonia.model.hf.mllm import mllm_spec_from_hf
from harmonia.model.hf.stages import ModuleReader
from harmonia.train.weights import chunk_values, initial_model

transformers = pytest.importorskip("transformers")
from tests.unit.test_model_hf_llava import make_llava  # noqa: E402


def test_a_box_reads_only_its_part(tmp_path) -> None:
    save_file({"w": torch.arange(24.0).view(6, 4)}, str(tmp_path / "model.safetensors"))
    files = CheckpointFiles(tmp_path)
    assert files.header("w") == ((6, 4), "F32")
    torch.testing.assert_close(files.read_part("w", (slice(3, 6), slice(0, 4))), torch.arange(12.0, 24.0).view(3, 4))


def test_a_truncated_file_is_an_error_naming_it(tmp_path) -> None:
    make_llava(tmp_path)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ConfigError, match="model.safetensors.*truncated or corrupt"):
        initial_model(mllm_spec_from_hf(tmp_path), 0, str(tmp_path))


def test_a_job_on_a_truncated_checkpoint_stops_before_anything_starts(tmp_path) -> None:
    from harmonia.config import load_config
    from harmonia.train.planning import check_model_files

    make_llava(tmp_path / "hf")
    config = load_config(None, [f"--model.hf={tmp_path / 'hf'}"])
    check_model_files(config)  # whole files pass
    file = tmp_path / "hf" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ConfigError, match="hf/model.safetensors: not a readable safetensors file .* truncated"):
        check_model_files(config)


def test_a_tensor_whose_shape_disagrees_with_config_json_is_an_error_naming_it(tmp_path) -> None:
    make_llava(tmp_path)
    spec = mllm_spec_from_hf(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 64  # the weights say 48
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"model.safetensors: tensor '.*mlp.gate_proj.weight' .* shape \(48, 32\)"):
        initial_model(mllm_spec_from_hf(tmp_path), 0, str(tmp_path))
    assert spec.llm.body.ffn_hidden == 48


def test_a_quantized_tensor_is_an_error_naming_it(tmp_path) -> None:
    make_llava(tmp_path)
    files = CheckpointFiles(tmp_path)
    state = files.read(files.keys())
    name = next(k for k in state if k.endswith("layers.0.mlp.up_proj.weight"))
    state[name] = state[name].to(torch.int8)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"tensor '{name}' .* is stored as I8"):
        initial_model(mllm_spec_from_hf(tmp_path), 0, str(tmp_path))


def test_a_checkpoint_lacking_a_tensor_is_refused_before_anything_is_allocated(tmp_path) -> None:
    make_llava(tmp_path)
    files = CheckpointFiles(tmp_path)
    state = {k: v for k, v in files.read(files.keys()).items() if "layers.1.self_attn.k_proj" not in k}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    spec = mllm_spec_from_hf(tmp_path)
    from harmonia.model.mllm import build_module

    with torch.device("meta"):
        llm = build_module(spec, "llm")
    with pytest.raises(ConfigError, match="checkpoint lacks 1 tensors of llm.*layers.1.attn.k_proj.weight"):
        chunk_values(llm, spec, "llm", 0, str(tmp_path))
    assert all(p.is_meta for p in llm.parameters())
    assert ModuleReader(str(tmp_path), spec, "llm").lacking(["layers.1.attn.k_proj.weight"])
