"""Module-scoped fixtures for tests on the tiny random Llama checkpoint (tests/checkpoints.py):
its directory and transformers' model of it, the reference. A test module imports them
(`from tiny_llama import hf, model_dir`)."""
from __future__ import annotations

import pytest

from checkpoints import tiny_checkpoint
from hf_oracle import load_hf


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)
