"""engine/sampling/sampler.py: penalties and filters against hand-computed logits, seeded Gumbel-max.

Runs with a NumPy backend written here from the op table's spec (Philox4x32-10, checked against
Random123's known answers; per-entry penalties; filters by full sorts) and, once built, with the
real CpuBackend. The merged penalty entries the sampler builds are checked bit for bit against a
sequential reference written here (logit_bias, min_tokens mask, repetition, presence/frequency).
"""
from collections import Counter

import numpy as np
import pytest

from engine.sampling.sampler import Sampler, apply_filters, apply_penalties, penalty_entries
from engine.sampling.sampling_params import SamplingParams
from engine.core.sequence import Sequence

NEG_INF = -np.inf


# ---- NumPy backend (argmax, gumbel_sample) from pyx/backend.pyx's docstrings

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK, _S32 = np.uint64(0xFFFFFFFF), np.uint64(32)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    c0, c1, c2, c3, k0, k1 = (np.asarray(a, dtype=np.uint64) & _MASK
                              for a in (c0, c1, c2, c3, k0, k1))
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = (p1 >> _S32) ^ c1 ^ k0, p1 & _MASK, (p0 >> _S32) ^ c3 ^ k1, p0 & _MASK
    return c0, c1, c2, c3


def test_philox_known_answers():
    # Random123's kat_vectors for philox4x32_10.
    assert [int(x) for x in philox4x32_10(0, 0, 0, 0, 0, 0)] == \
        [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
    f = 0xFFFFFFFF
    assert [int(x) for x in philox4x32_10(f, f, f, f, f, f)] == \
        [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
    assert [int(x) for x in philox4x32_10(0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344,
                                          0xa4093822, 0x299f31d0)] == \
        [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]


class NumpyBackend:
    name = "numpy"
    xp = np
    act_dtype = np.float32
    fused_sampling = False

    def asarray(self, a):
        return np.asarray(a)

    def to_host(self, a):
        return np.asarray(a)

    def apply_penalties(self, logits, rows, cols, bias, rep, pres_freq):
        assert logits.dtype == np.float32 and rows.dtype == cols.dtype == np.int32
        assert bias.dtype == rep.dtype == pres_freq.dtype == np.float32
        assert len(set(zip(rows.tolist(), cols.tolist()))) == len(rows)   # distinct entries
        for r, c, b, p, f in zip(rows, cols, bias, rep, pres_freq):
            x = logits[r, c] + b
            if p != 1:
                x = x / p if x > 0 else x * p
            logits[r, c] = x - f

    def filter_logits(self, logits, temperature, top_k, top_p, min_p):
        assert logits.dtype == np.float32 and top_k.dtype == np.int32
        assert temperature.dtype == top_p.dtype == min_p.dtype == np.float32
        V = logits.shape[1]
        for b, x in enumerate(logits):
            if temperature[b] != 1:
                x /= max(temperature[b], np.float32(1e-5))
            thr = -np.inf
            if 0 < top_k[b] < V:
                thr = np.sort(x)[::-1][top_k[b] - 1]
            if top_p[b] < 1:
                kept = np.sort(x[x >= thr])[::-1].astype(np.float64)
                cum = np.cumsum(np.exp(kept - kept[0]))
                n = int(np.searchsorted(cum, float(top_p[b]) * cum[-1]))
                thr = max(thr, kept[min(n, len(kept) - 1)])
            if min_p[b] > 0:
                thr = max(thr, float(x.max()) + np.log(float(min_p[b])))
            x[x < thr] = -np.inf

    def argmax(self, logits, out):
        out[:] = np.argmax(logits, axis=1)

    def gumbel_sample(self, logits, seeds, positions, out):
        assert logits.dtype == np.float32 and logits.flags.c_contiguous
        assert seeds.dtype == np.uint64 and positions.dtype == np.int64 and out.dtype == np.int64
        V = logits.shape[1]
        v = np.arange(V, dtype=np.uint64)
        for b in range(logits.shape[0]):
            pos, seed = int(positions[b]), int(seeds[b])
            x0, _, _, _ = philox4x32_10(v, pos & 0xFFFFFFFF, pos >> 32, 0,
                                        seed & 0xFFFFFFFF, seed >> 32)
            u = (x0.astype(np.float64) + 0.5) / 2.0**32
            out[b] = np.argmax(logits[b] + -np.log(-np.log(u)))


def _backends():
    yield pytest.param(NumpyBackend(), id="numpy")
    try:
        from pyx.cpu_backend import CpuBackend
    except ImportError:
        yield pytest.param(None, id="cpu", marks=pytest.mark.skip(
            reason="could not import pyx.cpu_backend: the CPU extensions are not built "
                   "(pip install -e .)"))
    else:
        yield pytest.param(CpuBackend(), id="cpu")


@pytest.fixture(params=list(_backends()))
def backend(request):
    return request.param


def seq(prompt=(0,), output=(), **params):
    s = Sequence(list(prompt), SamplingParams(**params))
    for t in output:
        s.append_token(t)
    return s


# ---- greedy

def test_greedy_is_argmax(backend):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 300)).astype(np.float32)
    seqs = [seq(temperature=0.0), seq(temperature=0.0, seed=3), seq(top_k=1),
            seq(temperature=1e-6), seq(temperature=0.0), seq(top_k=1, temperature=2.0)]
    out = Sampler(backend).sample(logits, seqs, {1})
    assert out.dtype == np.int64 and out.shape == (6,)
    np.testing.assert_array_equal(out, logits.argmax(axis=1))


