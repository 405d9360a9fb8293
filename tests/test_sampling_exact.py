"""Exact sampling: with drafting, the first generated tokens are distributed exactly as the target's sampler.

Setup. A tiny target (vocabulary V = 20) and a random drafter. For each sampling setting (temperature, top_p,
top_k) and each way of drafting (native drafter with greedy one-hot proposals, native drafter sampling its own
proposals, the latter with block 2 so the bonus token is used, and an external drafter proposing the target's
argmax continuation, which is accepted often), `pydflash.generate` makes the first K = 3 new tokens N = 4000
times with seeds 0..N-1 (a fixed seed set: the test is deterministic).

Exact expectation. From transformers' fp32 logits of the prompt, of prompt + [t1] for every t1, and of
prompt + [t1, t2] for every (t1, t2), temperature / top-k / top-p are applied exactly as
`dflash.model._sampling_probs` does (re-implemented in float64 and checked against it), giving
P(t1, t2, t3) = p(t1) p(t2 | t1) p(t3 | t1, t2): the target's own sampling distribution, drafts or not.

Tests. Per (setting, drafting): Pearson chi-square of the observed counts of t1, of (t1, t2) and of
(t1, t2, t3) against N * P, bins with expected count < 5 merged (smallest first, by expectation only), p-value
from the chi-square survival function (torch.special.gammaincc). An outcome of expected probability 0 (outside
top-k / top-p) fails outright. The family-wise false-alarm rate is ALPHA = 1e-3 over all the module's
goodness-of-fit tests together (Bonferroni: each test rejects at p < ALPHA / NUM_TESTS); with the fixed seeds a
pass or fail is reproducible, and a correct sampler fails with probability below 1e-3 per seed set.

Power (negative controls that must be REJECTED at the same threshold): the same runs scored against the
distribution at a 20 % higher temperature, and the drafter's raw proposals (what "accept every draft" would
output) scored against the target's distribution.
"""
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
dfm = pytest.importorskip("dflash.model")

import make_checkpoint  # noqa: E402
import oracle  # noqa: E402
import pydflash  # noqa: E402

VOCAB = 20
K = 3                 # new tokens scored per run
N = 4000              # runs per (setting, drafting), seeds 0..N-1
MIN_EXPECTED = 5.0    # chi-square bins are merged until each expects at least this many
SETTINGS = {          # (temperature, top_p, top_k)
    "t1.0": (1.0, 1.0, 0),
    "t0.7_p0.9": (0.7, 0.9, 0),
    "t1.3_k5": (1.3, 1.0, 5),
    "t0.5_p0.8_k3": (0.5, 0.8, 3),
}
DRAFTING = {          # name: (drafter kind, draft_mode, generate's block_size)
    "greedy_b4": ("native", "greedy", None),
    "sample_b4": ("native", "sample", None),
    "sample_b2": ("native", "sample", 2),    # one draft: when accepted, t3 is the bonus token
    "argmax_b3": ("external", "greedy", 3),  # the target's argmax continuation, one-hot proposals
}
STATISTICS = ("t1", "t1_t2", "t1_t2_t3")
NUM_TESTS = len(SETTINGS) * len(DRAFTING) * len(STATISTICS)
ALPHA = 1e-3
THRESHOLD = ALPHA / NUM_TESTS  # per test (Bonferroni); the negative controls must fall below it too
CONDITION_GAP = 1e-5  # top-k / top-p boundaries closer than this (in probability / scaled logit) are ambiguous


# ----------------------------------------------------------------------------------------------------------------
# The target's exact sampling distribution
# ----------------------------------------------------------------------------------------------------------------

def sampling_probs(logits, temperature, top_p, top_k):
    """dflash.model._sampling_probs for one row, in float64 numpy: temperature, then top-k (softmax over the k
    largest), then top-p (keep sorted tokens while the mass BEFORE them is < top_p), renormalised."""
    scores = np.asarray(logits, np.float64) / temperature
    vocab = scores.shape[-1]
    indices = None
    if 0 < top_k < vocab:
        indices = np.argsort(-scores, kind="stable")[:top_k]
        scores = scores[indices]
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        keep = np.cumsum(sorted_probs) - sorted_probs < top_p
        probs = np.zeros_like(probs)
        probs[order] = sorted_probs * keep
        probs /= probs.sum()
    if indices is not None:
        full = np.zeros(vocab)
        full[indices] = probs
        probs = full
    return probs


