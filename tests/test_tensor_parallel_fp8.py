"""FP8 checkpoints under tensor parallel 2 (issue 28): block-wise (quant_method fp8, its
weight_scale_inv blocks cut with their weight, engine/parallel/sharding.py) and
compressed-tensors float-quantized (per-channel scales cut with a column-parallel layer's rows,
whole for a row-parallel one; per-block scales in whole blocks: sharding_compressed.py). Greedy
tokens equal transformers' on the dequantized weights and the single process's, logprobs within
float tolerance; a scale cut that does not follow its weight's fails them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_oracle import assert_matches, hf_greedy
from test_fp8 import (BLOCK_QC, MARGIN, PROMPT, TINY_256, block_quantize, channel_quantize,
                      compressed_qc, dequantize_blocks, f8_tensor, oracle_with, quantize_blocks,
                      write_quantized)
from checkpoints import tiny_checkpoint
from test_tensor_parallel import assert_same_as_one_process, greedy

pytestmark = pytest.mark.timeout(300)


def compressed_block_qc():
    qc = compressed_qc(False)
    qc["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[128, 128])
    return qc


def compressed_block_quantize(prefix, w):
    codes, scale = quantize_blocks(w, 128, 128)
    return ({prefix + ".weight": f8_tensor(codes),
             prefix + ".weight_scale": torch.from_numpy(scale)},
            dequantize_blocks(codes, scale, 128, 128))


# (quantize, quantization_config, layers left float)
CASES = {
    "fp8 block": (block_quantize, BLOCK_QC, ("model.layers.1.mlp.down_proj",)),
    "compressed channel": (channel_quantize, compressed_qc(False), ()),
    "compressed channel static": (lambda p, w: channel_quantize(p, w, static=True),
                                  compressed_qc(True), ()),
    "compressed block": (compressed_block_quantize, compressed_block_qc(), ()),
}


@pytest.fixture(scope="module")
def floats(tmp_path_factory):
    """Heads of 128: each rank's K/V rows are whole 128-row scale blocks (a share of half a
    block is a start-up error, as in vLLM)."""
    shape = dict(TINY_256, num_attention_heads=2, num_key_value_heads=2, head_dim=128)
    return tiny_checkpoint(tmp_path_factory.mktemp("f"), "llama", scale=4.0, seed=5, **shape)


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_checkpoints_split_across_two_ranks(floats, tmp_path, case):
    quantize, qc, skip = CASES[case]
    dequantized = write_quantized(floats, str(tmp_path), quantize, qc, skip=skip)
    model = str(tmp_path)
    split = greedy(model, 2, prompts=[PROMPT])
    assert_same_as_one_process(greedy(model, prompts=[PROMPT]), split, f"{case} tp2")
    if "static" not in case:        # (static input scales: the same weights as the dynamic case)
        tokens = split[0][0]
        reference = hf_greedy(oracle_with(floats, dequantized), PROMPT, len(tokens), tie=MARGIN)
        assert_matches(tokens, reference, label=f"{case} tp2")


def test_per_channel_scales_follow_the_rows(floats, tmp_path):
    """Column-parallel q_proj: rank 1's scales are the rows it holds; row-parallel o_proj: every
    row's scale, on every rank."""
    from engine.models.model_config import ModelConfig
    from engine.parallel.sharding import ShardPlan
    write_quantized(floats, str(tmp_path), channel_quantize, compressed_qc(False))
    plan = ShardPlan(ModelConfig.from_pretrained(str(tmp_path)), 1, 2)
    scale = np.arange(256, dtype=np.float32).reshape(256, 1)
    shapes = {"model.layers.0.self_attn.q_proj.weight": (256, 256),
              "model.layers.0.self_attn.o_proj.weight": (256, 256)}
    q = plan.shard("model.layers.0.self_attn.q_proj.weight_scale", scale, shapes)
    np.testing.assert_array_equal(q, scale[128:])
    o = plan.shard("model.layers.0.self_attn.o_proj.weight_scale", scale, shapes)
    np.testing.assert_array_equal(o, scale)
