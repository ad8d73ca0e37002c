"""Incremental detokenisation (engine/detokenizer.py): the Rust DecodeStream path of fast tokenizers and the
window path give the text a full decode gives, however the tokens split multi-byte characters. (Invalid UTF-8 in
the middle of an output, which a model can emit, is where the two paths may differ: each drops some U+FFFD.)"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from rimuru.engine.detokenizer import _rust_backend, detokenize_incrementally
from rimuru.testing.tiny_models import make_tokenizer


class SlowView:
    """The same tokenizer seen without its Rust backend: forces the window path."""

    def __init__(self, tok: object) -> None:
        self.decode = tok.decode  # type: ignore[attr-defined]


def _request() -> SimpleNamespace:
    return SimpleNamespace(output_token_ids=[], prefix_offset=0, read_offset=0, decode_stream=None)


@pytest.mark.parametrize("seed", range(5))
def test_stream_and_window_paths_equal_a_full_decode(seed: int) -> None:
    tok = make_tokenizer()
    assert _rust_backend(tok) is not None and _rust_backend(SlowView(tok)) is None
    text = "naïve café — 你好 🎉 x**2 " * 3
    ids = tok.encode(text, add_special_tokens=False)  # byte-level BPE: multi-byte characters span tokens
    assert len(ids) > len(text) // 2
    rng = random.Random(seed)
    for view in (tok, SlowView(tok)):
        req, pieces = _request(), []
        i = 0
        while i < len(ids):  # one token per step, sometimes several (a request that was not processed)
            n = rng.choice((1, 1, 1, 2, 3))
            req.output_token_ids += ids[i : i + n]
            pieces.append(detokenize_incrementally(view, req, skip_special_tokens=True))
            i += n
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
        assert sum(1 for p in pieces if p == "") > 0  # steps that ended inside a character emitted nothing


def test_tokenizers_that_clean_up_spaces_take_the_window_path() -> None:
    tok = make_tokenizer()
    tok.clean_up_tokenization_spaces = True  # decode() then edits spaces, which DecodeStream does not do
    assert _rust_backend(tok) is None


class FailingStream:
    def __init__(self, fail_at: int) -> None:
        self.calls, self.fail_at = 0, fail_at

    def step(self, backend: object, token: int) -> str | None:
        self.calls += 1
        if self.calls > self.fail_at:
            raise RuntimeError("Invalid prefix encountered")
        return None  # holds everything back, like an unfinished character


def test_a_failing_decode_stream_hands_over_to_the_window_path() -> None:
    tok = make_tokenizer()
    text = "hello world, again"
    ids = tok.encode(text, add_special_tokens=False)
    req = _request()
    req.decode_stream = FailingStream(fail_at=0)  # fails on the first token
    pieces = []
    for t in ids:
        req.output_token_ids.append(t)
        pieces.append(detokenize_incrementally(tok, req, skip_special_tokens=True))
    assert req.decode_stream is False and "".join(pieces) == text
