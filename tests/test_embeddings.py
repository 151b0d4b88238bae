"""Embeddings equal sentence-transformers' on tiny random checkpoints it wrote itself (1e-4, f32).

One checkpoint per pooling mode, each a different transformer layout: mean + Normalize on a
headless LlamaModel, CLS without Normalize on a headless Qwen2Model (qkv bias), last token +
Normalize on a Qwen3ForCausalLM (lm_head kept, "model." prefixes). Each pooling test first shows
that sentence-transformers' own vectors change when the pooling mode (or the Normalize module) is
switched, so the comparison can fail. The engine runs with small prefill chunks, so most inputs
are pooled across several chunks, batched together.
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as models

from embedding_checkpoints import edit_json, embedding_checkpoint, tokenizer

pytestmark = pytest.mark.timeout(300)

TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "hello",
         "What is the capital of France? The capital of France is Paris. " * 3,
         "Once upon a time there was a little town by the sea.",
         "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024."]

# mode -> (embedding_checkpoint kwargs)
CHECKPOINTS = {
    "mean": dict(pooling="mean", normalize=True, arch="llama"),
    "cls": dict(pooling="cls", normalize=False, arch="qwen2"),
    "lasttoken": dict(pooling="lasttoken", normalize=True, arch="qwen3", causal_lm=True),
}
# Chunks of 8 tokens, 24 per step: most inputs are pooled over several chunks and steps.
CHUNKED = dict(prefill_chunk_size=8, max_num_batched_tokens=24, num_kv_blocks=128)


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedding_ckpts")
    return {mode: embedding_checkpoint(root / mode, **kwargs)
            for mode, kwargs in CHECKPOINTS.items()}


def st_encode(model_dir, texts, pooling=None, normalize=None, **encode_kwargs) -> np.ndarray:
    """sentence-transformers' embeddings; `pooling`/`normalize` swap the checkpoint's modules."""
    st = SentenceTransformer(model_dir, device="cpu")
    if pooling is not None or normalize is not None:
        transformer = st[0]
        pooling = pooling or st[1].pooling_mode
        normalize = normalize if normalize is not None else len(st) > 2
        modules = [transformer, models.Pooling(transformer.get_embedding_dimension(),
                                               pooling_mode=pooling)]
        st = SentenceTransformer(modules=modules + [models.Normalize()] * normalize,
                                 device="cpu")
    return st.encode(texts, convert_to_numpy=True, **encode_kwargs).astype(np.float32)


def taper_embed(model_dir, texts, dimensions=None, **config) -> np.ndarray:
    from engine import LLM
    llm = LLM(model_dir, **{**CHUNKED, **config})
    return np.stack([o.embedding for o in llm.embed(texts, dimensions)])


# ---- the engine (LLM.embed) against sentence-transformers

@pytest.mark.parametrize("mode", list(CHECKPOINTS))
def test_pooling_equals_sentence_transformers(ckpt_dirs, mode):
    model_dir = ckpt_dirs[mode]
    want = st_encode(model_dir, TEXTS)
    # the reference depends on the pooling mode and on Normalize: the test can fail
    for other in CHECKPOINTS:
        if other != mode:
            assert np.abs(st_encode(model_dir, TEXTS, pooling=other) - want).max() > 0.05, other
    normalize = CHECKPOINTS[mode]["normalize"]
    switched = st_encode(model_dir, TEXTS, normalize=not normalize)
    assert np.abs(switched - want).max() > 0.05
    got = taper_embed(model_dir, TEXTS)
    assert got.dtype == np.float32 and got.shape == want.shape == (len(TEXTS), 96)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    norms = np.linalg.norm(got, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5) == normalize


def test_legacy_pooling_config_and_unsupported_modules(ckpt_dirs, tmp_path):
    from engine import LLM
    # sentence-transformers < 6 wrote one boolean per mode
    legacy = shutil.copytree(ckpt_dirs["cls"], tmp_path / "legacy")
    edit_json(legacy / "1_Pooling" / "config.json",
              lambda c: {"word_embedding_dimension": 96, "pooling_mode_cls_token": True,
                         "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
                         "pooling_mode_lasttoken": False})
    np.testing.assert_allclose(taper_embed(str(legacy), TEXTS[:2]),
                               st_encode(ckpt_dirs["cls"], TEXTS[:2]), atol=1e-4, rtol=0)
    # max pooling (and any module Taper does not run) stops the start-up, naming the problem
    unsupported = shutil.copytree(ckpt_dirs["mean"], tmp_path / "max")
    edit_json(unsupported / "1_Pooling" / "config.json", lambda c: {**c, "pooling_mode": "max"})
    with pytest.raises(ValueError, match="pooling mode 'max' is not supported"):
        LLM(str(unsupported))
    dense = shutil.copytree(ckpt_dirs["mean"], tmp_path / "dense")
    edit_json(dense / "modules.json", lambda m: m[:2] + [
        {"idx": 2, "name": "2", "path": "2_Dense",
         "type": "sentence_transformers.models.Dense"}] + m[2:])
    with pytest.raises(ValueError, match=r"module 2 \(Dense\) is not supported"):
        LLM(str(dense))


def test_transformer_in_a_subfolder_and_causal_lm_saved_headless(ckpt_dirs, tmp_path):
    """Old sentence-transformers saves keep the transformer (weights, config, tokenizer) in
    0_Transformer/; and a *ForCausalLM config over headless tensors (no "model." prefix, no
    lm_head), as some embedding models ship, loads as a headless transformer."""
    from engine import LLM
    model_dir = tmp_path / "old_layout"
    shutil.copytree(ckpt_dirs["cls"], model_dir)
    sub = model_dir / "0_Transformer"
    sub.mkdir()
    for name in os.listdir(model_dir):
        if name not in ("modules.json", "1_Pooling", "config_sentence_transformers.json",
                        "0_Transformer", "README.md"):
            shutil.move(str(model_dir / name), str(sub / name))
    edit_json(model_dir / "modules.json",
              lambda m: [{**m[0], "path": "0_Transformer",
                          "type": "sentence_transformers.models.Transformer"}] + m[1:])
    edit_json(sub / "config.json", lambda c: {**c, "architectures": ["Qwen2ForCausalLM"]})
    got = taper_embed(str(model_dir), TEXTS)
    np.testing.assert_allclose(got, st_encode(ckpt_dirs["cls"], TEXTS), atol=1e-4, rtol=0)
    llm = LLM(str(model_dir))
    assert (llm.engine.model_config.architecture, llm.engine.model_config.has_lm_head) == (
        "Qwen2ForCausalLM", False)


def test_headless_checkpoint_cannot_generate(ckpt_dirs):
    from engine import LLM, SamplingParams
    llm = LLM(ckpt_dirs["mean"])
    assert not llm.engine.model_config.has_lm_head
    with pytest.raises(ValueError, match="no lm_head"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))


def test_embeddings_batch_with_generation_and_preemption(ckpt_dirs):
    """Embedding and generation requests share steps; a pool too small for all of them preempts,
    and a recomputed embedding starts its pooling over."""
    from engine import LLM, SamplingParams
    from engine.sampling.pooling import PoolingParams
    model_dir = ckpt_dirs["lasttoken"]
    want = st_encode(model_dir, TEXTS)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = tokenizer().encode(TEXTS[0])
    alone = LLM(model_dir, **CHUNKED).generate([prompt], greedy)[0].token_ids
    llm = LLM(model_dir, block_size=8, num_kv_blocks=10, prefill_chunk_size=8,
              max_num_batched_tokens=32, enable_prefix_caching=False, max_num_seqs=8)
    engine, tok = llm.engine, tokenizer()
    mixed_steps = []
    execute = engine.runner.execute

    def watched(sched, *batch):
        kinds = {seq.pooler is None for seq in sched.seqs}
        mixed_steps.append(kinds == {True, False})
        return execute(sched, *batch)
    engine.runner.execute = watched
    engine.add_request("gen", prompt, greedy)
    for i, text in enumerate(TEXTS):
        engine.add_request(f"emb{i}", tok.encode(text), PoolingParams())
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert any(mixed_steps)
    assert engine.scheduler.num_preemptions > 0
    assert outs["gen"].token_ids == alone
    got = np.stack([outs[f"emb{i}"].embedding for i in range(len(TEXTS))])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_prefix_cache_hits_do_not_skip_pooled_tokens(ckpt_dirs):
    """Mean pooling reads every token, so its requests skip the prefix-cache lookup; last-token
    pooling reads only the last one, which the cache never covers, so it may hit."""
    from engine import LLM
    long_text = TEXTS[2]
    for mode, may_hit in (("mean", False), ("lasttoken", True)):
        model_dir = ckpt_dirs[mode]
        want = st_encode(model_dir, [long_text])[0]
        llm = LLM(model_dir, block_size=8, num_kv_blocks=64)
        first = llm.embed(long_text)[0]
        hits = llm.engine.block_pool.prefix_cache_hits
        second = llm.embed(long_text)[0]
        assert (llm.engine.block_pool.prefix_cache_hits > hits) == may_hit, mode
        for out in (first, second):
            np.testing.assert_allclose(out.embedding, want, atol=1e-4, rtol=0)


def test_matryoshka_dimensions(ckpt_dirs, tmp_path):
    from engine import LLM
    model_dir = shutil.copytree(ckpt_dirs["mean"], tmp_path / "matryoshka")
    edit_json(model_dir / "config.json", lambda c: {**c, "matryoshka_dimensions": [32, 64]})
    want = st_encode(str(model_dir), TEXTS, truncate_dim=32, normalize_embeddings=True)
    full = st_encode(str(model_dir), TEXTS)
    assert np.abs(full[:, :32] - want).max() > 0.01      # re-normalizing after truncation shows
    got = taper_embed(str(model_dir), TEXTS, dimensions=32)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"dimensions in \[32, 64\]"):
        LLM(str(model_dir)).embed(TEXTS[0], dimensions=40)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        LLM(ckpt_dirs["mean"]).embed(TEXTS[0], dimensions=32)
