"""Pipeline parallel for the DeepSeek families (issue 28: DeepSeek-V2/V3 and GLM-4.7-Flash with
multi-head latent attention, GLM-4.5's Glm4MoeForCausalLM with DeepSeekMoE behind Llama's
attention): each stage builds its layers renumbered from 0 with the per-layer MoE plan sliced to
them (a dense first layer on stage 0, MoE on stage 1), its own latent KV caches, and none of the
multi-token-prediction layers stored past the decoder's.

- Greedy tokens at pipeline parallel 2 equal transformers' (up to a near-tie) and the single
  process's, logprobs within float tolerance: V2-Lite-, V3- and GLM-4.7-Flash-shaped tiny
  checkpoints and GLM-4.5's; V3 at 2 stages x 2 tensor-parallel ranks (4 processes); llama.cpp's
  q8_0 deepseek2 GGUF.
- A stage's model: its layers (dense or MoE as the whole model's), one latent cache per layer,
  the MTP layer taken by no stage; MTP speculation with pipeline parallel refused by name.
- A deepseek2 GGUF's kv_b_proj (engine/loader/gguf_deepseek.py's KvB): a tensor-parallel rank
  dequantizes only its heads' slices of attn_k_b / attn_v_b, a stage only its layers' (the
  bytes counted), and builds the whole kv_b_proj's rows of them; an older file's unsplit
  attn_kv_b is read by its rank's rows alike, and 2 ranks give one process's tokens.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from model_cases import Cases
from test_pipeline_parallel import greedy
from test_tensor_parallel import assert_same_as_one_process, check_split

pytestmark = pytest.mark.timeout(300)

DATA = os.path.join(os.path.dirname(__file__), "data", "gguf")
V3 = os.path.join(DATA, "deepseek_v3-q8_0.gguf")
KV_B = ("attn_k_b.weight", "attn_v_b.weight", "attn_kv_b.weight")
CASES = {"deepseek_v2_lite": (dict(arch="deepseek_v2_lite"), None),
         "deepseek_v3": (dict(arch="deepseek_v3"), None),
         "glm4_moe_lite": (dict(arch="glm4_moe_lite"), None),
         "glm4_moe": (dict(arch="glm4_moe"), None)}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(str(tmp_path_factory.mktemp("pp_mla")), CASES)


def stage_layers(model):
    """Rank 0's stage: its layers, each 'moe' or 'dense'."""
    return ["moe" if hasattr(layer.mlp, "num_experts") else "dense" for layer in model.layers]


@pytest.mark.parametrize("name,pp,tp,ep", [("deepseek_v2_lite", 2, 1, False),
                                           ("deepseek_v3", 2, 1, False),
                                           ("glm4_moe_lite", 2, 1, False),
                                           ("glm4_moe", 2, 1, False),
                                           ("deepseek_v3", 2, 2, False),
                                           ("glm4_moe_lite", 2, 2, True)])
def test_greedy_tokens_match_hf_and_one_process(cases, name, pp, tp, ep):
    """(ep: the second stage's experts split across its 2 ranks, 4 each.)"""
    rank0 = check_split(cases, name, f"pp{pp} tp{tp}{' ep' if ep else ''}", tp=tp,
                        pipeline_parallel_size=pp, inspect=stage_layers,
                        enable_expert_parallel=ep)
    assert rank0 == ["dense"]           # stage 0 of 2: layer 0, the dense one


@pytest.mark.parametrize("tp", [1, 2])
def test_gguf_stages(tp):
    """llama.cpp's q8_0 deepseek2 file (tests/test_gguf_mla.py): each stage its blk.N tensors,
    its heads' slices of attn_k_b / attn_v_b joined into its layers' kv_b_proj. Exact
    activations (act_split=on), as tests/test_tensor_parallel_mla.py says why."""
    kwargs = dict(weight_file=V3, kernels="act_split=on")
    assert_same_as_one_process(greedy(DATA, **kwargs), greedy(DATA, 2, tp, **kwargs),
                               f"deepseek_v3-q8_0 pp2 tp{tp}")


