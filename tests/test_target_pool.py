"""Target KV bookkeeping and the sequence API's invariants (host backend).

- Pools: after any sequence finishes, is rolled back, reset, or fails mid-way (out-of-range tokens, budget
  overflow, pool exhaustion, a drafter raising inside generate), the target's and the drafter's pools are full
  again once the sequences are closed, and a failed call leaves its sequence exactly as it was, still usable.
- Rollback returns blocks: a sequence holds ceil(length / 16) blocks, never more.
- Equivalences: prefill chunking (prefill_chunk 1 / 7 / 16 / 256) is invisible; a prompt prefilled in two calls
  equals one call; verify of one row is an autoregressive step (== transformers' greedy decode).
"""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("dflash")

import oracle  # noqa: E402
import pydflash  # noqa: E402
from pydflash import DflashError  # noqa: E402

BLOCK = 16  # DFLASH_KV_BLOCK_SIZE
VOCAB = 512  # make_target's default


def full(stats):
    return stats["free_blocks"] == stats["total_blocks"]


def assert_pools_full(*owners):
    for owner in owners:
        stats = owner.pool_stats()
        assert full(stats), f"{type(owner).__name__} pool not full: {stats}"
        assert stats.get("live_sequences", 0) == 0, stats


def check_blocks(seq, what=""):
    info = seq.info()
    assert info["blocks_held"] == math.ceil(info["length"] / BLOCK), f"{what}: {info}"
    return info


def raises(status, fn, *args, **kwargs):
    with pytest.raises(DflashError) as e:
        fn(*args, **kwargs)
    assert e.value.status_name == f"DFLASH_STATUS_{status}", f"{e.value} (expected {status})"
    return e.value


def tokens(seed, n, vocab=VOCAB):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


@pytest.fixture
def pair(make_pair):
    return make_pair(500, block_size=4, target_layer_ids=[0, 2])


def open_pair(pair, target_kw=None, drafter_kw=None):
    target_dir, draft_dir = pair
    target = pydflash.Target.from_pretrained(target_dir, backend="host", **{"max_seq_len": 256, **(target_kw or {})})
    drafter = pydflash.Drafter.from_pretrained(draft_dir, target=target, **{"max_seq_len": 256, **(drafter_kw or {})})
    return target, drafter


# --------------------------------------------------------------------------------------------------------------
# Pools after generate, finished or failed
# --------------------------------------------------------------------------------------------------------------

def test_generate_leaves_pools_full(pair):
    target, drafter = open_pair(pair)
    with target, drafter:
        prompt = tokens(1, 37)
        greedy = pydflash.generate(target, drafter, prompt, 40)
        runs = [dict(), dict(max_new_tokens=1), dict(stop_token_ids=[greedy.output_ids[5]]),
                dict(block_size=1), dict(block_size=2), dict(temperature=0.8, seed=3),
                dict(temperature=1.2, top_k=5, seed=4, draft_mode="sample")]
        for kw in runs:
            n = kw.pop("max_new_tokens", 40)
            pydflash.generate(target, drafter, prompt, n, **kw)
            assert_pools_full(target, drafter)
        pydflash.generate(target, None, prompt, 40)
        assert_pools_full(target, drafter)


class FailingDrafter:
    """External drafter misbehaving at step `at`: raising, or proposing an out-of-range / negative token."""

    block_size = 4

    def __init__(self, at, how):
        self.at, self.how, self.closed = at, how, 0

    def new_sequence(self, *args, **kwargs):
        owner = self

        class Seq:
            step = 0

            def propose(self, last_token, position, num_drafts, sampling=None):
                self.step += 1
                drafts = [last_token] * num_drafts
                if self.step == owner.at:
                    if owner.how == "raise":
                        raise RuntimeError("drafter exploded")
                    drafts[-1] = VOCAB + 5 if owner.how == "vocab" else -1
                return drafts

            def after_verify(self, num_accepted):
                pass

            def close(self):
                owner.closed += 1

        return Seq()


@pytest.mark.parametrize("how", ["raise", "vocab", "negative"])
def test_generate_failing_midway_leaves_pools_full(pair, how):
    target, drafter = open_pair(pair)
    with target, drafter:
        ext = FailingDrafter(at=3, how=how)
        expected = RuntimeError if how == "raise" else DflashError
        with pytest.raises(expected) as e:
            pydflash.generate(target, ext, tokens(2, 20), 30)
        if how != "raise":
            assert e.value.status_name == "DFLASH_STATUS_OUT_OF_RANGE", e.value
        assert ext.closed == 1, "the external drafter's sequence was not closed"
        assert_pools_full(target, drafter)
        # And the target is fine afterwards.
        assert pydflash.generate(target, None, tokens(2, 20), 5).output_ids


