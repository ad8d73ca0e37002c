"""Incremental detokenisation: new text for each new token without re-decoding the whole output.

Decoding a lone token can be wrong (byte-level BPE splits a character over tokens; SentencePiece
drops leading spaces), so each step decodes a short window that starts a few tokens back
(`prefix_offset`) and emits only what extends past the text already emitted (`read_offset`). A window
that ends in U+FFFD is an unfinished character: emit nothing until the next token completes it.
"""

from __future__ import annotations

from typing import Any

from rimuru.engine.request import Request

_WINDOW = 6  # tokens of left context decoded with each new token


def detokenize_incrementally(tokenizer: Any, request: Request, skip_special_tokens: bool) -> str:
    """Returns the text the newest output token adds, and advances the request's offsets."""
    ids = request.output_token_ids
    prefix = tokenizer.decode(ids[request.prefix_offset : request.read_offset],
                              skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[request.prefix_offset :], skip_special_tokens=skip_special_tokens)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        new_text = full[len(prefix) :]
        request.read_offset = len(ids)
        request.prefix_offset = max(request.prefix_offset, request.read_offset - _WINDOW)
        return new_text
    return ""