def test_each_stage_builds_its_layers_and_caches_and_no_mtp_layer(tmp_path):
    """A V3 checkpoint with an MTP layer (model.layers.2 of a 2-layer decoder): stage 0 holds
    layer 0 (dense) and the embedding, stage 1 layer 1 (MoE, renumbered 0), the norm and the LM
    head; neither takes layer 2 as a layer or keeps its tensors; each makes one latent cache
    (kv_lora_rank + qk_rope_head_dim = 48 values a token) per layer it holds."""
    from mtp_heads import mtp_checkpoint
    from engine.loader.model_loader import load_model
    from engine.parallel.communicator import SingleProcess
    from pyx.cpu_backend import CpuBackend
    d = mtp_checkpoint(str(tmp_path / "v3"))
    backend = CpuBackend(num_threads=1)
    kinds = []
    for stage in range(2):
        model, config = load_model(d, backend, progress=False,
                                   pipeline=(stage, 2, 0, SingleProcess()))
        assert config.num_hidden_layers == 2 and len(model.layers) == 1
        assert model.mtp_weights == {}
        assert (model.embed_tokens is not None) == (stage == 0)
        assert (model.lm_head is not None) == (stage == 1)
        ((k, v),) = model.new_kv_caches(4, 16, np.float32)
        assert k is v and k.shape == (4, 16, 1, 48)
        kinds += stage_layers(model)
    assert kinds == ["dense", "moe"]
    whole, _ = load_model(d, backend, progress=False)
    assert len(whole.layers) == 2 and whole.mtp_weights      # (kept for MTP speculation)


def test_mtp_speculation_is_refused_by_name():
    from engine.config import EngineConfig
    from engine.parallel.launch import check_supported
    from engine.spec.config import SpeculativeConfig
    config = EngineConfig(model="x", pipeline_parallel_size=2,
                          speculative_config=SpeculativeConfig(method="mtp",
                                                               num_speculative_tokens=1))
    with pytest.raises(ValueError, match="pipeline parallel: speculative decoding with an MTP "
                                         "head is not yet supported"):
        check_supported(config)


# ---- a GGUF's kv_b_proj: each rank reads only its heads' and its layers' rows

def kv_b_bytes_read(monkeypatch, path=V3, **split):
    """(bytes of attn_k_b / attn_v_b (or attn_kv_b) the load dequantized, each layer's
    kv_b_proj as built, the file's bytes of them) for GGUF `path` loaded as `split` says."""
    from gguf import GGUFReader
    from engine.loader import gguf_deepseek
    from engine.loader.model_loader import load_gguf_model
    from engine.models import deepseek
    from pyx.cpu_backend import CpuBackend
    read = []
    real = gguf_deepseek.quants.dequantize

    def dequantize(data, qtype):
        read.append(data.nbytes)
        return real(data, qtype)

    monkeypatch.setattr(gguf_deepseek.quants, "dequantize", dequantize)
    built = []
    real_split = deepseek.split_kv_b

    def split_kv_b(kv_b, *args):
        built.append(np.array(kv_b))
        return real_split(kv_b, *args)

    monkeypatch.setattr(deepseek, "split_kv_b", split_kv_b)
    load_gguf_model(path, CpuBackend(num_threads=1), progress=False, **split)
    whole = sum(t.n_bytes for t in GGUFReader(path).tensors if t.name.endswith(KV_B))
    return sum(read), built, whole


