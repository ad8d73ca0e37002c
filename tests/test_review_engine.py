"""Review regressions for the engine: edge cases of stop strings, page accounting and sampling."""

from __future__ import annotations

import pytest

from rimuru.engine.llm import LLM
from rimuru.engine.sampling_params import SamplingParams


def _stream(llm: LLM, rid: str, prompt: str, params: SamplingParams) -> list:
    eng = llm.engine
    eng.add_request(rid, prompt, params)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


def test_streamed_text_never_retracts_a_stop_string_split_over_tokens(llm: LLM) -> None:
    """A stop string whose first characters arrive one token before the rest: the text of every running
    output must stay a prefix of the final text (as vLLM's stop buffer), else a streaming client has
    already been sent the first part of the stop string that the final text cuts off."""
    prompt = "Hello world! How are"
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = llm.generate(prompt, greedy)[0].outputs[0]
    tok = llm.get_tokenizer()
    texts = [tok.decode(full.token_ids[:k], skip_special_tokens=True) for k in range(len(full.token_ids) + 1)]
    stop = None
    for k in range(2, len(texts) - 1):  # last char of token k's text + first char of token k+1's text
        a, b = texts[k], texts[k + 1]
        if len(a) > len(texts[k - 1]) and len(b) > len(a):
            cand = a[-1] + b[len(a)]
            if cand.strip() and "\ufffd" not in cand and b.find(cand) == len(a) - 1:
                stop = cand
                break
    assert stop is not None, f"no token boundary to split a stop string over in {texts[-1]!r}"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    outs = _stream(llm, "split-stop", prompt, params)
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == full.text[: full.text.index(stop)]
    for o in outs[:-1]:
        assert final.text.startswith(o.outputs[0].text), (o.outputs[0].text, final.text)


def _tight_elastic(path, kv_blocks: int, limit: int, **kw) -> LLM:
    probe = LLM(str(path), gpu_memory_budget="64MiB", device="cpu", **kw)
    split, geo = probe.engine.budget_split, probe.engine.geometry
    per_block = probe.engine.kv.num_layers * geo.size("kv")
    budget = (split["non_expert_weights"] + split["workspace"] + split["experts_resident"]
              + 2 * 3 * limit * geo.size("expert") + kv_blocks * per_block + geo.huge_size)
    return LLM(str(path), gpu_memory_budget=budget, device="cpu", offload_mode="elastic", offload_access="copy",
               adjuster="paper", expert_offload_limit=limit, **kw)


@pytest.mark.parametrize("max_batched", [64, 7])
def test_elastic_aborts_preemptions_and_stalls_leak_no_page(tiny_checkpoint, max_batched: int) -> None:
    """Random aborts while requests run, stall for evictions, get preempted and chunk their prefills: every
    request ends, in bounded steps, and every page comes back (KV empty, expert pages = 3 per resident expert
    + the load buffers, nothing pending)."""
    import random

    from rimuru.experts.residency import EXPERT

    limit = 4
    llm = _tight_elastic(tiny_checkpoint("qwen2_moe"), kv_blocks=6, limit=limit,
                         max_num_batched_tokens=max_batched, max_num_seqs=6)
    eng = llm.engine
    rng = random.Random(max_batched)
    finished: dict[str, str] = {}
    live: list[str] = []
    for i in range(24):
        rid = f"r{i}"
        ids = [rng.randrange(3, 300) for _ in range(rng.randrange(4, 40))]
        seed = rng.choice([None, i])
        eng.add_request(rid, ids, SamplingParams(max_tokens=rng.randrange(1, 30), temperature=rng.choice([0.0, 1.0]),
                                                 seed=seed, ignore_eos=True))
        live.append(rid)
    steps = 0
    while eng.has_unfinished_requests():
        steps += 1
        assert steps < 3000, "requests stalled"
        if rng.random() < 0.08 and live:
            eng.abort_request(live[rng.randrange(len(live))])
        for o in eng.step():
            if o.finished:
                assert o.request_id not in finished
                finished[o.request_id] = o.outputs[0].finish_reason
                live.remove(o.request_id)
        eng.pool.allocator.check_invariants()
    assert len(finished) == 24
    alloc = eng.pool.allocator
    eng.kv.check()  # KV pages left are the prefix cache's, held by no request
    assert eng.kv.pages_in_use == 0 and alloc.num_used("kv") == eng.kv.num_cached_pages
    eng.reset_prefix_cache()
    assert alloc.num_used("kv") == 0
    assert alloc.pending_deferred == 0
    # a grow decided in the last step stays reserved until the next step commits it
    in_flight = len(eng.runtime.cache.residency.growing)
    assert alloc.num_used(EXPERT) == 3 * (eng.runtime.cache.num_resident + in_flight) + 2 * 3 * limit
    eng.runtime.cache.residency.check()
    assert eng.stats()["expert_evictions"] > 0  # the pool was tight enough to move experts


def test_top_p_one_cuts_no_token_when_the_batch_has_cuts() -> None:
    """A row with top_p = 1.0 (and no top-k) in a batch where another row cuts must keep its whole
    distribution: float32 cumulative sums reach 1.0 before the tail of a peaked distribution, so cutting
    it at p = 1.0 would drop those tokens (a seeded request's draws would then depend on its batch-mates)."""
    import torch

    from rimuru.engine.sampler import _apply_top_k_top_p

    torch.manual_seed(0)
    logits = torch.stack([torch.arange(300) * -0.3, torch.randn(300)])  # row 0: a geometric tail
    V = logits.shape[1]
    out = _apply_top_k_top_p(logits, torch.tensor([[V], [5]]), torch.tensor([[1.0], [1.0]]))
    assert torch.equal(out[0], logits[0])  # no cut asked: nothing cut
    assert torch.isfinite(out[1]).sum() == 5  # top-k still cuts
    out = _apply_top_k_top_p(logits, torch.tensor([[V]]), torch.tensor([[0.5]]))
    assert torch.isfinite(out).sum() >= 1  # top-p < 1 still cuts, keeping the best token


def test_seeded_request_draws_the_same_tokens_alone_and_in_a_batch(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 33, 80, 120, 7]}
    alone = llm.generate(prompt, seeded)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=0.7, top_k=5, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.3, top_p=0.8, ignore_eos=True)]
    outs = llm.generate([prompt, {"prompt_token_ids": [9, 9, 9]}, {"prompt_token_ids": [200] * 20},
                         {"prompt_token_ids": [44, 45]}], [seeded, *others])
    assert outs[0].outputs[0].token_ids == alone
