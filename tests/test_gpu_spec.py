"""bench/gpu_spec.py (issue 30's GPU figures) checked on the CPU before a GPU window runs it: the
counting weights make the greedy output they promise (the target counts, the draft agrees on the
chosen fraction of ids), every row runs through the CUDA engine's wiring (tests/
test_cuda_engine_wiring.py's CpuAsCuda: decode and verify graphs captured and replayed) with
greedy tokens equal to the count, graphs_verify=on replays verify graphs and off does not, and
bench/gpu_summary.py's spec table reads the rows."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bench import gpu_spec, gpu_summary
from engine.models.llama import expected_shapes
from engine.models.model_config import ModelConfig
from test_cuda_engine_wiring import CpuAsCuda

pytestmark = pytest.mark.timeout(300)


def greedy_next(weights: dict) -> np.ndarray:
    """The next token after each id t when the layers add nothing: argmax of lm_head . rms(e_t)
    (the norm weights are 1; a positive scale per row changes no argmax)."""
    e = weights["model.embed_tokens.weight"].astype(np.float64)
    x = e / np.sqrt((e * e).mean(axis=1, keepdims=True))
    return np.argmax(x @ weights["lm_head.weight"].astype(np.float64).T, axis=1)


def test_counting_weights_count_and_the_draft_agrees_where_chosen():
    config = ModelConfig.from_dict(dict(gpu_spec.TINY_TARGET))
    V = config.vocab_size
    target = gpu_spec.counting_weights(np, config, expected_shapes, 1, np.float32)
    assert np.array_equal(greedy_next(target), (np.arange(V) + 1) % V)
    # the layers add nothing to the residual stream
    assert not target["model.layers.0.self_attn.o_proj.weight"].any()
    assert not target["model.layers.2.mlp.down_proj.weight"].any()
    draft = gpu_spec.counting_weights(np, config, expected_shapes, 2, np.float32, 0.7)
    agrees = greedy_next(draft) == (np.arange(V) + 1) % V
    assert 0.65 < agrees.mean() < 0.75
    with pytest.raises(ValueError, match="untied lm_head"):
        gpu_spec.counting_weights(np, ModelConfig.from_dict(
            {**gpu_spec.TINY_TARGET, "tie_word_embeddings": True}), expected_shapes, 1,
            np.float32)


def test_prompts_quote_the_count_with_edits():
    rng = np.random.default_rng(0)
    prompts, starts = gpu_spec.counting_prompts(rng, 2048, 4, 200, 0.1)
    for p, s in zip(prompts, starts):
        run = np.asarray(p[:-2])
        count = (s - 2 + np.arange(200)) % 2048
        assert p[-2:] == [(s - 2) % 2048, (s - 1) % 2048]      # the run's first two ids again
        assert list(run[:2]) == list(count[:2])
        assert 0.03 < np.mean(run != count) < 0.2             # edited in about 10 % of places


@pytest.fixture(scope="module")
def rows():
    """Every row on the CPU through the CUDA path (graphs captured and replayed), tiny shapes.
    Drafts are free in the cost model, so that acceptance alone sets how many are proposed."""
    from engine.spec.costs import StepCost
    mp = pytest.MonkeyPatch()
    mp.setattr(StepCost, "min_use", lambda self, rows: 0.0)
    try:
        return gpu_spec.run(lambda setting: CpuAsCuda(kernels=f"graphs_verify={setting}"),
                            "cuda", batches=(1, 4), graphs_verify=("off", "on"), k=3,
                            gen_len=40, draft_agreement=0.7, edit_rate=0.05,
                            target_dict=gpu_spec.TINY_TARGET, draft_dict=gpu_spec.TINY_DRAFT)
    finally:
        mp.undo()


def test_every_row_runs_and_keeps_the_greedy_tokens(rows):
    assert [(r["method"], r["graphs_verify"], r["batch"]) for r in rows] == [
        ("none", "off", 1), ("none", "off", 4),
        ("ngram", "off", 1), ("ngram", "off", 4), ("draft_model", "off", 1),
        ("draft_model", "off", 4),
        ("ngram", "on", 1), ("ngram", "on", 4), ("draft_model", "on", 1),
        ("draft_model", "on", 4)]
    for r in rows:
        assert r["tokens"] == 40 * r["batch"]
        assert r["expected_tokens"] == r["tokens"], r
        assert r["decode_tok_s"] > 0 and r["bound_tok_s"] > 0
        if r["method"] != "none":
            assert r["vs_none"] > 0
    for r in rows:
        if r["method"] == "ngram":      # the output quotes the prompt but for its edits
            assert r["acceptance"] > 0.6 and r["tokens_per_verify"] > 2.5, r
        if r["method"] == "draft_model":
            # each draft accepted with probability 0.7 until the first rejection: with 3 drafts
            # (1 - 0.7^4) / 0.3 = 2.53 tokens a verify step (seeded: the same figures each run)
            assert 1.9 < r["tokens_per_verify"] < 3.2, r
            assert r["draft_forwards"] > r["decode_steps"]     # k drafts + the mirror a step


def test_verify_graphs_replay_only_under_graphs_verify_on(rows):
    for r in rows:
        replays = r["graph_replays"]
        assert replays.get("1", 0) > 0 or r["method"] != "none"
        if r["method"] == "none" or r["graphs_verify"] == "off":
            assert replays.get(str(r["k"] + 1), 0) == 0, r
        elif r["batch"] == 1:
            # a full k of drafts, every verify row sampled: the verify graph's shape
            assert replays.get(str(r["k"] + 1), 0) > 0, r


def test_the_summary_table_reads_the_rows(rows, tmp_path):
    (tmp_path / "spec.json").write_text(json.dumps({"rows": rows}))
    lines = gpu_summary.spec(str(tmp_path))
    table = [line for line in lines if line.startswith("| ")]
    assert len(table) == 1 + len(rows)
    ngram_on = next(line for line in table if line.startswith("| 1 | ngram k=3 | on |"))
    assert ngram_on.endswith("| 40/40 |")
    assert not lines[-1].startswith("FAILED")
    # a row whose greedy tokens were not the count is named, and fails the summary
    bad = [dict(r) for r in rows]
    bad[3]["expected_tokens"] -= 1
    (tmp_path / "spec.json").write_text(json.dumps({"rows": bad}))
    assert gpu_summary.main(["spec", str(tmp_path)]) == 1
    assert gpu_summary.spec(str(tmp_path))[-1] == (
        "FAILED: greedy tokens not the expected count in B=4 ngram graphs_verify off")
    # an engine that failed on the device: its error in the table, named in the last line
    bad.append({**{k: rows[0][k] for k in ("device", "k", "gen_len", "draft_agreement")},
                "method": "draft_model", "graphs_verify": "on", "batch": None,
                "error": "CudaError: an illegal memory access"})
    (tmp_path / "spec.json").write_text(json.dumps({"rows": bad}))
    lines = gpu_summary.spec(str(tmp_path))
    assert "| - | draft_model k=3 | on | FAILED: CudaError: an illegal memory access |" in (
        "\n".join(lines))
    assert lines[-1].endswith("; no figures from draft_model graphs_verify on")
    # a step stopped before its first row
    (tmp_path / "spec.json").write_text(json.dumps({"rows": []}))
    assert gpu_summary.main(["spec", str(tmp_path)]) == 1


def test_the_cli_runs_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert gpu_spec.main(["--backend", "cpu", "--tiny", "--batch", "1", "--gen-len", "12",
                          "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["none", "ngram", "draft_model"]
    assert all(r["graph_replays"] is None for r in rows)
    assert "B=1 ngram k=4" in capsys.readouterr().out


def test_a_failing_method_leaves_the_others_figures(tmp_path, monkeypatch, capsys):
    """An engine that fails on the device (the draft model's, here) gives an error row and the
    exit status 1; the rows of the other methods are still measured and written."""
    from engine.spec.draft_model import DraftModel

    def broken(self, *args, **kwargs):
        raise RuntimeError("the draft's forward failed")
    monkeypatch.setattr(DraftModel, "propose", broken)
    out = tmp_path / "spec.json"
    assert gpu_spec.main(["--backend", "cpu", "--tiny", "--batch", "1", "--gen-len", "12",
                          "--json", str(out)]) == 1
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], "error" in r) for r in rows] == [
        ("none", False), ("ngram", False), ("draft_model", True)]
    assert rows[2]["error"].endswith("the draft's forward failed")
    assert rows[1]["expected_tokens"] == rows[1]["tokens"] == 12
    assert "FAILED: draft_model graphs_verify off" in capsys.readouterr().out


def test_a_draft_built_by_the_caller_is_checked():
    """LLMEngine(loaded=(backend, model, config, (draft, draft config))): the draft of method
    draft_model only, of the target's vocabulary (there is no tokenizer to compare)."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.models.llama import LlamaForCausalLM
    from pyx.cpu_backend import CpuBackend

    backend = CpuBackend()

    def model(shape: dict):
        config = ModelConfig.from_dict(dict(shape))
        weights = gpu_spec.counting_weights(np, config, expected_shapes, 1, np.float32)
        return LlamaForCausalLM(config, weights, backend), config

    target, draft = model(gpu_spec.TINY_TARGET), model(gpu_spec.TINY_DRAFT)

    def engine(spec, given):
        config = EngineConfig(model="t", backend="cpu", num_kv_blocks=16, max_model_len=64,
                              speculative_config=spec)
        return LLMEngine(config, loaded=(backend, *target, given))

    with pytest.raises(ValueError, match="a draft model was given, but the speculative "
                                         "config's method is not draft_model"):
        engine({"method": "ngram", "num_speculative_tokens": 2}, draft)
    spec = {"method": "draft_model", "model": "given", "num_speculative_tokens": 2}
    other = model({**gpu_spec.TINY_DRAFT, "vocab_size": 1024})
    with pytest.raises(ValueError, match="vocabulary of 1024 ids, the target's has 2048"):
        engine(spec, other)
    assert engine(spec, draft).speculator.draft_model.model is draft[0]