def unsplit_kv_b_file(path: str) -> str:
    """deepseek_v3-q8_0 as an older converter wrote it: each layer's attn_k_b / attn_v_b
    joined into one q8_0 attn_kv_b (Hq * (N + V), L) (the rest as it is)."""
    from gguf import GGMLQuantizationType as Q, quants
    from gguf_fixtures import HERE, load_script
    from engine.loader.gguf import read_gguf
    joined = read_gguf(V3, progress=False).weights

    def joined_kv_b(t):
        if t.name.endswith("attn_v_b.weight"):
            return None
        if t.name.endswith("attn_k_b.weight"):
            layer = t.name.split(".")[1]
            kv_b = joined[f"model.layers.{layer}.self_attn.kv_b_proj.weight"]
            return quants.quantize(kv_b, Q.Q8_0), Q.Q8_0, f"blk.{layer}.attn_kv_b.weight"
        return t.data, t.tensor_type
    maker = load_script(os.path.join(HERE, "data", "make_gguf_fixtures.py"))
    return maker.copy_gguf(V3, path, joined_kv_b)[0]


def test_a_gguf_rank_reads_only_its_heads_of_kv_b(monkeypatch):
    """Tensor parallel 2: rank r dequantizes heads [2r, 2r + 2) of 4 of each layer's attn_k_b /
    attn_v_b (half the bytes) and builds kv_b_proj from exactly the whole one's rows of those
    heads; a pipeline stage of 2 reads its layer's (half), both together a quarter."""
    from engine.parallel.communicator import SingleProcess
    from engine.parallel.cuts import cut_array
    from engine.parallel.sharding import ShardPlan
    from engine.models.model_config import ModelConfig
    from engine.loader.gguf import read_gguf
    n, whole_kv_b, total = kv_b_bytes_read(monkeypatch)
    assert n == total and len(whole_kv_b) == 2
    config = ModelConfig.from_dict(read_gguf(os.path.join(DATA, "deepseek_v3-q8_0.gguf"),
                                             progress=False).config)
    for r in range(2):
        n, kv_b, _ = kv_b_bytes_read(monkeypatch, tensor_parallel=(r, 2, SingleProcess()))
        assert n == total // 2
        name = "model.layers.0.self_attn.kv_b_proj.weight"
        cut = ShardPlan(config, r, 2).cut(name, whole_kv_b[0].shape)
        for mine, whole in zip(kv_b, whole_kv_b):
            np.testing.assert_array_equal(mine, cut_array(whole, cut))
    n, kv_b, _ = kv_b_bytes_read(monkeypatch, pipeline=(1, 2, 0, SingleProcess()))
    assert n == total // 2 and len(kv_b) == 1
    np.testing.assert_array_equal(kv_b[0], whole_kv_b[1])
    n, _, _ = kv_b_bytes_read(monkeypatch, tensor_parallel=(1, 2, SingleProcess()),
                              pipeline=(0, 2, 1, SingleProcess()))
    assert n == total // 4


def test_an_unsplit_attn_kv_b_is_read_by_rows(monkeypatch, tmp_path):
    """An older file's unsplit attn_kv_b: a rank of 2 dequantizes half its rows (whole heads)
    and builds the whole one's rows of them; 2 ranks give one process's tokens."""
    from engine.parallel.communicator import SingleProcess
    from engine.parallel.cuts import Cut, cut_array
    path = unsplit_kv_b_file(str(tmp_path / "unsplit.gguf"))
    n, whole_kv_b, total = kv_b_bytes_read(monkeypatch, path)
    assert n == total and whole_kv_b[0].shape == (256, 64)
    for r in range(2):
        n, kv_b, _ = kv_b_bytes_read(monkeypatch, path, tensor_parallel=(r, 2, SingleProcess()))
        assert n == total // 2
        for mine, whole in zip(kv_b, whole_kv_b):
            np.testing.assert_array_equal(mine, cut_array(whole, Cut(0, ((128 * r,
                                                                          128 * r + 128),))))
    monkeypatch.undo()
    kwargs = dict(weight_file=path, kernels="act_split=on")
    assert_same_as_one_process(greedy(str(tmp_path), **kwargs),
                               greedy(str(tmp_path), 1, 2, **kwargs), "attn_kv_b tp2")
