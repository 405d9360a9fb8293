"""The speculative-decoding driver: prefill, then propose -> verify -> after_verify until done, then free.

It mirrors `dflash.model.dflash_generate` step for step (the same block widths near the end, the same
max_new_tokens and stop-token truncation, the same acceptance lengths), so for greedy inputs it returns exactly
the tokens the reference returns, and those are exactly the target's own greedy decode. The math (forward passes,
acceptance, rejection sampling, the bonus token) happens in the library; this loop only moves token ids.
"""

import contextlib
import operator
import secrets
import time
from dataclasses import asdict, dataclass, replace

from .drafter import Drafter
from .sampling import SamplingParams


@dataclass
class GenerationResult:
    """What one generate() call produced.

    output_ids: the new tokens only (dflash_generate's output_ids minus the prompt).
    acceptance_lengths: tokens committed per step, the bonus token included (dflash_generate's).
    drafts: each step's proposal (the tokens verified after the anchor); [] for plain autoregressive steps.
    time_to_first_token: seconds in prefill; decode_time: seconds in the step loop;
    tokens_per_second: len(output_ids) / (time_to_first_token + decode_time).
    """

    prompt_ids: list
    output_ids: list
    acceptance_lengths: list
    drafts: list
    num_steps: int
    time_to_first_token: float
    decode_time: float
    tokens_per_second: float
    mean_acceptance_length: float
    block_size: int = 1
    seed: int | None = None  # the seed used when sampling (drawn at random if none was given); None when greedy
    stopped: bool = False  # a stop token ended the output (it is the last output token)

    def to_dict(self) -> dict:
        return asdict(self)


def generate(target, drafter, prompt_ids, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=None,
             block_size=None, stop_token_ids=None, draft_mode="greedy") -> GenerationResult:
    """Generate up to max_new_tokens after prompt_ids with `target`, drafting with `drafter`.

    drafter: a pydflash.Drafter made with Drafter.from_pretrained(draft_dir, target=target); None (or
    block_size=1) for plain autoregressive decoding through the same target, the baseline for speedups; or any
    object with new_sequence() -> seq, seq.propose(last_token, position, num_drafts, sampling=None) -> list[int],
    seq.after_verify(num_accepted), seq.close() (its drafts are verified against a one-hot proposal).
    block_size: tokens per verify (anchor + drafts); default the drafter's trained block size, at most that.
    stop_token_ids: output ends at the first of these (included), as in dflash_generate; None = none (pass
    target.config.eos_token_ids to stop at EOS).
    temperature 0 is greedy (lossless: the target's own greedy decode); > 0 samples exactly from the target's
    temperature/top-p/top-k distribution, reproducibly from `seed` (None: a random seed, kept in the result).
    """
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=0 if seed is None else seed,
                              draft_mode=draft_mode)
    if seed is None and not sampling.greedy:
        sampling = replace(sampling, seed=secrets.randbits(63))
    prompt = checked_prompt(prompt_ids, target.config.vocab_size)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    block_size = _checked_block_size(target, drafter, block_size)
    max_length = len(prompt) + max_new_tokens
    _check_budget(target, drafter if block_size > 1 else None, len(prompt), max_length)
    stop = frozenset(int(t) for t in stop_token_ids) if stop_token_ids is not None else frozenset()
    native = isinstance(drafter, Drafter)
    chooser = None if sampling.greedy else sampling  # None: the library's greedy path, no sampling struct

    out = list(prompt)  # prompt, then every committed token; out[start] is the anchor of the next block
    acceptance_lengths, proposals = [], []
    with contextlib.ExitStack() as cleanup:  # frees the sequences (KV blocks) on success and on error
        target_seq = target.new_sequence(max_length)
        cleanup.callback(target_seq.close)
        draft_seq = None
        if block_size > 1:
            draft_seq = drafter.new_sequence(max_length) if native else drafter.new_sequence()
            cleanup.callback(draft_seq.close)

        prefill_start = time.perf_counter()
        # The prompt's hidden states go straight into the drafter's context (native drafters only).
        out.append(target_seq.prefill(prompt, chooser, capture=draft_seq if native else None))
        time_to_first_token = time.perf_counter() - prefill_start

        decode_start = time.perf_counter()
        start = len(prompt)
        stopped = out[start] in stop
        while start + 1 < max_length and not stopped:
            verify_size = min(block_size, max_length - start)  # narrower blocks near the end, as the reference
            drafts = []
            if verify_size > 1:
                drafts = list(draft_seq.propose(out[start], start, verify_size - 1, chooser))[:verify_size - 1]
            accepted, bonus = target_seq.verify([out[start], *drafts], chooser,
                                                drafter_seq=draft_seq if native and drafts else None)
            committed = [*drafts[:accepted], bonus]  # the tokens after the anchor, bonus last
            produced = min(accepted + 1, max_length - start - 1)
            hit = next((i for i, token in enumerate(committed[:produced]) if token in stop), None)
            if hit is not None:  # a stop token ends the output, itself included
                produced, stopped = hit + 1, True
            if produced < accepted + 1:  # the verify kept accepted + 1 rows; the cut ones leave the KV cache
                target_seq.rollback(accepted + 1 - produced)
            if drafts:
                draft_seq.after_verify(produced - 1)  # commits the anchor and produced - 1 drafts as context
            out.extend(committed[:produced])
            start += produced
            acceptance_lengths.append(produced)
            proposals.append(drafts)
        decode_time = time.perf_counter() - decode_start

    output = out[len(prompt):min(start + 1, max_length)]
    elapsed = time_to_first_token + decode_time
    return GenerationResult(
        prompt_ids=prompt, output_ids=output, acceptance_lengths=acceptance_lengths, drafts=proposals,
        num_steps=len(acceptance_lengths), time_to_first_token=time_to_first_token, decode_time=decode_time,
        tokens_per_second=len(output) / elapsed if elapsed > 0 else 0.0,
        mean_acceptance_length=sum(acceptance_lengths) / len(acceptance_lengths) if acceptance_lengths else 0.0,
        block_size=block_size, seed=None if sampling.greedy else sampling.seed, stopped=stopped)