# ---- penalties, each against hand-computed logits

BASE = np.array([2.0, -1.0, 0.5, -3.0, 1.0, 0.0], dtype=np.float32)


def penalised(s, eos=frozenset({5})):
    logits = BASE[None].copy()
    out = apply_penalties(logits, [s], set(eos))
    np.testing.assert_array_equal(logits[0], BASE)   # the input is never modified
    return out[0]


def test_no_penalties_returns_input():
    logits = BASE[None].copy()
    assert apply_penalties(logits, [seq(output=[1, 2])], {5}) is logits


def test_repetition_penalty_covers_prompt_and_output():
    s = seq(prompt=[0, 1], output=[1, 2, 2], repetition_penalty=2.0)
    # seen {0, 1, 2}: positive / 2, negative * 2; 3, 4, 5 unchanged
    np.testing.assert_array_equal(penalised(s), [1.0, -2.0, 0.25, -3.0, 1.0, 0.0])


def test_presence_and_frequency_count_output_only():
    s = seq(prompt=[0, 4], output=[1, 2, 2], presence_penalty=0.5, frequency_penalty=0.25)
    # token 1: count 1 -> -(0.5 + 0.25); token 2: count 2 -> -(0.5 + 0.5); prompt tokens untouched
    np.testing.assert_allclose(penalised(s), [2.0, -1.75, -0.5, -3.0, 1.0, 0.0], rtol=0, atol=1e-6)
    s = seq(prompt=[0, 4], output=[1, 2, 2], presence_penalty=-1.0)
    np.testing.assert_array_equal(penalised(s), [2.0, 0.0, 1.5, -3.0, 1.0, 0.0])


def test_logit_bias():
    s = seq(logit_bias={3: 5.0, 0: -1.5, 99: 1.0})   # 99 is past the vocabulary: ignored
    np.testing.assert_array_equal(penalised(s), [0.5, -1.0, 0.5, 2.0, 1.0, 0.0])


def test_order_bias_then_repetition_then_frequency():
    s = seq(prompt=[0], output=[0], logit_bias={0: -4.0}, repetition_penalty=2.0,
            frequency_penalty=1.0)
    # (2 - 4) = -2 -> * 2 = -4 -> - 1 (count 1) = -5  (other orders give -3.5, -4.0 or -6)
    assert penalised(s)[0] == -5.0