def test_generate_hitting_pool_exhaustion_midway(pair):
    """Another sequence holds most of the target's pool: generate fails at a verify part-way through, with
    POOL_EXHAUSTED, and gives back everything it took."""
    target, drafter = open_pair(pair, dict(max_batch=1, max_seq_len=128))
    with target, drafter:
        total = target.pool_stats()["total_blocks"]
        assert total == 128 // BLOCK + 1
        hog = target.new_sequence()
        hog.prefill(tokens(3, 96))
        held = check_blocks(hog)["blocks_held"]
        assert target.pool_stats()["free_blocks"] == total - held
        partial = []

        class Recorder:  # external drafter: counts the steps that succeeded before the failure
            block_size = 4

            def new_sequence(self, *args, **kwargs):
                return self

            def propose(self, last_token, position, num_drafts, sampling=None):
                partial.append(position)
                return [last_token] * num_drafts

            def after_verify(self, n):
                pass

            def close(self):
                pass

        for d in (drafter, Recorder()):
            raises("POOL_EXHAUSTED", pydflash.generate, target, d, tokens(4, 20), 60)
            assert target.pool_stats()["free_blocks"] == total - held
            assert full(drafter.pool_stats())
        assert len(partial) > 1, "the failure should come part-way through, not at prefill"
        hog.close()
        assert_pools_full(target, drafter)
        out = pydflash.generate(target, drafter, tokens(4, 20), 60)
        assert len(out.output_ids) == 60
        assert_pools_full(target, drafter)


# --------------------------------------------------------------------------------------------------------------
# Rollback, verify, reset: blocks follow the length
# --------------------------------------------------------------------------------------------------------------

def test_rollback_returns_blocks(pair):
    target, drafter = open_pair(pair)
    with target, drafter:
        total = target.pool_stats()["total_blocks"]
        seq = target.new_sequence()
        seq.prefill(tokens(5, 40))
        assert check_blocks(seq)["blocks_held"] == 3
        for n, length in ((20, 20), (3, 17), (1, 16), (15, 1), (1, 0)):
            seq.rollback(n)
            info = check_blocks(seq, f"rollback({n})")
            assert info["length"] == length
            assert target.pool_stats()["free_blocks"] == total - info["blocks_held"]
        seq.rollback(0)
        raises("OUT_OF_RANGE", seq.rollback, 1)
        seq.prefill(tokens(6, 33))
        raises("OUT_OF_RANGE", seq.rollback, 34)
        raises("OUT_OF_RANGE", seq.rollback, -1)
        assert check_blocks(seq)["length"] == 33
        seq.close()
        assert_pools_full(target)


def test_verify_keeps_blocks_for_committed_rows_only(pair):
    """A verify takes blocks for all its rows, then keeps only what the committed rows need."""
    target, drafter = open_pair(pair)
    with target, drafter:
        seq = target.new_sequence()
        anchor = seq.prefill(tokens(7, 15))
        for step in range(6):
            length = seq.info()["length"]
            drafts = tokens(100 + step, 15)  # random drafts: almost surely rejected early
            accepted, anchor = seq.verify([anchor, *drafts])
            info = check_blocks(seq, f"step {step}")
            assert info["length"] == length + accepted + 1
        seq.close()
        assert_pools_full(target)


def test_reset_returns_blocks_and_restarts(pair):
    target, drafter = open_pair(pair)
    with target, drafter:
        prompt = tokens(8, 50)
        with target.new_sequence() as seq, drafter.new_sequence() as dseq:
            first = [seq.prefill(prompt, capture=dseq)]
            for _ in range(5):
                first.append(seq.verify([first[-1]])[1])
            seq.reset()
            dseq.reset()
            info = seq.info()
            assert (info["length"], info["blocks_held"], info["steps"]) == (0, 0, 0), info
            assert full(target.pool_stats()) and full(drafter.pool_stats())
            again = [seq.prefill(prompt, capture=dseq)]
            for _ in range(5):
                again.append(seq.verify([again[-1]])[1])
            assert again == first
        assert_pools_full(target, drafter)


# --------------------------------------------------------------------------------------------------------------
# Failed calls: a clear status, the sequence unchanged and usable, nothing leaked
# --------------------------------------------------------------------------------------------------------------

def continue_greedy(seq, anchor, n):
    out = [anchor]
    for _ in range(n):
        accepted, nxt = seq.verify([out[-1]])
        assert accepted == 0
        out.append(nxt)
    return out