def checked_prompt(prompt_ids, vocab_size):
    """The prompt as a list of ints in [0, vocab_size), or a ValueError naming the first bad id."""
    if isinstance(prompt_ids, (str, bytes)):
        raise TypeError("prompt_ids must be token ids (encode text with a tokenizer first)")
    try:
        prompt = [operator.index(t) for t in prompt_ids]  # ints and numpy integers; never a float silently cut
    except TypeError:
        raise TypeError(f"prompt_ids must be a sequence of ints, got {str(prompt_ids)[:80]}") from None
    if not prompt:
        raise ValueError("prompt_ids is empty (the first token needs at least one prompt token)")
    bad = next(((i, t) for i, t in enumerate(prompt) if not 0 <= t < vocab_size), None)
    if bad:
        raise ValueError(f"prompt token id {bad[1]} at index {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return prompt


def _checked_block_size(target, drafter, block_size):
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if drafter is None:
        if block_size not in (None, 1):
            raise ValueError(f"block_size {block_size} needs a drafter (drafter=None decodes one token per step)")
        return 1
    trained = getattr(drafter, "block_size", None)
    if block_size is None:
        if trained is None:
            raise ValueError("this drafter has no block_size attribute; pass block_size")
        block_size = trained
    if trained is not None and block_size > trained:
        raise ValueError(f"block_size {block_size} > the drafter's block_size {trained}")
    if block_size > 1 and isinstance(drafter, Drafter) and drafter.target is not target:
        raise ValueError("the drafter does not share this target; load it with "
                         "Drafter.from_pretrained(draft_dir, target=target)")
    if block_size > target.max_verify_rows:
        raise ValueError(f"block_size {block_size} > the target's max_verify_rows {target.max_verify_rows} "
                         f"(Target.from_pretrained(..., max_verify_rows=))")
    return block_size


def check_positions(config, prompt_len, max_new_tokens):
    """Every position a run may touch (prompt + max_new_tokens) must lie below the target's
    max_position_embeddings; a ValueError otherwise. Also used by the CLI before any weight is loaded."""
    limit, max_length = config.max_position_embeddings, prompt_len + max_new_tokens
    if prompt_len > limit:
        raise ValueError(f"prompt of {prompt_len} tokens is longer than the target's max_position_embeddings "
                         f"{limit}")
    if max_length > limit:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {max_length} "
                         f"exceeds the target's max_position_embeddings {limit}")


def _check_budget(target, drafter, prompt_len, max_length):
    """Sequences get budget max_length (every position the run may touch); refuse up front what cannot fit."""
    check_positions(target.config, prompt_len, max_length - prompt_len)
    if max_length > target.max_seq_len:
        raise ValueError(f"prompt + max_new_tokens = {max_length} exceeds the target's max_seq_len "
                         f"{target.max_seq_len} (Target.from_pretrained(..., max_seq_len=))")
    if isinstance(drafter, Drafter) and max_length > drafter.max_seq_len:
        raise ValueError(f"prompt + max_new_tokens = {max_length} exceeds the drafter's max_seq_len "
                         f"{drafter.max_seq_len} (Drafter.from_pretrained(..., max_seq_len=))")
