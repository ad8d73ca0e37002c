"""Presence, frequency and repetition penalties as vLLM computes them, checked against transformers: greedy decoding
with a repetition penalty is transformers' `generate(repetition_penalty=...)`, and every token of a penalised
decode (greedy, and the sampling path at top_k=1) is the argmax of transformers' logits with the penalties applied
by hand. The device table is checked against counts taken on the host, through slot reuse and an in-flight token;
a batch without penalties does no penalty work; bad values are refused naming the field, by the engine and by the
server (read by the official `openai` client)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.config import EngineConfig
from rimuru.engine import penalties as penalties_module
from rimuru.engine.llm_engine import LLMEngine
from rimuru.engine.penalties import PenaltyTable
from rimuru.engine.request import Request
from rimuru.server.app import ServerConfig
from rimuru.server.background import BackgroundServer
from rimuru.testing.reference import random_prompts

STEPS = 12
TIE = 1e-3  # top-2 logits closer than this may swap between two float32 computations of the same model


@pytest.fixture(scope="module")
def hf(ckpt: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def penalised(logits: torch.Tensor, prompt: list[int], output: list[int], rep: float, freq: float,
              pres: float) -> torch.Tensor:
    """vLLM's penalties on one row of logits [V], written out from their definition."""
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t)
        out[t] -= pres
    return out


def check_against_transformers(hf, prompt: list[int], got: list[int], rep: float = 1.0, freq: float = 0.0,
                               pres: float = 0.0) -> None:
    """Every token is the argmax of transformers' logits at its position, penalised by hand (or, where the
    reference's top two are within TIE, either of them; the rest of the sequence then differs legitimately)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + got]), use_cache=False).logits[0].float()  # [L, V]
    for i, token in enumerate(got):
        ref = penalised(logits[len(prompt) - 1 + i], prompt, got[:i], rep, freq, pres)
        top = ref.topk(2)
        if token != int(top.indices[0]):
            gap = float(top.values[0] - top.values[1])
            assert token == int(top.indices[1]) and gap < TIE, (i, token, top.indices.tolist(), gap, got)
            return


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, **kw)


def test_greedy_repetition_penalty_is_transformers_generate(ckpt: Path, llm: LLM, hf) -> None:
    prompts = random_prompts((5, 9, 14))
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                        greedy(repetition_penalty=1.3))]
    plain = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy())]
    assert got != plain  # the penalty changes these decodes: the comparison below means something
    for prompt, ours in zip(prompts, got, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, do_sample=False,
                              repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        if ours != ref:  # only after a near-tie of the penalised logits
            check_against_transformers(hf, prompt, ours, rep=1.3)


@pytest.mark.parametrize("rep,freq,pres", [(1.0, 0.7, 0.0), (1.0, 0.0, 1.5), (0.8, -0.5, 0.3), (1.2, 1.1, -2.0)])
def test_penalised_decodes_follow_transformers_logits(llm: LLM, hf, rep: float, freq: float, pres: float) -> None:
    """Greedy rows (the argmax path) and sampled rows at top_k=1 (the temperature / top-k path) in one batch."""
    prompts = random_prompts((6, 11))
    kw = {"repetition_penalty": rep, "frequency_penalty": freq, "presence_penalty": pres}
    sampled = SamplingParams(max_tokens=STEPS, temperature=0.9, top_k=1, seed=1, ignore_eos=True, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(**kw), sampled])
    for prompt, out in zip(prompts, outs, strict=True):
        check_against_transformers(hf, prompt, out.outputs[0].token_ids, rep, freq, pres)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_change_no_other_row_and_survive_chunked_prefill(ckpt: Path, async_scheduling: bool) -> None:
    """A penalised request among plain ones (greedy and seeded): the plain rows' tokens are those of a batch without
    penalties; the penalised one's are those it gets alone; prefill is cut into chunks, so steps mix chunks and
    decodes (under async scheduling each step samples before the last step's tokens are read)."""
    llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", async_scheduling=async_scheduling,
              max_num_batched_tokens=9)
    prompts = [{"prompt_token_ids": p} for p in random_prompts((5, 17, 12))]
    seeded = SamplingParams(max_tokens=STEPS, temperature=0.8, seed=5, ignore_eos=True)
    pen = greedy(repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.5)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, [greedy(), seeded, greedy()])]
    mixed = [o.outputs[0].token_ids for o in llm.generate(prompts, [greedy(), seeded, pen])]
    alone = llm.generate(prompts[2], pen)[0].outputs[0].token_ids
    assert mixed[:2] == plain[:2]
    assert mixed[2] == alone != plain[2]
    assert llm.stats()["kv_pages_used"] == 0


def test_a_batch_without_penalties_does_no_penalty_work(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu")

    def refuse(*args: object) -> None:
        raise AssertionError("penalty work in a batch without penalties")

    monkeypatch.setattr(penalties_module.Penalties, "apply", refuse)
    monkeypatch.setattr(penalties_module.PenaltyTable, "count", refuse)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, temperature=0.7, seed=0))
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.runner.penalties.counts is None  # never made: no request asked