def test_failed_calls_leave_the_sequence_unchanged(pair):
    target, drafter = open_pair(pair, dict(max_verify_rows=8))
    with target, drafter:
        prompt = tokens(9, 21)
        budget = 40
        clean = target.new_sequence(budget)
        want = continue_greedy(clean, clean.prefill(prompt), 10)
        clean.close()

        seq = target.new_sequence(budget)
        anchor = seq.prefill(prompt)
        dseq = drafter.new_sequence(budget)
        before = seq.info()
        bad_calls = [
            ("OUT_OF_RANGE", seq.verify, [anchor, VOCAB]),
            ("OUT_OF_RANGE", seq.verify, [anchor, 3, -1]),
            ("OUT_OF_RANGE", seq.verify, [VOCAB + 100]),
            ("OUT_OF_RANGE", seq.verify, []),
            ("OUT_OF_RANGE", seq.verify, [anchor] * 9),  # > max_verify_rows
            ("CAPACITY", seq.prefill, [1] * (budget - 21 + 1)),
            ("INVALID_ARGUMENT", seq.prefill, []),
            ("OUT_OF_RANGE", seq.prefill, [1, VOCAB]),
            ("OUT_OF_RANGE", seq.rollback, 22),
            ("INVALID_STATE", lambda: seq.verify([anchor, 1], drafter_seq=dseq)),  # dseq proposed nothing
        ]
        for status, fn, *args in bad_calls:
            err = raises(status, fn, *args)
            assert err.message, f"{status}: no message"
            assert seq.info() == before, f"{status} changed the sequence: {before} -> {seq.info()}"
        # Budget overflow at a verify near the end of the budget.
        near = target.new_sequence(budget)
        a = near.prefill(tokens(10, budget - 3))
        snapshot = near.info()
        raises("CAPACITY", near.verify, [a, 1, 2, 3])
        assert near.info() == snapshot
        near.verify([a, 1, 2])  # exactly fills the budget
        near.close()
        raises("CAPACITY", target.new_sequence, 10**6)
        assert seq.info() == before
        assert continue_greedy(seq, anchor, 10) == want
        seq.close()
        dseq.close()
        assert_pools_full(target, drafter)


def test_verify_with_wrong_drafter_sequence_state(pair):
    target, drafter = open_pair(pair)
    with target, drafter:
        prompt = tokens(11, 30)
        with target.new_sequence() as seq, drafter.new_sequence() as dseq:
            anchor = seq.prefill(prompt, capture=dseq)
            drafts = dseq.propose(anchor, len(prompt), 3)
            before = seq.info()
            wrong = [(d + 1) % VOCAB for d in drafts]
            raises("INVALID_ARGUMENT", seq.verify, [anchor, *wrong], drafter_seq=dseq)
            assert seq.info() == before
            accepted, _ = seq.verify([anchor, *drafts], drafter_seq=dseq)
            dseq.after_verify(accepted)
            assert dseq.info()["next_position"] == seq.info()["length"]
        assert_pools_full(target, drafter)


def test_target_pool_exhaustion(pair):
    target, drafter = open_pair(pair, dict(max_batch=1, max_seq_len=64))
    with target, drafter:
        total = target.pool_stats()["total_blocks"]
        assert total == 64 // BLOCK + 1
        a, b = target.new_sequence(), target.new_sequence()
        a.prefill(tokens(12, 64))
        assert target.pool_stats()["free_blocks"] == 1
        raises("POOL_EXHAUSTED", b.prefill, tokens(13, 17))  # needs 2 blocks, 1 free
        assert b.info()["length"] == 0 and b.info()["blocks_held"] == 0
        assert target.pool_stats()["free_blocks"] == 1
        anchor = b.prefill(tokens(13, 16))  # exactly one block
        assert target.pool_stats()["free_blocks"] == 0
        before = b.info()
        raises("POOL_EXHAUSTED", b.verify, [anchor])  # position 16 needs a second block
        assert b.info() == before
        a.close()
        assert target.pool_stats()["free_blocks"] == total - 1
        b.verify([anchor])
        b.close()
        assert_pools_full(target)


def test_drafter_pool_exhaustion_during_capture(pair):
    """The drafter's pool runs out while a prefill captures into it: the prefill fails as a whole (neither the
    target nor the drafter sequence changes), and everything is given back on close."""
    target, drafter = open_pair(pair, dict(max_batch=2, max_seq_len=64), dict(max_batch=1, max_seq_len=64))
    with target, drafter:
        total = drafter.pool_stats()["total_blocks"]
        ta, tb = target.new_sequence(), target.new_sequence()
        da, db = drafter.new_sequence(), drafter.new_sequence()
        ta.prefill(tokens(14, 60), capture=da)
        free = drafter.pool_stats()["free_blocks"]
        assert 0 < free < 3, drafter.pool_stats()
        t_before, d_before = tb.info(), db.info()
        raises("POOL_EXHAUSTED", tb.prefill, tokens(15, 48), capture=db)
        assert db.info() == d_before, f"drafter sequence changed: {d_before} -> {db.info()}"
        assert tb.info() == t_before, f"target sequence changed by a failed prefill: {t_before} -> {tb.info()}"
        assert drafter.pool_stats()["free_blocks"] == free
        for s in (ta, tb, da, db):
            s.close()
        assert_pools_full(target, drafter)
        assert total == drafter.pool_stats()["total_blocks"]


