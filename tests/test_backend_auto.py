"""EngineConfig.backend "auto": CUDA where this build has the CUDA extension and a device is
visible, else the CPU; the server asks the engine (engine/runner/backends.py), never pyx."""
from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from engine.config import EngineConfig
from engine.runner import backends


@pytest.fixture
def fake_cuda_extension(monkeypatch):
    """A stand-in pyx.cuda_backend whose device count the test sets."""
    module = types.ModuleType("pyx.cuda_backend")
    module.devices = 0
    module.device_count = lambda: module.devices
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        object() if name == "pyx.cuda_backend" else find_spec(name, *a)))
    monkeypatch.setitem(sys.modules, "pyx.cuda_backend", module)
    return module


def test_auto_is_cuda_with_a_device_and_cpu_without(fake_cuda_extension):
    assert EngineConfig(model="m").backend == "cpu"
    fake_cuda_extension.devices = 1
    assert EngineConfig(model="m").backend == "cuda"
    assert EngineConfig(model="m", backend="cpu").backend == "cpu"


def test_auto_is_cpu_in_a_build_without_the_cuda_extension(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        None if name == "pyx.cuda_backend" else find_spec(name, *a)))
    assert backends.detect_backend() == "cpu"
    assert EngineConfig(model="m").backend == "cpu"


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="auto, cpu or cuda, got 'tpu'"):
        EngineConfig(model="m", backend="tpu")


def test_server_asks_the_engine(monkeypatch):
    from server.__main__ import build_parser, engine_config
    monkeypatch.setattr(backends, "detect_backend", lambda: "cuda")
    assert engine_config(build_parser().parse_args(["--w", "m"])).backend == "cuda"
    assert engine_config(build_parser().parse_args(["--w", "m", "--cpu"])).backend == "cpu"
