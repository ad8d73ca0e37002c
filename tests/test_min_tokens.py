"""`SamplingParams.min_tokens`, as vLLM's: before that many generated tokens EOS and stop_token_ids are masked out of
the logits (so they are never sampled, not merely ignored), and stop strings do not stop."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.engine.sampler import LogitEdits, Sampler

BUDGET = "64MiB"
PROMPTS = [[5, 17, 33, 80, 120], [7, 9, 11], [200, 3, 150, 42]]




def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_min_tokens_is_validated_as_vllm_does() -> None:
    assert SamplingParams().min_tokens == 0
    assert SamplingParams(min_tokens=16, max_tokens=16).min_tokens == 16
    assert SamplingParams(min_tokens=100, max_tokens=None).min_tokens == 100
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        SamplingParams(min_tokens=True)
    with pytest.raises(ValueError, match="less than or equal to max_tokens=4"):
        SamplingParams(min_tokens=5, max_tokens=4)


def _bans(rows_cols: list[tuple[int, int]]) -> LogitEdits:
    rows_cols = sorted(rows_cols)
    return LogitEdits([r for r, _ in rows_cols], torch.tensor(rows_cols, dtype=torch.int64).T.contiguous(),
                      torch.full((len(rows_cols),), float("-inf")))


def test_the_sampler_never_draws_a_banned_token_and_leaves_the_logits_alone() -> None:
    B, V = 70, 40  # three chunks of rows
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, V, generator=g)
    favourite = logits.argmax(dim=-1)
    logits[torch.arange(B), favourite] += 30.0  # every row all but certainly draws its argmax unless it is banned
    raw = logits.clone()
    banned_rows = [0, 31, 32, 33, 69]
    bans = _bans([(r, int(favourite[r])) for r in banned_rows] + [(33, 0), (33, 1)])
    sampler = Sampler(torch.device("cpu"), seed=0)

    all_greedy = [greedy(4)] * B
    out = sampler(logits, all_greedy, [None] * B, bans)
    masked = raw.clone()
    masked[bans.index[0], bans.index[1]] = float("-inf")
    assert torch.equal(out, masked.argmax(dim=-1))
    assert torch.equal(logits, raw)

    mixed = [greedy(4) if i % 3 == 0 else SamplingParams(max_tokens=4, temperature=0.7, top_k=5) for i in range(B)]
    for seed in range(5):
        sampler = Sampler(torch.device("cpu"), seed=seed)
        out = sampler(logits, mixed, [None] * B, bans)
        drawn = out[banned_rows]
        assert not torch.any(drawn == favourite[banned_rows]), seed
        assert int(out[33]) not in (0, 1)
        free = [i for i in range(B) if i not in banned_rows]
        assert torch.equal(out[free], favourite[free])  # rows without bans: as without any
        assert torch.equal(logits, raw)


def test_eos_cannot_end_a_request_before_min_tokens(ckpt: Path, llm: LLM, tmp_path: Path) -> None:
    """A checkpoint whose EOS is the very token greedy decoding picks first: it ends at once, unless min_tokens
    holds it off (then EOS is masked and another token is drawn)."""
    prompt = {"prompt_token_ids": PROMPTS[0]}
    first = llm.generate(prompt, greedy(1, ignore_eos=True))[0].outputs[0].token_ids[0]
    eos_first = tmp_path / "eos-first"
    eos_first.mkdir()
    for name in ("config.json", "generation_config.json"):  # no tokenizer: the config's EOS is the engine's
        d = json.loads((ckpt / name).read_text())
        d["eos_token_id"] = first
        (eos_first / name).write_text(json.dumps(d))
    for f in ckpt.glob("*.safetensors"):
        shutil.copy(f, eos_first / f.name)
    model = LLM(str(eos_first), gpu_memory_budget=BUDGET, device="cpu")
    assert model.engine.eos_token_id == first

    at_once = model.generate(prompt, greedy(16))[0].outputs[0]
    assert at_once.token_ids == [first] and at_once.finish_reason == "stop"
    for m in (1, 4, 9):
        out = model.generate(prompt, greedy(16, min_tokens=m))[0].outputs[0]
        assert first not in out.token_ids[:m] and len(out.token_ids) > m, (m, out.token_ids)
        if out.finish_reason == "stop":
            assert out.token_ids[-1] == first and first not in out.token_ids[:-1]
        else:
            assert len(out.token_ids) == 16
    held = model.generate(prompt, greedy(3, min_tokens=3))[0].outputs[0]
    assert first not in held.token_ids and held.finish_reason == "length"
    # sampled rows are masked the same way (the first token is EOS with near certainty at this temperature)
    for seed in range(4):
        out = model.generate(prompt, SamplingParams(max_tokens=8, temperature=0.2, seed=seed, min_tokens=5))[0]
        assert first not in out.outputs[0].token_ids[:5]
    model.shutdown()


def test_stop_token_ids_wait_for_min_tokens_in_sync_and_async_scheduling(ckpt: Path, llm: LLM) -> None:
    """Stop ids = every token greedy decoding produces: without min_tokens each prompt stops at its first token.
    With min_tokens = m they are masked for exactly m tokens: the token sampled by a pass still in flight (async
    scheduling) counts, so async gives the same tokens as sync, and some requests do stop at token m + 1."""
    free = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(12, ignore_eos=True))
    stops = [sorted(set(o.outputs[0].token_ids)) for o in free]
    requests = [({"prompt_token_ids": p}, greedy(16, stop_token_ids=s, min_tokens=m))
                for p, s in zip(PROMPTS, stops, strict=True) for m in range(7)]
    sync = llm.generate([r for r, _ in requests], [p for _, p in requests])
    async_llm = LLM(str(ckpt), gpu_memory_budget=BUDGET, device="cpu", async_scheduling=True)
    asynced = async_llm.generate([r for r, _ in requests], [p for _, p in requests])
    async_llm.shutdown()
    right_after = 0
    for (_, p), a, b in zip(requests, sync, asynced, strict=True):
        out = a.outputs[0]
        assert out.token_ids == b.outputs[0].token_ids
        assert not set(out.token_ids[: p.min_tokens]) & set(p.stop_token_ids)
        if p.min_tokens == 0:
            assert len(out.token_ids) == 1 and out.finish_reason == "stop"
        else:
            assert len(out.token_ids) > p.min_tokens
        right_after += out.finish_reason == "stop" and len(out.token_ids) == p.min_tokens + 1
    assert right_after >= 3  # the off-by-one that async scheduling could make would show here


def test_stop_strings_do_not_stop_before_min_tokens(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = llm.generate("Hello there", greedy(12, ignore_eos=True))[0].outputs[0].token_ids
    text = tok.decode(ids)
    # a stop string that the text holds once, as the whole text of token i
    i, stop = next((i, s) for i, s in enumerate(tok.decode([t]) for t in ids)
                   if i > 0 and s.isascii() and s.strip() and text.count(s) == 1)
    plain = llm.generate("Hello there", greedy(12, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert plain.finish_reason == "stop" and len(plain.token_ids) == i + 1 and plain.stop_reason == stop
    held = llm.generate("Hello there", greedy(12, ignore_eos=True, stop=[stop], min_tokens=i + 1))[0].outputs[0]
    assert held.finish_reason == "length" and held.token_ids == ids and stop in held.text