def test_min_tokens_masks_eos_and_stop_token_ids():
    s = seq(output=[1], min_tokens=3, stop_token_ids=[4])
    np.testing.assert_array_equal(penalised(s), [2.0, -1.0, 0.5, -3.0, NEG_INF, NEG_INF])
    s = seq(output=[1], min_tokens=3, stop_token_ids=[4], ignore_eos=True)
    np.testing.assert_array_equal(penalised(s), [2.0, -1.0, 0.5, -3.0, NEG_INF, 0.0])
    s = seq(output=[1, 1, 1], min_tokens=3, stop_token_ids=[4])     # reached: no mask
    np.testing.assert_array_equal(penalised(s), BASE)
    s = seq(output=[1], min_tokens=3)
    np.testing.assert_array_equal(penalised(s, eos={2, 5}),
                                  [2.0, -1.0, NEG_INF, -3.0, 1.0, NEG_INF])


def test_penalties_per_row_in_a_batch():
    logits = np.tile(BASE, (3, 1))
    seqs = [seq(prompt=[0, 1], output=[1, 2, 2], repetition_penalty=2.0),
            seq(output=[3]),
            seq(prompt=[0, 4], output=[1, 2, 2], presence_penalty=0.5, frequency_penalty=0.25)]
    out = apply_penalties(logits, seqs, {5})
    np.testing.assert_array_equal(out[0], [1.0, -2.0, 0.25, -3.0, 1.0, 0.0])
    np.testing.assert_array_equal(out[1], BASE)
    np.testing.assert_allclose(out[2], [2.0, -1.75, -0.5, -3.0, 1.0, 0.0], atol=1e-6)


# ---- temperature, top-k, top-p, min-p on a hand distribution

PROBS = np.array([0.05, 0.4, 0.1, 0.3, 0.15])   # sorted: 1 (.4), 3 (.3), 4 (.15), 2 (.1), 0 (.05)
LOGITS = np.log(PROBS).astype(np.float32)


def kept(**kw):
    args = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | kw
    out = apply_filters(LOGITS[None], **args)[0]
    assert np.all(np.isneginf(out) | (out == LOGITS / np.float32(args["temperature"])))
    return set(np.flatnonzero(np.isfinite(out)).tolist())


def test_temperature_scales():
    np.testing.assert_allclose(apply_filters(LOGITS[None], 2.0, 0, 1.0, 0.0)[0], LOGITS / 2,
                               rtol=1e-6)
    assert kept(temperature=0.5) == {0, 1, 2, 3, 4}


def test_top_k():
    assert kept(top_k=1) == {1}
    assert kept(top_k=2) == {1, 3}
    assert kept(top_k=4) == {1, 3, 4, 2}
    assert kept(top_k=5) == kept(top_k=0) == {0, 1, 2, 3, 4}


def test_top_p():
    assert kept(top_p=0.35) == {1}
    assert kept(top_p=0.65) == {1, 3}
    assert kept(top_p=0.75) == {1, 3, 4}
    assert kept(top_p=0.9) == {1, 3, 4, 2}
    assert kept(top_p=0.97) == {0, 1, 2, 3, 4}
    # top-p after top-k, on the renormalised top-3: .4/.85 = .47, (.4+.3)/.85 = .82
    assert kept(top_k=3, top_p=0.8) == {1, 3}
    assert kept(top_p=0.8) == {1, 3, 4}


def test_top_p_keeps_at_least_one_token():
    assert kept(top_p=1e-9) == {1}
    assert kept(top_p=1e-9, temperature=0.01) == {1}


def test_min_p():
    # keep prob >= min_p * 0.4
    assert kept(min_p=0.2) == {1, 3, 4, 2}     # >= 0.08
    assert kept(min_p=0.3) == {1, 3, 4}        # >= 0.12
    assert kept(min_p=0.5) == {1, 3}           # >= 0.2
    assert kept(min_p=1.0) == {1}
    assert kept(min_p=0.3, temperature=0.5) == {1, 3}   # scaled: (.15/.4)^2 = .14 < .3
    assert kept(top_p=0.9, min_p=0.3) == {1, 3, 4}


