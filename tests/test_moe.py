"""The MoE block (pyx/moe.py) against transformers' own Mixtral, Qwen2-MoE and Qwen3-MoE blocks,
with the weights as save_pretrained writes them; each quirk (renormalised top-k, the shared
expert and its gate) shown to change transformers' output, so the comparison can fail."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pyx.cpu_backend import CpuBackend  # noqa: E402
from pyx.layers import MLP, Workspace  # noqa: E402
from pyx.moe import MoE, _top_k_by_argmax, route  # noqa: E402

H, E, K, T = 32, 8, 2, 11


def tiny(arch: str, **overrides):
    common = dict(vocab_size=64, hidden_size=H, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=K)
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=E, **common, **overrides)
        model = transformers.MixtralForCausalLM(cfg)
    elif arch == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(num_experts=E, moe_intermediate_size=24,
                                          shared_expert_intermediate_size=40, **common,
                                          **overrides)
        model = transformers.Qwen2MoeForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(num_experts=E, moe_intermediate_size=24, **common,
                                          **overrides)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def saved_weights(model, tmp_path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    model.save_pretrained(tmp_path)
    return load_file(str(tmp_path / "model.safetensors"))


def our_block(arch: str, model, w: dict, backend, fused: bool = False) -> MoE:
    if arch == "mixtral":
        p = "model.layers.0.block_sparse_moe."
        names = ("w1", "w3", "w2")
    else:
        p = "model.layers.0.mlp."
        names = ("gate_proj", "up_proj", "down_proj")
    gate, up, down = names
    gate_up = [np.concatenate([w[f"{p}experts.{e}.{gate}.weight"], w[f"{p}experts.{e}.{up}.weight"]])
               for e in range(E)]
    downs = [np.ascontiguousarray(w[f"{p}experts.{e}.{down}.weight"]) for e in range(E)]
    cfg = model.config
    shared = shared_gate = None
    if arch == "qwen2_moe":
        s = f"{p}shared_expert."
        shared = MLP(backend, np.concatenate([w[f"{s}gate_proj.weight"], w[f"{s}up_proj.weight"]]),
                     None, np.ascontiguousarray(w[f"{s}down_proj.weight"]), None)
        shared_gate = np.ascontiguousarray(w[f"{p}shared_expert_gate.weight"])
    normalize = arch == "mixtral" or bool(getattr(cfg, "norm_topk_prob", False))
    return MoE(backend, np.ascontiguousarray(w[f"{p}gate.weight"]), gate_up, downs, K, normalize,
               shared, shared_gate, fused=fused)


def torch_block(arch: str, model):
    layer = model.model.layers[0]
    return layer.mlp   # transformers 5 names Mixtral's block mlp too (saved as block_sparse_moe)


def torch_out(block, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = block(torch.from_numpy(x)[None])
    out = out[0] if isinstance(out, tuple) else out
    return out[0].numpy()


CASES = [("mixtral", {}), ("qwen2_moe", {"norm_topk_prob": False}),
         ("qwen2_moe", {"norm_topk_prob": True}), ("qwen3_moe", {"norm_topk_prob": True}),
         ("qwen3_moe", {"norm_topk_prob": False})]


@pytest.mark.parametrize("arch, overrides", CASES)
def test_block_equals_transformers(arch, overrides, tmp_path):
    model = tiny(arch, **overrides)
    backend = CpuBackend()
    block = our_block(arch, model, saved_weights(model, tmp_path), backend)
    x = np.random.default_rng(1).normal(0, 1, (T, H)).astype(np.float32)
    out = np.empty((T, H), np.float32)
    block.forward(x, out, Workspace(np))
    np.testing.assert_allclose(out, torch_out(torch_block(arch, model), x), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch, quirk", [("qwen3_moe", "norm_topk_prob"),
                                         ("qwen2_moe", "shared_expert")])
def test_each_quirk_changes_transformers_output(arch, quirk, tmp_path):
    """So the block test can fail: transformers' own output moves when the quirk is off."""
    x = np.random.default_rng(1).normal(0, 1, (T, H)).astype(np.float32)
    if quirk == "norm_topk_prob":
        on = torch_out(torch_block(arch, tiny(arch, norm_topk_prob=True)), x)
        off = torch_out(torch_block(arch, tiny(arch, norm_topk_prob=False)), x)
    else:
        block = torch_block(arch, tiny(arch))
        on = torch_out(block, x)
        with torch.no_grad():
            block.shared_expert_gate.weight.fill_(-1e4)    # sigmoid gate closed
        off = torch_out(block, x)
    assert np.abs(on - off).max() > 1e-2


def test_routing_picks_the_top_k_by_probability():
    logits = np.array([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.0]], np.float32)
    ids, w = route(logits, 2, normalize=False)
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    for row in range(2):
        order = np.argsort(-p[row])[:2]
        assert sorted(ids[row]) == sorted(order)
        np.testing.assert_allclose(sorted(w[row]), sorted(p[row, order]), rtol=1e-6)
    _, wn = route(logits, 2, normalize=True)
    np.testing.assert_allclose(wn.sum(1), 1.0, rtol=1e-6)


def test_experts_run_only_on_their_tokens():
    """A decode step (one token) computes top_k experts, not all of them (the loop over experts
    that a backend without moe_experts runs; tests/test_moe_experts.py checks the CPU's kernel)."""
    backend = CpuBackend()
    rng = np.random.default_rng(0)
    calls = []

    class Counting:
        moe_experts_op = False

        def __init__(self, inner):
            self.inner, self.xp = inner, np

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def linear(self, x, weight, bias, out):
            calls.append(x.shape[0])
            self.inner.linear(x, weight, bias, out)
    I = 16
    block = MoE(Counting(backend), rng.normal(size=(E, H)).astype(np.float32),
                [rng.normal(size=(2 * I, H)).astype(np.float32) for _ in range(E)],
                [rng.normal(size=(H, I)).astype(np.float32) for _ in range(E)], K, True)
    out = np.empty((1, H), np.float32)
    block.forward(rng.normal(size=(1, H)).astype(np.float32), out, Workspace(np))
    assert len(calls) == 1 + 2 * K and all(n == 1 for n in calls)


def test_numpy_top_k_equals_the_argmax_passes():
    """The NumPy top-k (one stable sort) picks the ids the graph-safe argmax passes pick, in
    their order, ties included (rows of few distinct values tie often)."""
    rng = np.random.default_rng(5)
    for trial in range(50):
        scores = (rng.integers(0, 4, (9, 64)) if trial % 2 else rng.standard_normal((9, 64)))
        scores = scores.astype(np.float32)
        ids = np.empty((9, 6), np.int64)
        left = scores.copy()
        for j in range(6):
            ids[:, j] = left.argmax(axis=1)
            left[np.arange(9), ids[:, j]] = -np.inf
        got = _top_k_by_argmax(scores.copy(), 6, np)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, ids)
