"""Incremental detokenisation: new text for each new token without re-decoding the whole output.

Decoding a lone token can be wrong (byte-level BPE splits a character over tokens; SentencePiece
drops leading spaces), so new text is what a decode of a short window of recent tokens adds past the
text already emitted; a window that ends in U+FFFD is an unfinished character and emits nothing until
the next token completes it.

Fast (Rust-backed) tokenizers do this in the `tokenizers` library's own `DecodeStream`, one per
request (2.2 µs per token instead of 11.9 µs for two Python-level `decode` calls with the Qwen
vocabulary on the development CPU, benchmarks/bench_detokenize.py; a step detokenises every running
request). Other tokenizers use the window here: `prefix_offset` is where the window starts,
`read_offset` where the emitted text ends.
"""

from __future__ import annotations

from typing import Any

from rimuru.engine.request import Request

try:
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - transformers always brings tokenizers
    Tokenizer = DecodeStream = None  # type: ignore[assignment,misc]

_WINDOW = 6  # tokens of left context decoded with each new token


def _rust_backend(tokenizer: Any) -> Any:
    """The tokenizer's Rust `Tokenizer` when DecodeStream gives what `tokenizer.decode` gives: not when decode also
    cleans up tokenization spaces (DecodeStream does not)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if Tokenizer is None or not isinstance(backend, Tokenizer):
        return None
    return None if getattr(tokenizer, "clean_up_tokenization_spaces", False) else backend


def detokenize_incrementally(tokenizer: Any, request: Request, skip_special_tokens: bool) -> str:
    """Returns the text the output tokens not yet detokenised add, and advances the request's state."""
    ids = request.output_token_ids
    backend = _rust_backend(tokenizer) if request.decode_stream is not False else None
    if backend is not None:
        stream = request.decode_stream
        if stream is None:
            stream = request.decode_stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        text = []
        for i in range(request.read_offset, len(ids)):
            try:
                piece = stream.step(backend, ids[i])
            except Exception:  # e.g. "Invalid prefix encountered" on byte-fallback vocabularies: the window path
                request.decode_stream = False  # takes over for this request from the text emitted so far
                request.prefix_offset = max(0, request.read_offset - _WINDOW)
                return "".join(text) + detokenize_incrementally(tokenizer, request, skip_special_tokens)
            request.read_offset = i + 1
            if piece:
                text.append(piece)
        return "".join(text)
    prefix = tokenizer.decode(ids[request.prefix_offset : request.read_offset],
                              skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[request.prefix_offset :], skip_special_tokens=skip_special_tokens)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        new_text = full[len(prefix) :]
        request.read_offset = len(ids)
        request.prefix_offset = max(request.prefix_offset, request.read_offset - _WINDOW)
        return new_text
    return ""
