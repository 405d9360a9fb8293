"""Drafter lifecycle, pool accounting and bad input through the Python API (host backend).

Every error must raise DflashError (or a Python-side TypeError/ValueError for buffers C cannot
check) with a message naming the problem, leave the objects usable, and leak no KV block.
"""
import numpy as np
import pytest

from pydflash import Drafter, DflashError

SMALL = dict(hidden_size=64, vocab_size=128, target_num_layers=4, num_layers=2,
             target_layer_ids=[1, 3], block_size=8, num_heads=4, num_kv_heads=2, head_dim=32,
             intermediate_size=96)


@pytest.fixture(scope="module")
def pair(make_pair):
    return make_pair(11, **SMALL)


@pytest.fixture
def drafter(pair):
    target_dir, draft_dir = pair
    with Drafter.from_pretrained(draft_dir, target_dir, backend="host", max_batch=2,
                                 max_seq_len=256) as d:
        yield d


def features(drafter, n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, drafter.feature_width), dtype=np.float32)


def assert_pool_full(drafter):
    stats = drafter.pool_stats()
    assert stats["free_blocks"] == stats["total_blocks"], stats


def raises(status_name, *fragments):
    """Context manager: DflashError with this status whose message contains every fragment."""
    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(DflashError)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            suppressed = self.ctx.__exit__(*exc)
            err = self.info.value
            assert err.status_name == status_name, (err.status_name, str(err))
            for fragment in fragments:
                assert str(fragment) in err.message, (fragment, err.message)
            return suppressed
    return _Check()


