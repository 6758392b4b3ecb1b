"""Text <-> token ids for the vocabularies mpicube knows by size.

* 256: the byte-level tokenizer of ``mpicube prepare`` (``data.encode_bytes``);
* 50257: GPT-2's BPE, through ``tiktoken`` (an optional extra) when it is
  installed and its ``gpt2`` encoding is on this machine (tiktoken fetches
  it on first use and caches it; mpicube never downloads anything itself).

Any other vocabulary has no tokenizer here: such models take and give
token ids.
"""

from __future__ import annotations

from ..core.errors import UserError

GPT2_VOCAB = 50257
GPT2_EOT = 50256             # <|endoftext|>
BYTE_VOCAB = 256


class ByteTokenizer:
    name = "bytes"
    vocab_size = BYTE_VOCAB
    start = [10]             # a newline: where a source file's next line begins

    def encode(self, text: str) -> list:
        from .data import encode_bytes

        return [int(t) for t in encode_bytes(text.encode("utf-8"))]

    def decode(self, tokens) -> str:
        from .data import decode_tokens

        return decode_tokens(tokens)


class GPT2Tokenizer:
    """GPT-2's byte-pair encoding from tiktoken."""

    name = "gpt2"
    vocab_size = GPT2_VOCAB
    start = [GPT2_EOT]       # a new document, as GPT-2 was trained

    def __init__(self):
        try:
            import tiktoken
        except ImportError:
            raise UserError("GPT-2's tokenizer needs tiktoken (pip install 'mpicube[gpt2]'); without it pass "
                            "token ids (--prompt-tokens)") from None
        try:
            self.enc = tiktoken.get_encoding("gpt2")
        except Exception as e:  # noqa: BLE001 - a download attempt without network fails many ways
            raise UserError(f"tiktoken's 'gpt2' encoding is not available on this machine ({type(e).__name__}); "
                            "run tiktoken once where it can fetch it (or copy its cache and set "
                            "TIKTOKEN_CACHE_DIR), or pass token ids (--prompt-tokens)") from None

    def encode(self, text: str) -> list:
        return self.enc.encode(text, allowed_special={"<|endoftext|>"})

    def decode(self, tokens) -> str:
        return self.enc.decode([int(t) for t in tokens])


def name_for(vocab_size: int):
    """"bytes", "gpt2" or None: the tokenizer a vocabulary of this size uses."""
    return {BYTE_VOCAB: "bytes", GPT2_VOCAB: "gpt2"}.get(int(vocab_size))


def load(name: str):
    """The tokenizer called ``name``; UserError if it cannot be used here."""
    if name == "bytes":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer()
    raise UserError(f"unknown tokenizer {name!r}; choose bytes or gpt2")
