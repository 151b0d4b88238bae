"""Which CUDA attention kernel a paged_attention call takes, and the checks of the masks only some
kernels have, in plain Python so that the rule is tested on machines without a GPU
(tests/test_attention_dispatch.py; the kernels themselves in tests/gpu/).

- "masked" (cuda/attention_prefill.cu taper_cuda_paged_attention_masked: the simple kernel over
  any batch) for GPT-OSS's attention sinks, Llama 4's chunked attention and head sizes above 256
  (Gemma 4's full layers): the tuned kernels have none of them;
- else "decode" for a batch of one row per sequence (T == B: flash-decoding, split-K);
- else "prefill" (the KernelConfig's prefill variant, the simple one where it lacks a shape).
"""
from __future__ import annotations

import numpy as np

TUNED_MAX_HEAD_DIM = 256    # the decode and prefill kernels' widest head
MASKED_MAX_HEAD_DIM = 512   # the masked kernel's


def attention_kernel(T: int, B: int, D: int, sinks, attention_chunk: int) -> str:
    if sinks is not None or attention_chunk > 0 or D > TUNED_MAX_HEAD_DIM:
        return "masked"
    return "decode" if T == B else "prefill"


def check_masks(op: str, sinks, attention_chunk, Hq: int, D: int) -> int:
    """attention_chunk as an int (ValueError unless an integer >= 0); sinks None or a float32
    (Hq,) array; D at most MASKED_MAX_HEAD_DIM. Errors name the op and the argument."""
    if isinstance(attention_chunk, bool) or not isinstance(attention_chunk, (int, np.integer)):
        raise ValueError(f"{op}: attention_chunk must be an integer >= 0 (0 = off), got "
                         f"{attention_chunk!r}")
    if attention_chunk < 0:
        raise ValueError(f"{op}: attention_chunk must be >= 0 (0 = off), got {attention_chunk}")
    if sinks is not None:
        if getattr(sinks, "dtype", None) != np.float32 or tuple(sinks.shape) != (Hq,):
            raise ValueError(f"{op}: need sinks (Hq,) = ({Hq},) float32, one per query head, got "
                             f"{tuple(getattr(sinks, 'shape', ()))} "
                             f"{getattr(sinks, 'dtype', type(sinks).__name__)}")
    if D > MASKED_MAX_HEAD_DIM:
        raise ValueError(f"{op}: head_dim {D} is over the CUDA kernels' {MASKED_MAX_HEAD_DIM}")
    return int(attention_chunk)
