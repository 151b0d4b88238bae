"""CpuBackend.gated_delta_conv_decode and gated_delta_recurrent_decode (pyx/gated_delta_kernels.c),
the gated DeltaNet's decode step, against pyx/gated_delta_net.py's NumPy path (the reference):
the same bits of outputs and state rows over several decode steps, with fresh sequences, a sequence resuming from another
row (a snapshot), grouped q/k heads and inputs past softplus's threshold; and the steps it must
leave to the NumPy path."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine.core.hybrid_state import StatePlan
from pyx.cpu_backend import CpuBackend
from pyx.gated_delta_net import GatedDeltaNet
from pyx.layers import Workspace

H, NK, NV, DK, DV, KERNEL, ROWS = 48, 2, 4, 8, 6, 4, 6


def make_layer(backend, seed=0):
    rng = np.random.default_rng(seed)
    conv_dim, value_dim = 2 * NK * DK + NV * DV, NV * DV
    in_proj = (rng.standard_normal((conv_dim + value_dim + 2 * NV, H)) * 0.3).astype(np.float32)
    in_proj[-NV:] *= 40.0                       # some a + dt_bias past softplus's threshold 20
    return GatedDeltaNet(
        backend, in_proj, rng.standard_normal((conv_dim, KERNEL)).astype(np.float32),
        rng.standard_normal(NV).astype(np.float32), rng.standard_normal(NV).astype(np.float32),
        (1 + 0.1 * rng.standard_normal(DV)).astype(np.float32),
        (rng.standard_normal((H, value_dim)) * 0.3).astype(np.float32), NK, NV, DK, DV, 1e-6)


def run(layer, plans, xs, kernel: bool):
    """The steps (plan, input) from the same random starting state rows; the outputs and the
    final state rows."""
    layer.use_decode_kernels = kernel
    rng = np.random.default_rng(1)
    conv, ssm = (rng.standard_normal(s).astype(np.float32) for s in layer.state_shapes(ROWS))
    ws, outs = Workspace(np), []
    for plan, x in zip(plans, xs):
        out = np.empty_like(x)
        layer.forward(SimpleNamespace(state_plan=plan), x, out, conv, ssm, ws)
        outs.append(out)
    return outs, conv, ssm


def decode_plan(slots, src, fresh):
    B = len(slots)
    return StatePlan(np.arange(B + 1), np.array(slots, np.int64), np.array(src, np.int64),
                     np.array(fresh, bool))


def test_decode_kernel_equals_numpy_path():
    cpu = CpuBackend()
    layer = make_layer(cpu)
    # step 1: seq 0 fresh, seq 1 resumes from snapshot row 4 into slot 1, seq 2 from its slot;
    # then plain decodes of the three (and of two, in another order)
    plans = [decode_plan([0, 1, 2], [0, 4, 2], [True, False, False])]
    plans += [decode_plan([0, 1, 2], [0, 1, 2], [False] * 3) for _ in range(3)]
    plans += [decode_plan([2, 0], [2, 0], [False, False])]
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((p.num_seqs, H)).astype(np.float32) for p in plans]
    calls = []
    layer.backend = SimpleNamespace(          # the CPU backend, its kernel calls counted
        linear=cpu.linear, act_dtype=cpu.act_dtype, xp=cpu.xp,
        gated_delta_conv_decode=cpu.gated_delta_conv_decode,
        gated_delta_recurrent_decode=lambda *a: (calls.append(1),
                                                 cpu.gated_delta_recurrent_decode(*a)))
    ref_out, ref_conv, ref_ssm = run(layer, plans, xs, kernel=False)
    assert not calls
    out, conv, ssm = run(layer, plans, xs, kernel=True)
    assert len(calls) == len(plans)             # every step took the kernel
    for a, b in zip(out, ref_out):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(conv, ref_conv)
    np.testing.assert_array_equal(ssm, ref_ssm)


@pytest.mark.parametrize("plan", [
    StatePlan(np.array([0, 2, 3]), np.array([0, 1]), np.array([0, 1]), np.array([False] * 2)),
    StatePlan(np.array([0, 1, 2]), np.array([0, 1]), np.array([0, 1]), np.array([False] * 2),
              saves=[(0, 1, 4)]),
    StatePlan(np.array([0, 1, 2]), np.array([0, 1]), np.array([1, 1]), np.array([False] * 2)),
], ids=["a prefill chunk", "a snapshot to take", "reads another's slot"])
def test_steps_left_to_numpy(plan):
    layer = make_layer(CpuBackend())
    assert layer._decode_kernels(decode_plan([0], [0], [False]), 1)
    assert not layer._decode_kernels(plan, int(plan.starts[-1]))


def test_bad_shapes_named():
    layer = make_layer(CpuBackend())
    b = CpuBackend()
    C, Vd = 2 * NK * DK + NV * DV, NV * DV
    conv, ssm = (np.zeros(s, np.float32) for s in layer.state_shapes(ROWS))
    rows = [np.array([0]), np.array([0]), np.zeros(1, np.uint8)]
    proj, acc = np.zeros((1, C + Vd + 2 * NV), np.float32), np.zeros((1, C), np.float32)
    with pytest.raises(ValueError, match="gated_delta_conv_decode: proj must be"):
        b.gated_delta_conv_decode(proj[:, :C - 1].copy(), layer.conv_taps, conv, *rows, acc)
    with pytest.raises(ValueError, match="index out of range"):
        b.gated_delta_conv_decode(proj, layer.conv_taps, conv, np.array([ROWS]), *rows[1:], acc)
    gates = [np.ones((1, NV), np.float32)] * 2 + [np.ones((1, Vd), np.float32)]
    core = np.zeros((1, Vd), np.float32)
    with pytest.raises(ValueError, match="gated_delta_recurrent_decode: mixed must be"):
        b.gated_delta_recurrent_decode(acc[:, 1:].copy(), *gates, layer.norm_weight, ssm, *rows,
                                       core, NK, 1e-6)
    with pytest.raises(ValueError, match="index out of range"):
        b.gated_delta_recurrent_decode(acc, *gates, layer.norm_weight, ssm, rows[0],
                                       np.array([-1]), rows[2], core, NK, 1e-6)
