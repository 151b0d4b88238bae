"""Tensor and pipeline parallel for compressed-tensors pack-quantized int4 checkpoints (group and
channel strategies, symmetric and with zero points) and Taper's Marlin-format checkpoints
(engine/parallel/sharding_compressed.py, sharding_marlin.py), on the CPU (MPI).

- Each rank's share, cut from the file before conversion (views of the mapped file), dequantizes
  to exactly the slice of the whole layer that the float weight's cut would give (every
  projection, both ranks of 2).
- Greedy tokens with tensor_parallel_size 2 and with pipeline_parallel_size 2 equal the single
  process's (logprobs within float tolerance), and tensor parallel's equal transformers' on the
  dequantized weights (the oracle of tests/test_int4_formats.py, on its prompt) up to the
  oracle's first near-tie.
- Clear errors: a row share that is not whole quantization groups (compressed-tensors groups of
  256), a Marlin share that is not whole 64-column tiles, a Marlin layer whose padded N would be
  cut, a compressed-tensors format other than int4 and FP8 (int-quantized W8A8).

Checkpoints: tests/test_int4_formats.py's writers (compressed-tensors' own ModelCompressor, the
GPTQ packer) on its tiny-256 Llama, converted to Marlin by engine/tools/convert_marlin.py.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from checkpoints import edit_config, tiny_checkpoint
from hf_oracle import assert_matches, hf_greedy
from model_cases import GEN, prompts_for
from test_int4_formats import (CHECKPOINT, MARGIN, PROJ, PROMPT, ct_group, oracle,
                               write_compressed, write_gptq_awq)
from test_tensor_parallel import (assert_same_as_one_process, greedy, wait_for_workers_gone,
                                  worker_pids)

pytestmark = pytest.mark.timeout(600)

# test_int4_formats.py's prompt (its oracle has no near-tie early on) and the other
# tensor-parallel tests' two (48 and 33 tokens: prefilled in chunks of 32)
PROMPTS = [PROMPT, *prompts_for()]

# name: (writer, arguments); "marlin-*": the source checkpoint converted to the Marlin format
CASES = {"ct-group-sym": ("ct", True, "group"), "ct-group-asym": ("ct", False, "group"),
         "ct-channel-sym": ("ct", True, "channel"), "ct-channel-asym": ("ct", False, "channel"),
         # zeros, groups of 128
         "marlin-gptq-asym-g128": ("gptq", False, 128),
         # no zeros, one group per row (G = K: a row share keeps its one group, G = its K)
         "marlin-ct-channel-sym": ("ct", True, "channel")}


class Checkpoints:
    """Each case's checkpoint and its dequantized projections, written once per module."""

    def __init__(self, tmp):
        self.tmp, self.built = tmp, {}
        self.float_dir = tiny_checkpoint(os.path.join(tmp, "f32"), "llama", **CHECKPOINT)
        self.bf16_dir = tiny_checkpoint(os.path.join(tmp, "bf16"), "llama", dtype="bfloat16",
                                        **CHECKPOINT)

    def get(self, case: str) -> tuple[str, str, dict]:
        """(checkpoint dir, the float checkpoint it quantizes, {projection: dequantized})."""
        if case not in self.built:
            writer, *args = CASES[case]
            out = os.path.join(self.tmp, case)
            if writer == "ct":
                sym, strategy = args
                qdir, deq = write_compressed(self.bf16_dir, out + "-src",
                                             {"group_0": ct_group(["Linear"], sym, strategy)})
                base = self.bf16_dir
            else:
                qdir, deq = write_gptq_awq(self.float_dir, out + "-src", "gptq", *args)
                base = self.float_dir
            if case.startswith("marlin-"):
                from engine.tools.convert_marlin import convert
                convert(qdir, out)
                qdir = out
            self.built[case] = (qdir, base, deq)
        return self.built[case]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return Checkpoints(str(tmp_path_factory.mktemp("tp_int4")))


# The int4 tensors of a layer (compressed-tensors', Marlin's) whose share is a view of the file;
# weight_shape/marlin_shape are rewritten, and g_idx renumbered (a copy of K int32s).
VIEWS = (".weight_packed", ".weight_scale", ".weight_zero_point", ".marlin_qweight", ".scales",
         ".marlin_zeros")


def rank_weights(qdir: str, rank: int | None, size: int = 2, cuts: list | None = None) -> dict:
    """The converted weights rank `rank` of `size` loads (None: one process's); `cuts` gets
    (name, the file's tensor, the rank's share) of each int4 tensor."""
    from engine.loader.quant_formats import convert_quantized
    from engine.loader.safetensors import load_safetensors
    from engine.models.model_config import ModelConfig
    from engine.parallel.sharding import ShardPlan
    config = ModelConfig.from_pretrained(qdir)
    plan = None if rank is None else ShardPlan(config, rank, size)

    def shard(name, tensor, shapes):
        part = plan.shard(name, tensor, shapes)
        if cuts is not None and name.endswith(VIEWS):
            cuts.append((name, tensor, part))
        return part
    weights = load_safetensors(qdir, quantized=True, progress=False, shard=plan and shard)
    convert_quantized(weights, config.quantization_config)
    return weights