# --------------------------------------------------------------------------------------------------------------
# Equivalences
# --------------------------------------------------------------------------------------------------------------

def run_with_capture(target, drafter, prompt_parts, steps=6):
    """Prefill (in parts) with capture, then propose/verify/after_verify; returns (tokens, drafts, hiddens)."""
    out, drafts_seen, hiddens = [], [], []
    with target.new_sequence() as seq, drafter.new_sequence() as dseq:
        for part in prompt_parts:
            anchor = seq.prefill(part, capture=dseq)
        out.append(anchor)
        for _ in range(steps):
            position = seq.info()["length"]
            drafts = dseq.propose(out[-1], position, 3)
            hiddens.append(dseq.read_hidden().copy())
            drafts_seen.append(list(drafts))
            accepted, nxt = seq.verify([out[-1], *drafts], drafter_seq=dseq)
            dseq.after_verify(accepted)
            out += [*drafts[:accepted], nxt]
    return out, drafts_seen, hiddens


def test_prefill_chunking_is_invisible(pair):
    target_dir, _ = pair
    prompt = tokens(16, 75)
    results = {}
    for chunk in (256, 16, 7, 1):
        target, drafter = open_pair(pair, dict(prefill_chunk=chunk))
        with target, drafter:
            out, drafts, hiddens = run_with_capture(target, drafter, [prompt])
            greedy = pydflash.generate(target, drafter, prompt, 30)
            sampled = pydflash.generate(target, drafter, prompt, 30, temperature=0.9, seed=5, draft_mode="sample")
            results[chunk] = (out, drafts, hiddens, list(greedy.output_ids), list(greedy.acceptance_lengths),
                              list(sampled.output_ids))
            assert_pools_full(target, drafter)
    ref = results[256]
    target, drafter = open_pair(pair)  # no prefill_chunk: the library's default
    with target, drafter:
        assert target.prefill_chunk == 512
    for chunk, got in results.items():
        assert got[0] == ref[0] and got[1] == ref[1], f"prefill_chunk {chunk}: tokens/drafts differ"
        for a, b in zip(got[2], ref[2]):
            np.testing.assert_array_equal(a, b, err_msg=f"prefill_chunk {chunk}: drafter hidden differs")
        assert got[3:] == ref[3:], f"prefill_chunk {chunk}: generate differs"
    assert ref[3] == oracle.target_greedy(target_dir, prompt, 30)


@pytest.mark.parametrize("split", [1, 15, 16, 17, 40])
def test_two_prefills_equal_one(pair, split):
    prompt = tokens(17, 41)
    target, drafter = open_pair(pair, dict(prefill_chunk=7))
    with target, drafter:
        one = run_with_capture(target, drafter, [prompt])
        two = run_with_capture(target, drafter, [prompt[:split], prompt[split:]])
        assert two[0] == one[0] and two[1] == one[1]
        for a, b in zip(two[2], one[2]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        # The first prefill's token is a real prediction too (the greedy token after prompt[:split]).
        with target.new_sequence() as seq:
            assert seq.prefill(prompt[:split]) == oracle.target_greedy(pair[0], prompt[:split], 1)[0]
        assert_pools_full(target, drafter)


def test_verify_one_row_is_autoregressive(pair):
    target_dir, _ = pair
    prompt = tokens(18, 29)
    want = oracle.target_greedy(target_dir, prompt, 25)
    target, drafter = open_pair(pair)
    with target, drafter:
        with target.new_sequence() as seq:
            got = continue_greedy(seq, seq.prefill(prompt), 24)
            assert seq.info()["length"] == len(prompt) + 24 and seq.info()["steps"] == 25
        assert got == want
        # Token-by-token prefill (the other single-row path) agrees.
        with target.new_sequence() as seq:
            chain = [seq.prefill(prompt)]
            for _ in range(24):
                chain.append(seq.prefill([chain[-1]]))
        assert chain == want
        assert list(pydflash.generate(target, None, prompt, 25).output_ids) == want
        # Sampled single-row verifies follow the seed, not the path: AR sampling through generate twice agrees.
        a = pydflash.generate(target, None, prompt, 25, temperature=1.0, seed=9).output_ids
        b = pydflash.generate(target, None, prompt, 25, temperature=1.0, seed=9).output_ids
        assert list(a) == list(b)
        assert_pools_full(target, drafter)