def test_filters_per_row():
    logits = np.tile(LOGITS, (4, 1))
    out = apply_filters(logits, [1.0, 1.0, 1.0, 2.0], [2, 0, 0, 0], [1.0, 0.65, 1.0, 1.0],
                        [0.0, 0.0, 0.5, 0.0])
    assert [set(np.flatnonzero(np.isfinite(r)).tolist()) for r in out] == \
        [{1, 3}, {1, 3}, {1, 3}, {0, 1, 2, 3, 4}]
    np.testing.assert_array_equal(logits, np.tile(LOGITS, (4, 1)))


def reference_top_p(row, p):
    probs = np.exp(row.astype(np.float64) - row.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    n = int(np.searchsorted(np.cumsum(probs[order]), p)) + 1
    return set(order[:min(n, len(row))].tolist())


def test_top_p_large_vocab_matches_full_sort():
    rng = np.random.default_rng(1)
    scales = [0.0, 0.3, 1.0, 4.0, 8.0, 20.0]             # uniform, flat ... very peaked rows
    logits = (rng.standard_normal((12, 5000)) * np.repeat(scales, 2)[:, None]).astype(np.float32)
    top_p = np.array([0.1, 0.5, 0.9, 0.95, 0.3, 0.7, 0.99, 0.6, 0.999, 0.2, 0.5, 0.9])
    out = apply_filters(logits, 1.0, 0, top_p, 0.0)
    for i in range(12):
        expected = reference_top_p(logits[i], top_p[i]) if scales[i // 2] else set(range(5000))
        assert set(np.flatnonzero(np.isfinite(out[i])).tolist()) == expected
    out = apply_filters(logits, 1.0, 100, top_p, 0.0)    # top-p over the renormalised top 100
    for i in range(4, 12):
        top = np.argsort(-logits[i])[:100]
        row = np.full(5000, -np.inf, dtype=np.float32)
        row[top] = logits[i, top]
        assert set(np.flatnonzero(np.isfinite(out[i])).tolist()) == reference_top_p(row, top_p[i])


# ---- seeded Gumbel-max

def test_seeded_reproducible_alone_or_in_batch(backend):
    rng = np.random.default_rng(2)
    V = 1000
    target = dict(seed=1234, temperature=0.8, top_k=50, top_p=0.9, presence_penalty=0.3)
    prompt = [5, 6, 7]
    alone, batched = seq(prompt, **target), seq(prompt, **target)
    others = [seq([1, 2], temperature=0.0), seq([3], seed=7, top_p=0.5),
              seq([4], temperature=1.5, min_p=0.1, repetition_penalty=1.3)]
    s1, s2 = Sampler(backend), Sampler(backend)
    for step in range(6):
        logits = rng.standard_normal((4, V)).astype(np.float32) * 3
        a = s1.sample(logits[2:3].copy(), [alone], {0})
        batch = [others[0], others[1], batched, others[2]]
        b = s2.sample(logits, batch, {0})
        assert a[0] == b[2]
        for s, t in zip(batch, b):
            s.append_token(int(t))
        alone.append_token(int(a[0]))
    assert alone.output_token_ids == batched.output_token_ids
    assert len(set(alone.output_token_ids)) > 1


def test_seeds_and_positions_change_draws(backend):
    logits = np.zeros((1, 64), dtype=np.float32)
    sampler = Sampler(backend)
    by_seed = {int(sampler.sample(logits, [seq(seed=s)], set())[0]) for s in range(40)}
    by_pos = {int(sampler.sample(logits, [seq(output=[0] * n, seed=9)], set())[0])
              for n in range(40)}
    assert len(by_seed) > 15 and len(by_pos) > 15


def test_sampled_tokens_respect_filters(backend):
    logits = np.tile(LOGITS, (300, 1))
    seqs = [seq(seed=s, top_k=2) for s in range(150)] + [seq(seed=s, min_p=0.5) for s in range(150)]
    out = Sampler(backend).sample(logits, seqs, set())
    assert set(out.tolist()) == {1, 3}


def chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_3DOF_P001 = 16.27   # 3 degrees of freedom, p = 0.001


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_over_seeds(backend, temperature):
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    n = 4000
    logits = np.tile(np.log(probs).astype(np.float32), (n, 1))
    out = Sampler(backend).sample(logits, [seq(seed=s, temperature=temperature)
                                           for s in range(n)], set())
    target = probs ** (1 / temperature)
    target /= target.sum()
    counts = np.bincount(out, minlength=4)
    assert chi_square(counts, target) < CHI2_3DOF_P001
    # the bound is tight enough to fail on the wrong distribution
    assert chi_square(counts, np.full(4, 0.25)) > CHI2_3DOF_P001


def test_empirical_distribution_over_positions(backend):
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    logits = np.log(probs).astype(np.float32)[None]
    s, sampler = seq(seed=42), Sampler(backend)
    for _ in range(4000):
        s.append_token(int(sampler.sample(logits, [s], set())[0]))
    counts = np.bincount(s.output_token_ids, minlength=4)
    assert chi_square(counts, probs) < CHI2_3DOF_P001


def test_sample_does_not_modify_logits(backend):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    keep = logits.copy()
    seqs = [seq([1, 2], output=[3], seed=1, temperature=0.7, top_k=5, repetition_penalty=1.5),
            seq(seed=2, top_p=0.5, min_p=0.2), seq(temperature=0.0, logit_bias={4: 3.0})]
    Sampler(backend).sample(logits, seqs, {0})
    np.testing.assert_array_equal(logits, keep)
    only_random = [seq(seed=1, temperature=0.5), seq(seed=2, top_k=3)]
    Sampler(backend).sample(logits[:2], only_random, {0})
    np.testing.assert_array_equal(logits, keep)


def test_numpy_backend_matches_cpu_backend():
    """The NumPy stand-in above draws what the real backend draws (so both runs test the same)."""
    cpu = pytest.importorskip("pyx.cpu_backend").CpuBackend()
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((16, 3000)).astype(np.float32)
    logits[3, :2000] = -np.inf
    seeds = np.array([0, 1, 2**64 - 1, 2**32, 12345] + list(range(11)), dtype=np.uint64)
    positions = np.array([0, 1, 7, 2**32 + 3, 99] + list(range(11)), dtype=np.int64)
    a, b = np.empty(16, np.int64), np.empty(16, np.int64)
    NumpyBackend().gumbel_sample(logits, seeds, positions, a)
    cpu.gumbel_sample(logits, seeds, positions, b)
    np.testing.assert_array_equal(a, b)
    NumpyBackend().argmax(logits, a)
    cpu.argmax(logits, b)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("k", [1, 3, 40, 300])
def test_top_k_large_vocab(k):
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((5, 20000)).astype(np.float32)
    logits[1, :100] = 4.0                       # ties at the top
    out = apply_filters(logits, 1.0, k, 1.0, 0.0)
    for i in range(5):
        kth = np.sort(logits[i])[::-1][k - 1]
        assert set(np.flatnonzero(np.isfinite(out[i])).tolist()) == \
            set(np.flatnonzero(logits[i] >= kth).tolist())


# ---- merged penalty entries (one per distinct (row, token)) against the sequential order

def sequential_penalties(logits, seqs, eos):
    """Today's order, one term at a time in float32: logit_bias, min_tokens mask, repetition
    (prompt + output ids), presence + frequency * count (output ids)."""
    out = np.array(logits, dtype=np.float32, copy=True)
    V = out.shape[1]
    for row, s in zip(out, seqs):
        p = s.sampling_params
        for tid, val in (p.logit_bias or {}).items():
            if 0 <= int(tid) < V:
                row[int(tid)] += np.float32(val)
        if p.min_tokens and s.num_output_tokens < p.min_tokens:
            for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
                if 0 <= t < V:
                    row[t] = -np.inf
        if p.repetition_penalty != 1.0:
            pen = np.float32(p.repetition_penalty)
            for t in set(s.token_ids):
                if 0 <= t < V:
                    row[t] = row[t] / pen if row[t] > 0 else row[t] * pen
        if p.presence_penalty or p.frequency_penalty:
            for t, n in Counter(s.output_token_ids).items():
                if 0 <= t < V:
                    row[t] -= (np.float32(p.presence_penalty)
                               + np.float32(p.frequency_penalty) * np.float32(n))
    return out


def random_penalty_batch(rng, B, V):
    """Rows whose logit_bias, stop ids, prompt and output ids overlap on a small vocabulary,
    with logits that include +-0 and values on both sides of 0."""
    logits = rng.standard_normal((B, V)).astype(np.float32) * 3
    logits[:, :4] = [0.0, -0.0, 1.0, -1.0]
    seqs = []
    for b in range(B):
        kw = {}
        if rng.random() < 0.6:
            kw["logit_bias"] = {int(t): float(rng.choice([-100.0, -2.5, 0.0, 0.75, 3.0]))
                                for t in rng.integers(0, V + 3, 4)}   # some past V
        if rng.random() < 0.5:
            kw["min_tokens"] = 4
            kw["stop_token_ids"] = [int(t) for t in rng.integers(0, V, 2)]
            kw["ignore_eos"] = bool(rng.random() < 0.3)
        if rng.random() < 0.6:
            kw["repetition_penalty"] = float(rng.choice([0.7, 1.3, 2.0]))
        if rng.random() < 0.6:
            kw["presence_penalty"] = float(rng.choice([-1.0, 0.0, 0.5]))
            kw["frequency_penalty"] = float(rng.choice([0.0, 0.25, -0.5]))
        prompt = rng.integers(0, V, rng.integers(1, 8)).tolist()
        output = rng.integers(0, V, rng.integers(0, 7)).tolist()
        seqs.append(seq(prompt, output, temperature=0.0, **kw))
    return logits, seqs


def test_merged_penalties_match_sequential_order_bit_for_bit(backend):
    rng = np.random.default_rng(11)
    eos = {1, 7}
    for trial in range(20):
        B, V = int(rng.integers(1, 9)), int(rng.integers(8, 24))
        logits, seqs = random_penalty_batch(rng, B, V)
        want = sequential_penalties(logits, seqs, eos)
        got = apply_penalties(logits, seqs, eos)              # the NumPy helper
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        entries = penalty_entries(seqs, eos, V)
        if entries is None:
            np.testing.assert_array_equal(want, logits)
            continue
        work = logits.copy()
        backend.apply_penalties(work, *entries)               # the backend op
        np.testing.assert_array_equal(work.view(np.uint32), want.view(np.uint32))
        # greedy rows sample the argmax of the penalised logits
        out = Sampler(backend).sample(logits, seqs, eos)
        np.testing.assert_array_equal(out, want.argmax(axis=1))


def test_penalty_entries_merge_every_term_of_a_token():
    # token 2 is in logit_bias, forbidden by min_tokens, in the prompt and twice in the output
    s = seq(prompt=[2, 3], output=[2, 2, 4], logit_bias={2: 1.5, 4: -1.0}, min_tokens=5,
            stop_token_ids=[2], repetition_penalty=1.5, presence_penalty=0.5,
            frequency_penalty=0.25)
    other = seq(prompt=[2], output=[], repetition_penalty=2.0)
    rows, cols, bias, rep, pres_freq = penalty_entries([s, other], {9}, 10)
    assert rows.dtype == cols.dtype == np.int32
    assert bias.dtype == rep.dtype == pres_freq.dtype == np.float32
    # one entry per distinct (row, token): row 0 {2, 3, 4, 9 (eos)}, row 1 {2}
    assert list(zip(rows.tolist(), cols.tolist())) == [(0, 2), (0, 3), (0, 4), (0, 9), (1, 2)]
    np.testing.assert_array_equal(bias, [-np.inf, -0.0, -1.0, -np.inf, -0.0])
    assert np.signbit(bias[1]) and np.signbit(bias[4])      # -0.0: adds exactly nothing
    np.testing.assert_array_equal(rep, [1.5, 1.5, 1.5, 1.0, 2.0])
    np.testing.assert_array_equal(pres_freq, [1.0, 0.0, 0.75, 0.0, 0.0])
    assert penalty_entries([seq(output=[1]), seq(temperature=0.5)], {0}, 10) is None


def test_logit_bias_ids_past_vocab_and_repeated():
    s = seq(logit_bias={"2": 1.0, 2: 2.0, 6: 5.0, -1: 5.0})   # "2" and 2 add; 6, -1 ignored
    np.testing.assert_array_equal(penalised(s), [2.0, -1.0, 3.5, -3.0, 1.0, 0.0])


def test_sampler_penalties_and_filters_in_one_batch(backend):
    """Greedy and random rows, with and without penalties: each row's token is what the
    sequential reference followed by the filters and Gumbel-max gives for that row alone."""
    rng = np.random.default_rng(12)
    V = 300
    logits = rng.standard_normal((5, V)).astype(np.float32) * 2
    seqs = [seq([5, 6], [7], temperature=0.0, repetition_penalty=3.0, logit_bias={8: 9.0}),
            seq([5], [9, 9], seed=1, temperature=0.7, top_k=20, presence_penalty=2.0),
            seq([1], seed=2, top_p=0.8, min_tokens=2, stop_token_ids=[3]),
            seq([2], [4], seed=3, min_p=0.05, frequency_penalty=-1.0),
            seq([3], seed=4)]
    keep = logits.copy()
    out = Sampler(backend).sample(logits, seqs, {0})
    np.testing.assert_array_equal(logits, keep)
    pen = sequential_penalties(logits, seqs, {0})
    assert out[0] == pen[0].argmax()
    for b in range(1, 5):
        p = seqs[b].sampling_params
        row = apply_filters(pen[b:b + 1], p.temperature, p.top_k, p.top_p, p.min_p)
        one = np.empty(1, np.int64)
        NumpyBackend().gumbel_sample(row, np.array([seqs[b].seed], np.uint64),
                                     np.array([seqs[b].num_output_tokens], np.int64), one)
        assert out[b] == one[0]


def test_filter_logits_op_matches_full_sort_reference():
    """CpuBackend.filter_logits (pyx/cpu_sampling.py's sparse algorithm) keeps exactly the tokens
    the full-sort NumpyBackend above keeps, with the same scaled values."""
    cpu = pytest.importorskip("pyx.cpu_backend").CpuBackend()
    rng = np.random.default_rng(13)
    B, V = 24, 4000
    logits = (rng.standard_normal((B, V)) * rng.choice([0.5, 2.0, 8.0], B)[:, None]).astype(np.float32)
    logits[3, 100:200] = logits[3].max()            # ties at the top
    temperature = rng.choice([1.0, 0.7, 1.5], B).astype(np.float32)
    top_k = rng.choice([0, 1, 5, 50, V, V + 10], B).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5, 0.1], B).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.3], B).astype(np.float32)
    a, b = logits.copy(), logits.copy()
    cpu.filter_logits(a, temperature, top_k, top_p, min_p)
    NumpyBackend().filter_logits(b, temperature, top_k, top_p, min_p)
    np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))
    np.testing.assert_array_equal(a, b)


def test_penalty_counts_follow_the_history_incrementally():
    """The sampler's per-sequence counts, updated step by step (one token, or a chunk), equal
    np.unique over the whole history at every step, so the penalties read the same history."""
    from engine.sampling.sampler import token_counts
    rng = np.random.default_rng(4)
    s = seq(prompt=rng.integers(0, 50, 30).tolist())
    for step in range(40):
        for t in rng.integers(0, 50, 1 if step % 7 else 5).tolist():
            s.append_token(t)
        for prompt, history in ((True, s.token_ids), (False, s.output_token_ids)):
            ids, counts = token_counts(s, prompt).below(50)
            want_ids, want_counts = np.unique(history, return_counts=True)
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_array_equal(counts, want_counts)
    assert token_counts(s, True).below(10)[0].max() < 10          # ids past V are left out
