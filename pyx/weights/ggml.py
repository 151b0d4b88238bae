"""Weights kept in ggml's packed block formats (GGUF tensors, --isq), as the model graph sees them.

A `QuantizedWeight` stands where a float (N, K) matrix would: it has `.shape`, and the CPU
backend's `linear` computes on its blocks (pyx/quant_kernels.h). It is a stack of parts along N,
each one ggml type, because fusing q/k/v or gate/up of a GGUF file can meet different types
(Q4_K_M stores attn_v in Q6_K beside Q4_K for attn_q and attn_k). Its kernels live in the CPU
backend: pyx.cpu_backend.quantize_weight makes one from a float matrix (--isq),
dequantize_weight turns one back into float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT

# The types the CPU kernels compute on; names as --isq spells them.
ISQ_TYPES: dict[str, QT] = {"q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1,
                            "q8_0": QT.Q8_0, "q2k": QT.Q2_K, "q3k": QT.Q3_K, "q4k": QT.Q4_K,
                            "q5k": QT.Q5_K, "q6k": QT.Q6_K}
BLOCK_TYPES = frozenset(ISQ_TYPES.values())


@dataclass(slots=True)
class QuantizedWeight:
    quant_parts: list[tuple[int, np.ndarray]]   # (ggml type id, blocks (n_i, row_bytes) uint8)
    k: int                                      # row length in elements
    # The CPU's decode matmul writes each activation row as two 8-bit rows for this weight (as
    # act_split=on does for all): set by CpuBackend.place_weight on the roles act_split names.
    exact_activations: bool = False

    @classmethod
    def of(cls, qtype: int, blocks: np.ndarray, k: int) -> "QuantizedWeight":
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
        return cls([(int(qtype), blocks.reshape(blocks.shape[0], -1))], k)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(b.shape[0] for _, b in self.quant_parts), self.k

    @staticmethod
    def concat(weights: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Stack along N; neighbouring parts of one type merge into one."""
        k = weights[0].k
        if any(w.k != k for w in weights):
            raise ValueError("quantized weights to fuse must have the same row length")
        parts: list[tuple[int, list[np.ndarray]]] = []
        for w in weights:
            for qtype, blocks in w.quant_parts:
                if parts and parts[-1][0] == qtype:
                    parts[-1][1].append(blocks)
                else:
                    parts.append((qtype, [blocks]))
        return QuantizedWeight([(t, np.concatenate(b) if len(b) > 1 else b[0]) for t, b in parts],
                               k)