def boundary_gap(logits, temperature, top_p, top_k):
    """How far this row is from a top-k / top-p decision flipping: the scaled-logit gap between the k-th and
    (k+1)-th token, and the distance of every cumulative mass from top_p. inf when neither applies."""
    scores = np.sort(np.asarray(logits, np.float64) / temperature)[::-1]
    gap = np.inf
    if 0 < top_k < scores.size:
        gap = scores[top_k - 1] - scores[top_k]
        scores = scores[:top_k]
    if top_p < 1.0:
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        gap = min(gap, np.abs(np.cumsum(probs) - probs - top_p).min())
    return gap


@torch.inference_mode()
def next_logits(target_dir, contexts):
    """fp32 logits of the token after each context (all of one length): [len(contexts), V]."""
    model = oracle.load_target(target_dir)
    return model(torch.tensor(contexts), use_cache=False).logits[:, -1].double().numpy()


def exact_joint(target_dir, prompt, setting):
    """P[t1, t2, t3] of the target's sampler, and the smallest boundary gap over every row it uses."""
    temperature, top_p, top_k = setting
    V = VOCAB
    l1 = next_logits(target_dir, [prompt])[0]
    l2 = next_logits(target_dir, [prompt + [a] for a in range(V)])
    l3 = next_logits(target_dir, [prompt + [a, b] for a in range(V) for b in range(V)]).reshape(V, V, V)
    p1 = sampling_probs(l1, *setting)
    p2 = np.stack([sampling_probs(l2[a], *setting) for a in range(V)])
    p3 = np.stack([[sampling_probs(l3[a, b], *setting) for b in range(V)] for a in range(V)])
    gaps = [boundary_gap(l1, *setting)]
    gaps += [boundary_gap(l2[a], *setting) for a in range(V) if p1[a] > 0]
    gaps += [boundary_gap(l3[a, b], *setting) for a in range(V) for b in range(V) if p1[a] * p2[a, b] > 0]
    # The float64 re-implementation is the reference's own function.
    ref = dfm._sampling_probs(torch.from_numpy(l3.reshape(-1, V)).float(), temperature, top_p, top_k)
    np.testing.assert_allclose(p3.reshape(-1, V), ref.double().numpy(), atol=2e-6)
    return p1[:, None, None] * p2[:, :, None] * p3, min(gaps)


def marginal(joint, statistic):
    return {"t1": joint.sum(axis=(1, 2)), "t1_t2": joint.sum(axis=2), "t1_t2_t3": joint}[statistic]


def counts_of(samples, statistic):
    width = len(statistic.split("_"))
    counts = np.zeros((VOCAB,) * width)
    np.add.at(counts, tuple(samples[:, :width].T), 1)
    return counts


def chi_square(counts, probs):
    """(p-value, statistic, degrees of freedom, note) of Pearson's test of counts against probs. Bins merge in
    ascending order of expectation until each group expects >= MIN_EXPECTED (a rule that never looks at the
    counts). An observation where probs is 0 gives p = 0."""
    counts, probs = np.ravel(counts), np.ravel(probs)
    n = counts.sum()
    impossible = np.flatnonzero((probs <= 0) & (counts > 0))
    if impossible.size:
        return 0.0, np.inf, 0, f"{int(counts[impossible].sum())} outcomes of probability 0 (bins {impossible[:5]})"
    order = np.argsort(probs * n, kind="stable")
    order = order[probs[order] > 0]
    groups, observed, expected = [], 0.0, 0.0
    for i in order:
        observed += counts[i]
        expected += probs[i] * n
        if expected >= MIN_EXPECTED:
            groups.append((observed, expected))
            observed = expected = 0.0
    if expected > 0:  # leftover small mass joins the last group
        o, e = groups.pop() if groups else (0.0, 0.0)
        groups.append((o + observed, e + expected))
    obs, exp = np.array(groups).T
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(groups) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64))) if df > 0 else 1.0
    return p, stat, df, f"{len(groups)} bins"


# ----------------------------------------------------------------------------------------------------------------
# Fixtures: one target + drafter, exact distributions, and the sampled runs (computed once, shared by tests)
# ----------------------------------------------------------------------------------------------------------------

class ArgmaxDrafter:
    """External drafter proposing the target's argmax continuation (from the precomputed tables)."""

    block_size = 3

    def __init__(self, prompt, argmax2, argmax3):
        self.prompt, self.argmax2, self.argmax3 = prompt, argmax2, argmax3

    def new_sequence(self, *args, **kwargs):
        return _ArgmaxSequence(self)


