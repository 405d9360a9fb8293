"""Reference harness: Z Lab's `dflash` + transformers (Qwen3 / Llama) on CPU in fp32, shaped like pydflash's
per-sequence API, plus whole-generation oracles (`target_greedy`, `reference_dflash_generate`).

Tests import this module only behind `pytest.importorskip("torch")`; nothing else in the package depends on it.
"""

import functools
import time

import numpy as np
import torch
import transformers
from dflash import model as dfm
from torch.nn import functional as F


@functools.lru_cache(maxsize=None)
def load_target(target_dir):
    """The checkpoint's causal LM (Qwen3ForCausalLM or LlamaForCausalLM, per config.json) in fp32, eval mode;
    cached per directory (models are only read, never mutated)."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def load_drafter(draft_dir):
    """DFlashDraftModel in fp32, eval mode; cached per directory (its KV cache lives outside the module)."""
    return dfm.DFlashDraftModel.from_pretrained(str(draft_dir), dtype=torch.float32).eval()


@torch.inference_mode()
def target_features(target_dir, token_ids, layer_ids):
    """Context features of a full (uncached) target forward: float32 [n, len(layer_ids) * H]."""
    target = load_target(target_dir)
    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))[None]
    out = target(ids, output_hidden_states=True, use_cache=False)
    return dfm.extract_context_feature(out.hidden_states, list(layer_ids))[0].numpy().astype(np.float32)


def _keep_newest(cache, n):
    """Keep only the newest n entries of every layer's K/V (DynamicCache layers: keys/values [b, kv, seq, d])."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None:
            start = max(0, layer.keys.shape[-2] - n)
            layer.keys = layer.keys[..., start:, :]
            layer.values = layer.values[..., start:, :]


class ReferenceDrafter:
    """One sequence of the drafter, computed exactly as the drafter half of `dflash.model.dflash_generate`.

    Context rows arrive with `append_context` (row k of the sequence has position k) and stay pending until the
    next `propose`, which feeds them together with the noise block through the model, keeps their K/V in the
    draft cache and drops the block's K/V again (the reference's `_crop_to`).

    ctx_window W > 0 emulates the engine's window cap, under which attention sees only the newest W context
    rows. Before the forward, at most the last W pending rows are fed (with their own positions) and the cache
    is trimmed to its newest max(0, W - n_fed) rows; after the forward, the cache is cut back to the newest W
    context rows. The rows kept are always the contiguous tail of the context, so key index differences still
    equal position differences, and the reference's index-based causal/sliding masks (`_attention_mask`)
    remain right. ctx_window=0 means no cap and is the plain reference.
    """

    def __init__(self, draft_dir, target_dir, ctx_window=0):
        self.model = load_drafter(draft_dir)
        target = load_target(target_dir)
        self.embed = target.get_input_embeddings().weight
        self.head = dfm._output_head(target)  # lm_head; for tied targets it shares embed_tokens' weight
        self.config = self.model.config
        self.block_size = self.model.block_size
        self.mask_token_id = int(self.model.mask_token_id)
        self.embed_scale = float(dfm._draft_value(self.config, "input_embedding_scale", 1.0))
        self.ctx_window = int(ctx_window)
        self.cache = dfm._make_cache(self.config)
        self.feature_dim = len(self.model.target_layer_ids) * self.config.hidden_size
        self.pending = np.zeros((0, self.feature_dim), np.float32)
        self.num_rows = 0  # context rows appended so far; the next row has this position
        self.last_logits = None  # float32 [B-1, vocab] of the latest propose, for tolerance checks
        self.last_num_drafts = 0
        self.num_accepted = []

    def append_context(self, features):
        features = np.asarray(features, dtype=np.float32)
        assert features.ndim == 2 and features.shape[1] == self.feature_dim, features.shape
        self.pending = np.concatenate([self.pending, features])
        self.num_rows += features.shape[0]

    @torch.inference_mode()
    def propose(self, last_token, position, num_drafts):
        """Returns (drafts: list[int] of length B-1, hidden: float32 [B-1, H]), B = clamp(num_drafts+1, 2, block)."""
        assert position == self.num_rows, f"position {position} != context rows {self.num_rows}"
        B = max(2, min(num_drafts + 1, self.block_size))
        fed = self.pending
        if self.ctx_window > 0:
            fed = fed[-self.ctx_window:]
            _keep_newest(self.cache, max(0, self.ctx_window - fed.shape[0]))
        ids = torch.tensor([[last_token] + [self.mask_token_id] * (B - 1)])
        noise = F.embedding(ids, self.embed) * self.embed_scale
        hidden = self.model(
            target_hidden=torch.from_numpy(fed)[None],
            noise_embedding=noise,
            position_ids=torch.arange(position - fed.shape[0], position + B)[None],
            past_key_values=self.cache,
            use_cache=True,
        )[:, 1 - B:, :]
        self.cache.crop(-B)  # drop the block's K/V; only context K/V persists (the reference's _crop_to)
        if self.ctx_window > 0:
            _keep_newest(self.cache, self.ctx_window)
        logits = self.model.compute_logits(hidden, self.head)
        self.pending = self.pending[:0]
        self.last_logits = logits[0].numpy().astype(np.float32)
        self.last_num_drafts = B - 1
        return torch.argmax(logits, dim=-1)[0].tolist(), hidden[0].numpy().astype(np.float32)

    def after_verify(self, num_accepted):
        """Bookkeeping only: the accepted tokens' features come in through append_context."""
        assert 0 <= num_accepted <= self.last_num_drafts, (num_accepted, self.last_num_drafts)
        self.num_accepted.append(int(num_accepted))