def test_pool_sizing_follows_the_documented_formula(pair):
    target_dir, draft_dir = pair
    for max_batch, max_seq_len, window in [(1, 100, 0), (3, 256, 0), (2, 256, 40), (4, 30, 100)]:
        with Drafter.from_pretrained(draft_dir, target_dir, max_batch=max_batch,
                                     max_seq_len=max_seq_len, ctx_window=window) as d:
            live = min(window, max_seq_len) if window else max_seq_len
            per_seq = -(-(live + SMALL["block_size"]) // 16)
            stats = d.pool_stats()
            assert stats["blocks_per_sequence"] == per_seq
            assert stats["total_blocks"] == max_batch * per_seq + 1
            assert stats["free_blocks"] == stats["total_blocks"]


def test_thousand_cycles_leave_the_pool_full(drafter):
    rng = np.random.default_rng(0)
    feats = features(drafter, 64)
    for cycle in range(1000):
        with drafter.new_sequence(budget_tokens=int(rng.integers(40, 200))) as seq:
            n = int(rng.integers(1, 30))
            seq.append_context(feats[:n])
            drafts = seq.propose(int(rng.integers(0, 128)), n, int(rng.integers(1, 8)))
            assert all(0 <= t < 128 for t in drafts)
            seq.after_verify(int(rng.integers(0, len(drafts) + 1)))
            if cycle % 3 == 0:
                seq.reset()  # free_state, then reuse the same handle
                seq.append_context(feats[:5])
                seq.propose(1, 5, 3)
                seq.after_verify(0)
        if cycle % 100 == 0:
            assert_pool_full(drafter)
    assert_pool_full(drafter)
    assert drafter.pool_stats()["live_sequences"] == 0


def test_reset_is_free_state_and_reuse_matches_a_fresh_sequence(drafter):
    feats = features(drafter, 40, seed=3)
    with drafter.new_sequence() as fresh:
        fresh.append_context(feats[:20])
        expected = fresh.propose(5, 20, 7)
    with drafter.new_sequence() as seq:
        seq.append_context(feats[20:40])
        seq.propose(9, 20, 7)
        seq.after_verify(2)
        assert seq.info()["blocks_held"] > 0
        seq.reset()
        info = seq.info()
        assert info["blocks_held"] == 0 and info["next_position"] == 0 and info["context_rows"] == 0
        assert_pool_full(drafter)
        seq.append_context(feats[:20])
        assert seq.propose(5, 20, 7) == expected


def test_propose_is_deterministic_and_sequences_are_independent(drafter):
    feats = features(drafter, 30, seed=5)
    a, b = drafter.new_sequence(), drafter.new_sequence()
    a.append_context(feats)
    b.append_context(feats[:10])
    first = a.propose(3, 30, 7)
    b.propose(4, 10, 7)  # another sequence in between must not disturb `a`
    a.after_verify(0)
    a.reset()
    a.append_context(feats)
    assert a.propose(3, 30, 7) == first
    a.close()
    b.close()
    assert_pool_full(drafter)


def test_bf16_and_f16_features_give_the_same_drafts_as_their_f32_values(drafter):
    feats = features(drafter, 24, seed=7)
    bits = feats.view(np.uint32)
    bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    as_f32 = (bf16.astype(np.uint32) << 16).view(np.float32)
    results = []
    for array, dtype in [(as_f32, None), (bf16, "bf16"), (as_f32.astype(np.float16), None),
                         (as_f32.astype(np.float16).astype(np.float32), None)]:
        with drafter.new_sequence() as seq:
            seq.append_context(array, dtype=dtype)
            results.append((seq.propose(2, 24, 7), seq.read_hidden()))
    assert results[0][0] == results[1][0]
    np.testing.assert_array_equal(results[0][1], results[1][1])
    assert results[2][0] == results[3][0]
    np.testing.assert_array_equal(results[2][1], results[3][1])


def test_pool_exhaustion_is_clean_and_recoverable(pair):
    target_dir, draft_dir = pair
    with Drafter.from_pretrained(draft_dir, target_dir, max_batch=2, max_seq_len=64) as d:
        feats = np.zeros((56, d.feature_width), np.float32)
        total = d.pool_stats()["total_blocks"]
        seqs = [d.new_sequence() for _ in range(4)]
        seqs[0].append_context(feats)
        seqs[1].append_context(feats)
        free_before = d.pool_stats()["free_blocks"]
        with raises("DFLASH_STATUS_POOL_EXHAUSTED", "KV pool exhausted"):
            seqs[2].append_context(feats)
        # all-or-nothing: the failed call took no block and changed nothing
        assert d.pool_stats()["free_blocks"] == free_before
        assert seqs[2].info()["context_rows"] == 0
        seqs[0].close()
        seqs[2].append_context(feats)
        seqs[2].propose(1, 56, 7)
        seqs[2].after_verify(3)
        for s in seqs:
            s.close()
        assert d.pool_stats()["free_blocks"] == total


def test_bad_inputs_raise_named_errors_and_leave_the_sequence_usable(drafter):
    feats = features(drafter, 10)
    seq = drafter.new_sequence(budget_tokens=32)
    seq.append_context(feats)
    with raises("DFLASH_STATUS_OUT_OF_RANGE", "token 128", "[0, 128)"):
        seq.propose(128, 10, 3)
    with raises("DFLASH_STATUS_OUT_OF_RANGE", "token -1"):
        seq.propose(-1, 10, 3)
    with raises("DFLASH_STATUS_OUT_OF_RANGE", "position 11", "(10)"):
        seq.propose(1, 11, 3)
    with raises("DFLASH_STATUS_INVALID_STATE", "after_verify without a propose"):
        seq.after_verify(0)
    with raises("DFLASH_STATUS_INVALID_STATE", "no hidden states"):
        seq.read_hidden()
    with raises("DFLASH_STATUS_OUT_OF_RANGE", "first_pos 3", "next position 10"):
        seq.append_context(feats[:2], first_pos=3)
    with raises("DFLASH_STATUS_CAPACITY", "budget of 32"):
        seq.append_context(np.zeros((23, drafter.feature_width), np.float32))
    width = drafter.feature_width
    with pytest.raises(ValueError, match=rf"shape \[n_rows, {width}\].*got \[2, {width - 1}\]"):
        seq.append_context(np.zeros((2, width - 1), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        seq.append_context(np.zeros((drafter.feature_width, 2), np.float32).T)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        seq.append_context(np.zeros((2, drafter.feature_width), np.float64))

    drafts = seq.propose(1, 10, 5)
    with raises("DFLASH_STATUS_INVALID_STATE", "awaits after_verify"):
        seq.propose(1, 10, 5)
    with raises("DFLASH_STATUS_INVALID_STATE", "needs after_verify"):
        seq.append_context(feats[:1])
    with raises("DFLASH_STATUS_OUT_OF_RANGE", "num_accepted 6", "[0, 5]"):
        seq.after_verify(len(drafts) + 1)
    seq.after_verify(len(drafts))  # still usable after every error above
    seq.append_context(feats)
    seq.append_context(feats[:6])
    with raises("DFLASH_STATUS_CAPACITY", "block of 8 rows at position 26", "budget of 32"):
        seq.propose(1, 26, 20)
    assert len(seq.propose(1, 26, 5)) == 5
    seq.close()
    assert_pool_full(drafter)


def test_budget_limits(drafter):
    with raises("DFLASH_STATUS_CAPACITY", "budget_tokens 257", "max_seq_len 256"):
        drafter.new_sequence(budget_tokens=257)
    with drafter.new_sequence(budget_tokens=20) as seq:
        seq.append_context(features(drafter, 14))
        with raises("DFLASH_STATUS_CAPACITY", "block of 8 rows at position 14", "budget of 20"):
            seq.propose(1, 14, 7)
        assert len(seq.propose(1, 14, 5)) == 5  # a narrower block fits
        seq.after_verify(0)


def test_closed_handles(pair):
    target_dir, draft_dir = pair
    d = Drafter.from_pretrained(draft_dir, target_dir)
    seq = d.new_sequence()
    d.close()
    assert seq.closed and d.closed
    with pytest.raises(ValueError, match="closed"):
        seq.propose(1, 0, 3)
    with pytest.raises(ValueError, match="closed"):
        d.new_sequence()
    seq.close()  # no-op
    d.close()  # idempotent


def test_cuda_backend_without_a_device_is_a_clean_error(pair):
    from pydflash import devices

    if devices.cuda_devices():
        pytest.skip("a CUDA device is present; the gpu tests cover it")
    target_dir, draft_dir = pair
    with pytest.raises(DflashError) as info:
        Drafter.from_pretrained(draft_dir, target_dir, backend="cuda")
    assert info.value.status_name in ("DFLASH_STATUS_NO_DEVICE", "DFLASH_STATUS_NOT_SUPPORTED")
    assert "CUDA" in info.value.message or "cuda" in info.value.message
