"""The references must be the pinned CPU builds: a CUDA torch would be a different oracle."""
import torch
import transformers


def test_reference_versions_are_pinned_cpu_builds():
    assert torch.__version__ == "2.13.0+cpu", torch.__version__
    assert transformers.__version__ == "5.23.0", transformers.__version__