def _cut_at_stop(new_ids, stop_token_ids):
    """new_ids truncated at and including the first stop token (all of them when none occurs)."""
    stops = set(stop_token_ids or ())
    for i, token in enumerate(new_ids):
        if token in stops:
            return new_ids[:i + 1]
    return new_ids


@torch.inference_mode()
def target_greedy(target_dir, prompt_ids, max_new_tokens, stop_token_ids=None, *, with_margins=False):
    """The target's own greedy continuation by transformers' `generate` (fp32, do_sample=False): the NEW tokens
    only, truncated at and including the first stop token.

    Nothing from the checkpoint's generation defaults can cut or alter the run: the model's generation_config is
    swapped for a blank one for the call (transformers merges its eos_token_id into any config passed in, even
    an explicit eos_token_id=None), no eos is given, and exactly max_new_tokens tokens are generated (asserted)
    before the stop-token cut is applied here.

    with_margins=True also returns, per returned token, the gap between the top two logits of the row that chose
    it divided by that row's largest |logit|: a near-tie (tiny margin) is where two correct fp32
    implementations may legitimately pick different tokens.
    """
    model = load_target(target_dir)
    ids = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64))[None]
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=int(max_new_tokens), num_beams=1,
                                           pad_token_id=0, eos_token_id=None, bos_token_id=None,
                                           output_scores=with_margins, return_dict_in_generate=True)
    saved, model.generation_config = model.generation_config, transformers.GenerationConfig()
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    finally:
        model.generation_config = saved
    new_ids = out.sequences[0, ids.shape[1]:].tolist()
    assert len(new_ids) == max_new_tokens, f"generate made {len(new_ids)} tokens, asked for {max_new_tokens}"
    new_ids = _cut_at_stop(new_ids, stop_token_ids)
    if not with_margins:
        return new_ids
    margins = []
    for scores in out.scores[:len(new_ids)]:
        top2 = torch.topk(scores[0].float(), 2).values
        margins.append(float((top2[0] - top2[1]) / scores[0].abs().max().clamp_min(1e-30)))
    return new_ids, margins


@torch.inference_mode()
def reference_dflash_generate(draft_dir, target_dir, prompt_ids, max_new_tokens, block_size=None,
                              stop_token_ids=None, *, with_details=False):
    """`dflash.model.dflash_generate` itself (greedy, return_stats=True) on the cached fp32 models.

    Returns (new_ids, acceptance_lengths): new_ids = its output minus the prompt. with_details=True adds a third
    item, {"drafts": each step's drafts (the drafter's argmax; [] for a step that drafted nothing),
    "min_margin": the smallest relative top-2 logit gap of any draft (inf when nothing was drafted)}: below ~1e-5
    another fp32 drafter may legitimately draft differently there.
    """
    drafter, target = load_drafter(draft_dir), load_target(target_dir)
    calls = []
    if with_details:
        compute_logits = drafter.compute_logits

        def recording(hidden, head):
            logits = compute_logits(hidden, head)
            top2 = torch.topk(logits[0].float(), 2, dim=-1).values
            scale = logits[0].float().abs().amax(dim=-1).clamp_min(1e-30)
            calls.append((logits[0].argmax(-1).tolist(), ((top2[:, 0] - top2[:, 1]) / scale).min().item()))
            return logits

        drafter.compute_logits = recording  # an instance attribute, removed again below
    # return_stats times with torch.cuda.synchronize(), which a CPU-only torch refuses: time on the CPU clock.
    cuda_time, dfm._cuda_time = dfm._cuda_time, time.perf_counter
    try:
        ids = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64))[None]
        stats = dfm.dflash_generate(drafter, target, ids, int(max_new_tokens),
                                    list(stop_token_ids) if stop_token_ids else None,
                                    block_size=block_size, return_stats=True)
    finally:
        dfm._cuda_time = cuda_time
        if with_details:
            del drafter.compute_logits
    new_ids = stats.output_ids[0, ids.shape[1]:].tolist()
    lengths = [int(n) for n in stats.acceptance_lengths]
    if not with_details:
        return new_ids, lengths
    # A step drafts (calls compute_logits) exactly when its block is wider than one row.
    width = block_size or drafter.block_size
    drafts, found, start = [], iter(calls), len(prompt_ids)
    max_length = len(prompt_ids) + int(max_new_tokens)
    for n in lengths:
        drafts.append(next(found)[0] if min(width, max_length - start) > 1 else [])
        start += n
    assert next(found, None) is None, "more drafter calls than steps"
    return new_ids, lengths, {"drafts": drafts, "min_margin": min((m for _, m in calls), default=float("inf"))}