def _request(seq_id: int, prompt: list[int], output: list[int], **params: float) -> Request:
    return Request(request_id=str(seq_id), seq_id=seq_id, prompt=None, prompt_token_ids=prompt,
                   params=SamplingParams(**params), max_tokens=64, eos_token_id=None, output_token_ids=list(output))


def _expected_row(req: Request, pending: list[int], vocab: int) -> torch.Tensor:
    row = torch.zeros(vocab, dtype=torch.int32)
    if req.params.repetition_penalty != 1.0:
        row[req.prompt_token_ids] = 1
    for t in req.output_token_ids + pending:
        row[t] += 2
    return row


def test_the_table_counts_as_the_host_would_through_slot_reuse_and_an_in_flight_token() -> None:
    """Two slots, three penalised requests: the third takes the slot of one not in its step and rebuilds it from
    the host's tokens; a request built while its last token is in flight counts that token from the device."""
    V = 50
    table = PenaltyTable(2, torch.device("cpu"))
    a = _request(0, [1, 2, 2, 3], [], repetition_penalty=1.2)
    b = _request(1, [4, 5], [7], frequency_penalty=0.5)
    plain = _request(2, [9], [])
    p = table.prepare([plain, a, b], V, None)
    assert p is not None and p.rows == [1, 2]
    table.count(p, torch.tensor([0, 11, 12]))  # the step's sampled rows: plain, a, b
    a.output_token_ids.append(11)
    b.output_token_ids.append(12)
    p = table.prepare([a, b], V, None)
    assert p is not None and p.rows == [0, 1]
    table.count(p, torch.tensor([11, 13]))
    a.output_token_ids.append(11)
    b.output_token_ids.append(13)
    assert table.counts is not None
    assert torch.equal(table.counts[table._slots[a]], _expected_row(a, [], V))
    assert torch.equal(table.counts[table._slots[b]], _expected_row(b, [], V))
    # c arrives with a token in flight (row 1 of the last launch) while b sits out: c takes b's slot
    c = _request(3, [6, 6], [8, 8], repetition_penalty=0.9, presence_penalty=1.0)
    c.num_pending_tokens = 1
    in_flight = (torch.tensor([30, 21]), {a.seq_id: 0, c.seq_id: 1})
    p = table.prepare([a, c], V, in_flight)
    assert p is not None and b not in table._slots
    assert torch.equal(table.counts[table._slots[c]], _expected_row(c, [21], V))
    assert torch.equal(table.counts[table._slots[a]], _expected_row(a, [], V))
    # a finished request's slot is free again
    a.status = a.status.FINISHED_STOPPED
    table.prepare([c], V, None)
    assert a not in table._slots and len(table._free) == 1


def test_penalties_apply_only_to_their_rows_in_vllms_order() -> None:
    """The sampler's edit of a chunk: rows without a penalty keep their logits bit for bit; a penalised row gets the
    repetition penalty first (divide positive, multiply negative logits), then the frequency and presence terms;
    -inf stays -inf."""
    V = 8
    table = PenaltyTable(4, torch.device("cpu"))
    req = _request(0, [1, 2], [2, 3, 3], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    p = table.prepare([_request(1, [0], []), req], V, None)
    assert p is not None
    logits = torch.tensor([[1.0, -1.0, 3.0, -3.0, 5.0, 0.5, -0.5, 2.0],
                           [1.0, -1.0, 3.0, -3.0, 5.0, float("-inf"), -0.5, 2.0]])
    chunk = logits.clone()
    p.apply(chunk, 0)
    assert torch.equal(chunk[0], logits[0])
    want = torch.tensor([1.0, -2.0, 3.0 / 2.0 - 0.5 - 0.25, -6.0 - 1.0 - 0.25, 5.0, float("-inf"), -0.5, 2.0])
    assert torch.equal(chunk[1], want)


def test_bad_penalties_are_refused_naming_the_field() -> None:
    for kw, reason in (({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
                       ({"frequency_penalty": -2.01}, r"frequency_penalty must be in \[-2, 2\]"),
                       ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number greater than zero"),
                       ({"repetition_penalty": float("inf")}, "repetition_penalty must be"),
                       ({"presence_penalty": "1"}, "presence_penalty must be")):
        with pytest.raises(ValueError, match=reason):
            SamplingParams(**kw)
    assert SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-3).penalized
    assert not SamplingParams().penalized


def test_the_server_serves_penalties_and_refuses_bad_ones_naming_them(ckpt: Path, llm: LLM) -> None:
    prompt = random_prompts((9,))[0]
    kw = {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": -0.2}
    want = llm.generate({"prompt_token_ids": prompt}, greedy(**kw))[0].outputs[0]
    engine = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", gpu_memory_budget="64MiB"))
    with BackgroundServer(engine, ServerConfig(served_model_name="m")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        base = {"model": "m", "prompt": prompt, "max_tokens": STEPS, "temperature": 0.0}
        got = client.completions.create(**base, frequency_penalty=0.4, presence_penalty=-0.2,
                                        extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
        assert got.choices[0].text == want.text and got.usage.completion_tokens == STEPS
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                              presence_penalty=1.0, temperature=0.0)
        assert chat.usage.completion_tokens >= 1
        for name, value in (("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0)):
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(**base, extra_body={name: value})
            assert err.value.body["param"] == name
