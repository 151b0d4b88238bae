"""Safetensors loading: sharded checkpoints, the dtype policy, memory mapping, and clear errors for
missing, truncated and mis-shaped tensors. Files come from the safetensors/transformers writers."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from checkpoints import tiny_checkpoint
from engine.loader import safetensors as st
from engine.loader.hub import resolve_model
from engine.loader.safetensors import CheckpointError, load_safetensors


def is_memory_mapped(a: np.ndarray) -> bool:
    while a is not None:
        if isinstance(a, np.memmap):
            return True
        a = a.base if isinstance(a.base, np.ndarray) else None
    return False


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("bf16"), "qwen2", dtype="bfloat16")


def _torch_state(model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {k: v.numpy() for k, v in model.state_dict().items()}


def test_sharded_checkpoint_loads_every_tensor(tmp_path):
    from transformers import AutoModelForCausalLM
    from checkpoints import scale_weights, tiny_config
    model = scale_weights(AutoModelForCausalLM.from_config(tiny_config("qwen2")))
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    weights = load_safetensors(str(tmp_path), progress=False)
    expected = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert set(weights) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)


def test_bf16_stays_bf16_and_memory_mapped(bf16_dir):
    weights = load_safetensors(bf16_dir, progress=False)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == ml_dtypes.bfloat16 and is_memory_mapped(q) and not q.flags.writeable
    assert weights["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    assert weights["lm_head.weight"].dtype == ml_dtypes.bfloat16
    for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.self_attn.q_proj.bias"):
        assert weights[name].dtype == np.float32, name
    ref = _torch_state(bf16_dir)
    np.testing.assert_array_equal(q.astype(np.float32), ref["model.layers.0.self_attn.q_proj.weight"])


def test_dtype_conversions(bf16_dir, tmp_path):
    f32 = load_safetensors(bf16_dir, dtype="f32", progress=False)
    assert f32["model.layers.0.mlp.up_proj.weight"].dtype == np.float32
    f32_dir = tiny_checkpoint(tmp_path, "llama")
    auto = load_safetensors(f32_dir, progress=False)
    assert auto["model.layers.0.mlp.up_proj.weight"].dtype == np.float32
    assert is_memory_mapped(auto["model.layers.0.mlp.up_proj.weight"])
    bf16 = load_safetensors(f32_dir, dtype="bf16", progress=False)
    assert bf16["model.layers.0.mlp.up_proj.weight"].dtype == ml_dtypes.bfloat16
    assert bf16["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    assert bf16["model.norm.weight"].dtype == np.float32
    with pytest.raises(ValueError, match="dtype"):
        load_safetensors(f32_dir, dtype="int4")


def _write(path, tensors):
    save_file({k: torch.as_tensor(np.ascontiguousarray(v)) for k, v in tensors.items()}, str(path))


def test_truncated_file_names_file_and_tensor(tmp_path):
    path = tmp_path / "model.safetensors"
    _write(path, {"a": np.ones((4, 4), np.float32), "b": np.ones((64, 64), np.float32)})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(CheckpointError) as e:
        load_safetensors(str(tmp_path), progress=False)
    assert str(path) in str(e.value) and "tensor b" in str(e.value) and "truncated" in str(e.value)


def test_misshaped_tensor_in_file_names_file_and_tensor(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}}
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(64))
    with pytest.raises(CheckpointError) as e:
        load_safetensors(str(tmp_path), progress=False)
    assert str(path) in str(e.value) and "tensor w" in str(e.value)


def test_misshaped_and_missing_tensors_for_the_model(tmp_path):
    from engine.loader.model_loader import load_model
    from pyx.backend import Backend
    d = tiny_checkpoint(tmp_path, "llama")
    path = os.path.join(d, "model.safetensors")
    tensors = {k: np.array(v) for k, v in st.open_file(path).items()}
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][:, :-1]
    _write(path, tensors)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight has shape \[96, 191\]"):
        load_model(d, Backend("none"), progress=False)
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    _write(path, tensors)
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.0\.self_attn\.v_proj\.weight"):
        load_model(d, Backend("none"), progress=False)


def test_index_entry_missing_from_shard(tmp_path):
    _write(tmp_path / "a.safetensors", {"x": np.ones(3, np.float32)})
    index = {"weight_map": {"x": "a.safetensors", "y": "a.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"tensor y .*missing"):
        load_safetensors(str(tmp_path), progress=False)
    index["weight_map"]["y"] = "b.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"shard b.safetensors .*missing"):
        load_safetensors(str(tmp_path), progress=False)


def test_memory_estimate_logged_and_enforced(bf16_dir, monkeypatch, caplog):
    with caplog.at_level("INFO", logger="taper.loader"):
        load_safetensors(bf16_dir, progress=False)
    assert any("needs" in r.message and "GB available" in r.message for r in caplog.records)
    monkeypatch.setattr(st, "mem_available_bytes", lambda: 1000)
    with pytest.raises(MemoryError, match=r"needs .* GB, 0.00 GB available"):
        load_safetensors(bf16_dir, progress=False)


def test_hub_resolution(tmp_path):
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    # an unknown hub id offline: a clear error, no network
    code = ("from engine.loader.hub import resolve_model\n"
            "try:\n    resolve_model('taper-tests/no-such-model')\n"
            "except FileNotFoundError as e:\n    print('ERR', e)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "ERR taper-tests/no-such-model is neither a local directory" in out.stdout, out.stderr
    assert "HF_HUB_OFFLINE" in out.stdout


def test_matrices_the_kernels_cannot_read_become_f32(tmp_path):
    """f64 (and f8) matrices load as f32 under "auto"; bf16 stays bf16."""
    tensors = {"a": torch.randn(4, 8, dtype=torch.float64), "b": torch.randn(4, 8).bfloat16()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    weights = load_safetensors(str(tmp_path), progress=False)
    assert weights["a"].dtype == np.float32 and weights["b"].dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(weights["a"], tensors["a"].numpy(), rtol=1e-6)