class _ArgmaxSequence:
    def __init__(self, owner):
        self.owner, self.anchors = owner, {}

    def propose(self, last_token, position, num_drafts, sampling=None):
        self.anchors[position] = last_token
        offset = position - len(self.owner.prompt)  # 0: anchor is t1; 1: anchor is t2
        if offset == 0:
            drafts = [int(self.owner.argmax2[last_token])]
            drafts.append(int(self.owner.argmax3[last_token, drafts[0]]))
        elif offset == 1:
            drafts = [int(self.owner.argmax3[self.anchors[position - 1], last_token])]
        else:
            drafts = [0] * num_drafts
        return (drafts + [0] * num_drafts)[:num_drafts]

    def after_verify(self, num_accepted):
        pass

    def close(self):
        pass


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    target_dir = make_checkpoint.make_target(str(root / "target"), vocab_size=VOCAB, hidden_size=32, num_layers=2,
                                             num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                                             seed=1, dtype="float32")
    draft_dir = make_checkpoint.make_drafter(str(root / "draft"), target_dir=target_dir, block_size=4,
                                             num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                             intermediate_size=64, seed=2, dtype="float32")
    # A prompt where no top-k / top-p boundary of any setting is ambiguous (fp32 vs float64 could flip it).
    rng = random.Random(0)
    for _ in range(20):
        prompt = [rng.randrange(VOCAB) for _ in range(4)]
        exact = {name: exact_joint(target_dir, prompt, s) for name, s in SETTINGS.items()}
        if min(gap for _, gap in exact.values()) > CONDITION_GAP:
            break
    else:
        raise AssertionError("no well-conditioned prompt found")
    l2 = next_logits(target_dir, [prompt + [a] for a in range(VOCAB)])
    l3 = next_logits(target_dir, [prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    argmax_drafter = ArgmaxDrafter(prompt, l2.argmax(-1), l3.argmax(-1).reshape(VOCAB, VOCAB))
    target = pydflash.Target.from_pretrained(target_dir, backend="host", max_seq_len=64)
    drafter = pydflash.Drafter.from_pretrained(draft_dir, target=target, max_seq_len=64)
    yield dict(target_dir=target_dir, prompt=prompt, exact={n: j for n, (j, _) in exact.items()}, target=target,
               drafter=drafter, argmax_drafter=argmax_drafter, runs={})
    drafter.close()
    target.close()


def sampled(setup, setting_name, drafting_name):
    """(tokens [N, K], first-step drafts [N, <=2] padded with -1, mean acceptance length), cached per pair."""
    key = (setting_name, drafting_name)
    if key not in setup["runs"]:
        temperature, top_p, top_k = SETTINGS[setting_name]
        kind, mode, block = DRAFTING[drafting_name]
        drafter = setup["drafter"] if kind == "native" else setup["argmax_drafter"]
        tokens = np.zeros((N, K), np.int64)
        drafts = np.full((N, 2), -1, np.int64)
        committed = 0
        for seed in range(N):
            result = pydflash.generate(setup["target"], drafter, setup["prompt"], K, temperature=temperature,
                                       top_p=top_p, top_k=top_k, seed=seed, block_size=block, draft_mode=mode)
            assert len(result.output_ids) == K, result
            tokens[seed] = result.output_ids
            first = list(result.drafts[0])[:2]
            drafts[seed, :len(first)] = first
            committed += len(result.acceptance_lengths)
        setup["runs"][key] = (tokens, drafts, (N * (K - 1)) / committed)
    return setup["runs"][key]


# ----------------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("drafting_name", sorted(DRAFTING))
@pytest.mark.parametrize("setting_name", sorted(SETTINGS))
def test_first_tokens_follow_the_target_distribution(setup, setting_name, drafting_name):
    tokens, _, mean_length = sampled(setup, setting_name, drafting_name)
    joint = setup["exact"][setting_name]
    failures = []
    for statistic in STATISTICS:
        p, stat, df, note = chi_square(counts_of(tokens, statistic), marginal(joint, statistic))
        if p < THRESHOLD:
            failures.append(f"{statistic}: chi2 {stat:.1f} on {df} df, p {p:.2e} < {THRESHOLD:.1e} ({note})")
    assert not failures, (f"setting {setting_name} {SETTINGS[setting_name]}, drafting {drafting_name} "
                          f"{DRAFTING[drafting_name]}, prompt {setup['prompt']}, seeds 0..{N - 1}, mean tokens per "
                          f"step {mean_length:.2f}: " + "; ".join(failures))


def test_drafting_is_actually_accepted(setup):
    """Not vacuous: in many runs t2 IS the accepted first draft (t2 == d1 exactly when d1 is accepted: on
    rejection the residual max(p - q, 0) is 0 at d1, for one-hot and sampled proposals alike)."""
    floors = {("t1.0", "greedy_b4"): 0.05, ("t1.0", "sample_b4"): 0.3, ("t1.0", "sample_b2"): 0.3,
              ("t1.0", "argmax_b3"): 0.12, ("t0.5_p0.8_k3", "argmax_b3"): 0.5}
    for (setting_name, drafting_name), floor in floors.items():
        tokens, drafts, _ = sampled(setup, setting_name, drafting_name)
        rate = float(np.mean(tokens[:, 1] == drafts[:, 0]))
        assert rate > floor, f"{drafting_name}: first draft accepted in {rate:.1%} of runs (< {floor:.0%})"


def test_negative_control_wrong_temperature_is_rejected(setup):
    """Power: the same samples scored against the distribution at a 20% higher temperature must fail."""
    for setting_name in ("t1.0", "t0.7_p0.9"):
        temperature, top_p, top_k = SETTINGS[setting_name]
        wrong, _ = exact_joint(setup["target_dir"], setup["prompt"], (temperature * 1.2, top_p, top_k))
        tokens, _, _ = sampled(setup, setting_name, "sample_b4")
        p, stat, df, note = chi_square(counts_of(tokens, "t1_t2_t3"), wrong)
        assert p < THRESHOLD, f"{setting_name}: a 20% temperature error went unnoticed (p {p:.2e}, {note})"


def test_negative_control_unrejected_proposals_are_rejected(setup):
    """Power: the drafter's own sampled proposals (what accepting every draft would output) are NOT distributed
    as the target's sampler, and the test says so."""
    for setting_name in ("t1.0", "t1.3_k5"):
        tokens, drafts, _ = sampled(setup, setting_name, "sample_b4")
        proposed = np.concatenate([tokens[:, :1], drafts], axis=1)
        assert (proposed >= 0).all()
        p, stat, df, note = chi_square(counts_of(proposed, "t1_t2_t3"), setup["exact"][setting_name])
        assert p < THRESHOLD, f"{setting_name}: raw proposals passed as target samples (p {p:.2e}, {note})"


def test_chi_square_machinery(setup):
    """The scorer itself: exact draws from the expected distribution pass; an impossible outcome fails."""
    rng = np.random.default_rng(0)
    joint = setup["exact"]["t0.5_p0.8_k3"]
    flat = rng.choice(joint.size, size=N, p=joint.ravel() / joint.sum())
    draws = np.stack(np.unravel_index(flat, joint.shape), axis=1)
    for statistic in STATISTICS:
        p, *_ = chi_square(counts_of(draws, statistic), marginal(joint, statistic))
        assert p > 1e-3, (statistic, p)
    zero = np.argwhere(joint == 0)[0]
    draws[0] = zero
    p, _, _, note = chi_square(counts_of(draws, "t1_t2_t3"), joint)
    assert p == 0.0 and "probability 0" in note


def test_seeded_runs_are_reproducible(setup):
    target, drafter, prompt = setup["target"], setup["drafter"], setup["prompt"]
    for mode in ("greedy", "sample"):
        a = pydflash.generate(target, drafter, prompt, 12, temperature=0.9, top_p=0.95, seed=123, draft_mode=mode)
        b = pydflash.generate(target, drafter, prompt, 12, temperature=0.9, top_p=0.95, seed=123, draft_mode=mode)
        assert list(a.output_ids) == list(b.output_ids) and list(a.acceptance_lengths) == list(b.acceptance_lengths)
        assert [list(d) for d in a.drafts] == [list(d) for d in b.drafts]
        others = {tuple(pydflash.generate(target, drafter, prompt, 12, temperature=0.9, seed=s,
                                          draft_mode=mode).output_ids) for s in range(8)}
        assert len(others) > 1, "different seeds gave identical outputs"
    stats = target.pool_stats()
    assert stats["free_blocks"] == stats["total_blocks"]


@pytest.mark.slow
@pytest.mark.parametrize("drafting_name", ["sample_b4", "greedy_b4"])
def test_first_tokens_follow_the_target_distribution_heavy(setup, drafting_name):
    """10x the samples for one setting: sensitive to biases of about a third the size."""
    temperature, top_p, top_k = SETTINGS["t1.0"]
    kind, mode, block = DRAFTING[drafting_name]
    n = 10 * N
    tokens = np.zeros((n, K), np.int64)
    for seed in range(n):
        tokens[seed] = pydflash.generate(setup["target"], setup["drafter"], setup["prompt"], K,
                                         temperature=temperature, top_p=top_p, top_k=top_k, seed=N + seed,
                                         block_size=block, draft_mode=mode).output_ids
    for statistic in STATISTICS:
        p, stat, df, note = chi_square(counts_of(tokens, statistic), marginal(setup["exact"]["t1.0"], statistic))
        assert p >= THRESHOLD, f"{drafting_name} {statistic}: chi2 {stat:.1f} on {df} df, p {p:.2e} ({note})"
