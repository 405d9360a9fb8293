"""Text <-> token ids for the CLI: a target's tokenizer.json (through the optional `tokenizers` package, the
`pydflash[text]` extra), or raw UTF-8 bytes for byte-level models such as the embedded default.

The library itself only ever sees token ids; nothing here is needed to use pydflash from Python.
"""

import json
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    """No tokenizer can be had for a model (and why); pass token ids instead."""


class ByteTokenizer:
    """Ids 0..255 are the bytes of UTF-8 text; ids from 256 up are special tokens (EOS, the drafter's mask, ...).

    decode() drops special tokens (or names them) and replaces bytes that do not form valid UTF-8, so any id
    sequence decodes: a model's output need not be valid UTF-8.
    """

    def __init__(self, vocab_size, special_tokens=None):
        if vocab_size < 256:
            raise TokenizerError(f"a byte-level tokenizer needs vocab_size >= 256, got {vocab_size}")
        self.vocab_size = vocab_size
        self.special_tokens = dict(special_tokens or {})  # {id: name}, for decode(skip_special_tokens=False)

    def encode(self, text) -> list:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True) -> str:
        out, pending = [], bytearray()
        for token in ids:
            if 0 <= token < 256:
                pending.append(token)
                continue
            if skip_special_tokens:
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            out.append(self.special_tokens.get(token, f"<|{token}|>"))
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self):
        return f"<pydflash.ByteTokenizer vocab_size={self.vocab_size}>"


class HFTokenizer:
    """A Hugging Face tokenizer.json, through the `tokenizers` package (special tokens as its post-processor
    adds them, as transformers' AutoTokenizer does by default)."""

    def __init__(self, path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError(f"{path} needs the `tokenizers` package: pip install 'pydflash[text]' "
                                 f"(or pass token ids)") from None
        self.path = str(path)
        try:
            self._tokenizer = Tokenizer.from_file(self.path)
        except Exception as e:  # tokenizers raises its own exception type for malformed files
            raise TokenizerError(f"{path}: unreadable tokenizer ({e})") from None

    def encode(self, text) -> list:
        return list(self._tokenizer.encode(text).ids)

    def decode(self, ids, skip_special_tokens=True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __repr__(self):
        return f"<pydflash.HFTokenizer {self.path}>"


def load_tokenizer(target_dir, vocab_size):
    """The tokenizer of a target checkpoint: its tokenizer.json when present, else bytes (vocab_size >= 256,
    special tokens named from config.json's eos_token_id). TokenizerError says why none fits."""
    directory = Path(target_dir)
    if (directory / TOKENIZER_FILE).is_file():
        return HFTokenizer(directory / TOKENIZER_FILE)
    if vocab_size < 256:
        raise TokenizerError(f"{directory} has no {TOKENIZER_FILE} and its vocab_size {vocab_size} < 256 cannot "
                             f"hold bytes; pass token ids")
    special = {}
    try:
        eos = json.loads((directory / "config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        eos = None
    for token in eos if isinstance(eos, list) else [eos]:
        if isinstance(token, int) and token >= 256:
            special[token] = "<|eos|>"
    return ByteTokenizer(vocab_size, special)
