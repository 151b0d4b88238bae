"""The flash-decoding split heuristic (pyx/decode_splits.py): a table of decode steps on an H100
(132 SMs, 4 resident decode blocks per SM) and an A100 (108 SMs, 3 per SM: the D = 128 bf16
block's ~45 KB of shared memory in 164 KB), and the invariants the kernel relies on."""
from __future__ import annotations

import pytest

from pyx.decode_splits import MAX_SPLITS, decode_num_splits, wave_efficiency

H100, A100 = dict(num_sms=132, blocks_per_sm=4), dict(num_sms=108, blocks_per_sm=3)


def splits(B, ctx, BS=16, Hkv=8, dev=H100):
    return decode_num_splits(B, Hkv, ctx, BS, **dev)


def chunk(ctx, s, BS):
    """The kernel's partition length (cuda/attention_decode.cu), written out again here."""
    return -(-(-(-ctx // s)) // BS) * BS


@pytest.mark.parametrize("B,ctx,lo,hi", [
    (1, 32768, 48, 64),     # Llama-3-8B's 8 KV heads alone use 8 of 528 slots: split many ways
    (1, 8192, 48, 64),
    (1, 1024, 8, 16),       # 1024 keys hold at most 16 partitions of 64
    (4, 32768, 12, 16),
    (16, 32768, 2, 4),      # 128 blocks: a few splits fill the device
    (16, 1024, 2, 4),
    (32, 8192, 2, 2),
    (64, 32768, 1, 1),      # 512 blocks: one pass, no merge
    (256, 32768, 1, 1),
])
def test_h100_table(B, ctx, lo, hi):
    assert lo <= splits(B, ctx) <= hi


def test_long_context_single_sequence_fills_the_device():
    for dev in (H100, A100):
        slots = dev["num_sms"] * dev["blocks_per_sm"]
        for B in (1, 2, 4, 8, 16):
            s = splits(B, 32768, dev=dev)
            assert B * 8 * s >= 0.85 * slots, (dev, B, s)
            assert wave_efficiency(B * 8 * s, slots) >= 0.85


def test_batch_that_fills_the_device_runs_one_pass():
    assert splits(66, 32768) == 1              # 528 blocks = 132 SMs x 4
    assert splits(64, 32768, Hkv=16) == 1
    assert splits(41, 32768, dev=A100) == 1    # 328 blocks >= 108 x 3 slots
    assert splits(30, 32768, dev=A100) > 1     # 240 blocks: SMs would idle


def test_few_splits_for_large_batches_many_for_one():
    assert splits(1, 32768) >= 8 * splits(16, 32768)
    assert splits(16, 32768) <= 4 and splits(32, 32768) <= 2


@pytest.mark.parametrize("ctx,BS,most", [(1024, 128, 8), (100, 16, 1), (129, 128, 2),
                                         (4096, 128, 32), (200, 8, 3)])
def test_never_more_splits_than_kv_blocks_or_short_partitions(ctx, BS, most):
    s = splits(1, ctx, BS)
    assert s <= -(-ctx // BS) and s <= max(1, ctx // 64)
    assert s == most


def test_every_partition_holds_keys_at_max_context():
    for ctx in (1, 15, 17, 100, 1000, 1023, 4097, 8192, 32768, 131072):
        for BS in (8, 16, 32, 64, 128):
            for B in (1, 3, 16, 40):
                for Hkv in (1, 2, 8):
                    s = splits(B, ctx, BS, Hkv)
                    assert 1 <= s <= MAX_SPLITS
                    assert chunk(ctx, s, BS) * (s - 1) < ctx, (ctx, BS, B, Hkv, s)


def test_degenerate_inputs_give_one():
    assert splits(0, 8192) == 1
    assert splits(1, 0) == 1
    assert splits(1, 8192, Hkv=0) == 1
    assert decode_num_splits(1, 8, 8192, 16, num_sms=0) == 1
    assert decode_num_splits(1, 8, 8192, 16, num_sms=132, max_splits=0) == 1


def test_wave_efficiency():
    assert wave_efficiency(528, 528) == 1.0
    assert wave_efficiency(529, 528) == pytest.approx(529 / 1056)
    assert wave_efficiency(132, 528) == 0.25
