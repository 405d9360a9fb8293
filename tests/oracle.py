"""Reference harness: Z Lab's `dflash` + transformers Qwen3 on CPU in fp32, shaped like pydflash's per-sequence API.

Tests import this module only behind `pytest.importorskip("torch")`; nothing else in the package depends on it.
"""

import functools

import numpy as np
import torch
import transformers
from dflash import model as dfm
from torch.nn import functional as F


@functools.lru_cache(maxsize=None)
def load_target(target_dir):
    """Qwen3ForCausalLM in fp32, eval mode; cached per directory (models are only read, never mutated)."""
    return transformers.Qwen3ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()


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
