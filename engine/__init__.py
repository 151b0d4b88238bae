"""Taper's engine: `LLM` for offline generation, `AsyncEngine` for serving."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.sampling.sampling_params import SamplingParams
from engine.sampling.structured_outputs import StructuredOutputsParams
from pyx.kernel_config import KernelConfig

__all__ = ["LLM", "AsyncEngine", "EngineConfig", "KernelConfig", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]


def __getattr__(name):  # keep `import engine` light: the model stack loads on first use
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