@pytest.mark.parametrize("case", list(CASES))
def test_each_share_is_the_whole_layers_slice(checkpoints, case):
    from engine.models.model_config import ModelConfig
    from engine.parallel.cuts import cut_array
    from engine.parallel.sharding import ShardPlan
    qdir, _, _ = checkpoints.get(case)
    whole = rank_weights(qdir, None)
    config = ModelConfig.from_pretrained(qdir)
    projections = [n for n in whole if PROJ.fullmatch(n)]
    assert len(projections) == 14
    for rank in range(2):
        cuts = []
        share = rank_weights(qdir, rank, cuts=cuts)
        # each rank reads only its share: the cut tensors are views of the mapped file, every
        # layer's codes half of the file's
        assert len(cuts) >= 14 * 2
        for name, stored, part in cuts:
            assert np.shares_memory(part, stored), name
        codes = [(stored, part) for name, stored, part in cuts
                 if name.endswith((".weight_packed", ".marlin_qweight"))]
        assert len(codes) == 14 and all(2 * p.size == s.size for s, p in codes)
        plan = ShardPlan(config, rank, 2)
        for name in projections:
            w = whole[name].dequantize()
            np.testing.assert_array_equal(share[name].dequantize(),
                                          cut_array(w, plan.cut(name, w.shape)),
                                          err_msg=f"{case} rank {rank} {name}")


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_and_pp2_greedy_equal_one_process_and_the_oracle(checkpoints, case):
    qdir, base, deq = checkpoints.get(case)
    before = worker_pids()
    one = greedy(qdir, 1, prompts=PROMPTS)
    tp = greedy(qdir, 2, prompts=PROMPTS)
    assert_same_as_one_process(one, tp, f"{case} tp2")
    assert_same_as_one_process(one, greedy(qdir, 1, prompts=PROMPTS, pipeline_parallel_size=2),
                               f"{case} pp2")
    wait_for_workers_gone(before)
    assert_matches(tp[0][0], hf_greedy(oracle(base, deq), PROMPT, GEN, tie=MARGIN),
                   label=f"{case} tp2")


# ---- errors

def test_compressed_tensors_row_shares_must_be_whole_groups(checkpoints, tmp_path):
    """Groups of 256 along K: down_proj's share of 384 input columns (of 768) is 1.5 groups,
    o_proj's 128 (of 256) half of one."""
    qdir, _ = write_compressed(checkpoints.bf16_dir, tmp_path / "g256",
                               {"group_0": ct_group(["Linear"], True, "group", 256)})
    with pytest.raises(ValueError, match=r"tensor parallel 2: model\.layers\.0\.(mlp\.down_proj|"
                                         r"self_attn\.o_proj)\.weight_(packed|scale|shape): the "
                                         r"rank's input columns \[0, (384|128)\) are not whole "
                                         r"256-element quantization groups"):
        rank_weights(qdir, 0)


def test_other_compressed_tensors_formats_cannot_be_split(tmp_path):
    from engine import LLM
    tiny_checkpoint(str(tmp_path / "m"), arch="llama")
    edit_config(str(tmp_path / "m"), lambda c: {**c, "quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "int-quantized",
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}})
    with pytest.raises(ValueError, match="compressed-tensors config group group_0 is "
                                         "int-quantized; only pack-quantized"):
        LLM(str(tmp_path / "m"), tensor_parallel_size=2)


def marlin_plan(tmp_path, **overrides):
    from engine.models.model_config import ModelConfig
    from engine.parallel.sharding import ShardPlan
    d = tiny_checkpoint(str(tmp_path / "m"), "llama", **overrides)
    edit_config(d, lambda c: {**c, "quantization_config": {"quant_method": "marlin", "bits": 4}})
    return ShardPlan(ModelConfig.from_pretrained(d), 0, 2)


def marlin_tensors(layer: str, n: int, k: int, g: int) -> dict:
    """A Marlin layer's tensors as the file holds them (contents irrelevant to the cut)."""
    np_ = -(-n // 64) * 64
    return {f"{layer}.marlin_qweight": np.zeros((k // 16, np_ * 2), np.uint32),
            f"{layer}.scales": np.zeros((k // g, np_), np.float32),
            f"{layer}.marlin_shape": np.array([n, k, g], np.int64)}


def shard_marlin_mlp(tmp_path, n: int, proj: str, suffix: str):
    """Rank 0's share of 2 of `suffix` of layer 0's Marlin `proj` (an MLP projection) in a
    checkpoint with intermediate_size n (groups of 32)."""
    plan = marlin_plan(tmp_path, intermediate_size=n)
    layer = f"model.layers.0.mlp.{proj}"
    tensors = marlin_tensors(layer, n, plan.config.hidden_size, 32)
    shapes = {name: t.shape for name, t in tensors.items()}
    return plan.shard(f"{layer}.{suffix}", tensors[f"{layer}.{suffix}"], shapes)


def test_marlin_column_shares_must_be_whole_tiles(tmp_path):
    """intermediate_size 704 (11 tiles): gate_proj's share of 352 output rows is 5.5 tiles."""
    with pytest.raises(ValueError, match=r"tensor parallel 2: model\.layers\.0\.mlp\.gate_proj\."
                                         r"marlin_qweight: the rank's output rows \[0, 352\) are "
                                         r"not whole 64-element Marlin n tiles"):
        shard_marlin_mlp(tmp_path, 704, "gate_proj", "marlin_qweight")


def test_marlin_padded_n_is_not_cut(tmp_path):
    """N 480 is stored padded to 512: the padded N's halves are whole tiles, the true N's are
    not, and marlin_shape (which holds N) says so."""
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.marlin_shape: N = 480 "
                                         r"is not whole 64-column Marlin tiles \(stored padded to "
                                         r"512\), so its output rows \[\(0, 240\)\] cannot"):
        shard_marlin_mlp(tmp_path, 480, "up_proj", "marlin_shape")
