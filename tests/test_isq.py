"""In-situ quantization (--isq) end to end on a tiny-256 checkpoint.

The oracle is transformers running the same checkpoint with every projection matrix replaced by
`gguf.quants.dequantize` of the blocks Taper made (the gguf package's own dequantizer, so a wrong
block layout shows). Taper computes on the packed blocks with 8-bit activations, so comparison
stops where the oracle's top-two log-probs are within 0.1: 8-bit activations move log-probs by a
few hundredths (the issue's 0.05 is for llama.cpp, which quantizes activations alike; seen here:
a 0.09 gap flipped on a checkpoint scaled x4).
That the quantized oracle differs from the float model shows the comparison sees quantization.
"""
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from checkpoints import tiny_checkpoint
from engine import LLM, SamplingParams
from engine.loader.isq import _PROJECTION, isq_type, quantize_weights, type_for
from engine.quant import QuantizedWeight
from hf_oracle import assert_matches, hf_greedy, load_hf

MARGIN = 0.1
TINY_256 = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, num_hidden_layers=2, vocab_size=512)
PROMPT = [5, 17, 300, 42, 8, 99, 256, 3, 77, 150, 12, 480]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("t256"), "llama", scale=2.0, **TINY_256)


def quantized_oracle(model_dir, isq: str):
    """transformers with each projection replaced by gguf's dequantization of Taper's blocks."""
    hf = load_hf(model_dir)
    weights = {n: p.detach().numpy().copy() for n, p in hf.named_parameters()
               if _PROJECTION.match(n)}
    quantize_weights(weights, isq, progress=False)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            w = weights.get(name)
            if isinstance(w, QuantizedWeight):
                (qtype, blocks), = w.quant_parts
                p.copy_(torch.from_numpy(gguf_dequantize(blocks, QT(qtype)).reshape(p.shape)))
    return hf


@pytest.mark.parametrize("isq", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2k", "q3k", "q4k",
                                 "q5k", "q6k"])
def test_isq_greedy_matches_transformers_on_the_dequantized_weights(model_dir, isq):
    reference = hf_greedy(quantized_oracle(model_dir, isq), PROMPT, 24, tie=MARGIN)
    llm = LLM(model_dir, isq=isq, num_kv_blocks=32)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert_matches(out[0].token_ids, reference, label=isq)


def test_the_oracle_sees_quantization(model_dir):
    """The quantized weights change transformers' logits by more than twice the margin, so
    matching the oracle is evidence about the quantized path, not the float one."""
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        floats = load_hf(model_dir)(ids).logits[0, -1]
        q4 = quantized_oracle(model_dir, "q4_0")(ids).logits[0, -1]
    assert float((floats - q4).abs().max()) > 2 * MARGIN


def test_fallbacks_follow_llama_cpp(tmp_path, caplog):
    assert type_for(QT.Q4_K, 768) == QT.Q4_K
    assert (type_for(QT.Q4_K, 96), type_for(QT.Q5_K, 96), type_for(QT.Q6_K, 96),
            type_for(QT.Q2_K, 96)) == (QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_0)
    assert type_for(QT.Q8_0, 80) is None and type_for(QT.Q4_K, 80) is None
    weights = {"model.layers.0.mlp.down_proj.weight": np.ones((8, 96), np.float32),
               "model.layers.0.mlp.up_proj.weight": np.ones((96, 256), np.float32),
               "model.layers.0.self_attn.o_proj.weight": np.ones((8, 80), np.float32),
               "model.embed_tokens.weight": np.ones((8, 256), np.float32)}
    with caplog.at_level(logging.WARNING, logger="taper.loader"):
        quantize_weights(weights, "q4k", progress=False)
    kinds = {n: (w.quant_parts[0][0] if isinstance(w, QuantizedWeight) else "float")
             for n, w in weights.items()}
    assert kinds == {"model.layers.0.mlp.down_proj.weight": QT.Q5_0,
                     "model.layers.0.mlp.up_proj.weight": QT.Q4_K,
                     "model.layers.0.self_attn.o_proj.weight": "float",
                     "model.embed_tokens.weight": "float"}
    assert "down_proj.weight -> Q5_0" in caplog.text and "o_proj.weight -> float" in caplog.text
    with pytest.raises(ValueError, match="choose from"):
        isq_type("q3_z")
