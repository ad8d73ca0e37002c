"""Presence, frequency and repetition penalties as vLLM computes them, checked against transformers: greedy decoding
with a repetition penalty is transformers' `generate(repetition_penalty=...)`, and every token of a penalised
decode (greedy, and the sampling path at top_k=1) is the argmax of transformers' logits with the penalties applied
by hand. A chunk's counts are checked against the host's tokens, kept from step to step, with an in-flight token;
a batch without penalties does no penalty work, penalties hold no memory between steps, and a penalised chunk peaks
no higher than the sampler's measured chunk; bad values are refused naming the field, by the engine and by the
server (read by the official `openai` client)."""

from __future__ import annotations

import gc
from pathlib import Path

import openai
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from rimuru import LLM, SamplingParams
from rimuru.config import EngineConfig
from rimuru.engine import penalties as penalties_module
from rimuru.engine.llm_engine import LLMEngine
from rimuru.engine.penalties import PenaltyHistory
from rimuru.engine.request import Request
from rimuru.engine.sampler import SAMPLE_ROWS_PER_CHUNK, SAMPLER_BYTES_PER_ENTRY, Sampler
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
    monkeypatch.setattr(penalties_module.Penalties, "counts", refuse)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, temperature=0.7, seed=0))
    assert len(out[0].outputs[0].token_ids) == 4
    assert not llm.engine.runner.penalties.histories  # no request asked: nothing kept


def _tensor_bytes() -> int:
    """Bytes of every torch tensor alive in the process (each storage once)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
            s = obj.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def test_penalties_hold_no_memory_between_steps(ckpt: Path) -> None:
    """The engine holds the same tensors before and after serving penalised requests, and its budget split (the
    workspace) is what it is without them; what the host kept for them goes with the requests."""
    llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu")
    split = dict(llm.engine.budget_split)
    prompts = [{"prompt_token_ids": p} for p in random_prompts((6, 13))]
    last = SamplingParams(max_tokens=1, temperature=0.0)  # the same last step before both counts
    llm.generate(prompts, greedy())  # anything made on first use, made
    llm.generate(prompts[:1], last)
    before = _tensor_bytes()
    pen = greedy(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4)
    out = llm.generate(prompts, [pen, greedy()])
    assert len(out[0].outputs[0].token_ids) == STEPS
    llm.generate(prompts[:1], last)
    assert _tensor_bytes() == before
    assert not llm.engine.runner.penalties.histories
    assert llm.engine.budget_split == split


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


def test_chunk_counts_are_the_hosts_tokens_and_the_in_flight_one() -> None:
    """The counts a chunk builds are the host's prompt and output tokens, kept from step to step with only the new
    tokens added, plus a token the step in flight sampled, read on the device; a request whose output list was
    replaced is rebuilt, and a finished one is dropped."""
    V = 50
    state = PenaltyHistory(torch.device("cpu"))
    a = _request(0, [1, 2, 2, 3], [], repetition_penalty=1.2)
    b = _request(1, [4, 5], [7], frequency_penalty=0.5)
    plain = _request(2, [9], [])
    for step, (ta, tb) in enumerate([(11, 12), (11, 13), (7, 4)]):
        p = state.prepare([plain, a, b], V, None)
        assert p is not None and p.rows == [1, 2]
        counts, values = p.counts(0, 2, torch.device("cpu"))
        assert values[:, 1].tolist() == [2.0, 1.0, 0.5, 0.0]  # b: its row, repetition, frequency, presence
        assert torch.equal(counts[0], _expected_row(a, [], V)) and torch.equal(counts[1], _expected_row(b, [], V))
        assert state.histories[a].seen == step
        a.output_token_ids.append(ta)
        b.output_token_ids.append(tb)
    # c's last token is in flight (row 1 of the last launch); a's output list is replaced
    c = _request(3, [6, 6], [8, 8], repetition_penalty=0.9, presence_penalty=1.0)
    c.num_pending_tokens = 1
    a.output_token_ids = [20, 20, 21]
    in_flight = (torch.tensor([30, 21]), {a.seq_id: 0, c.seq_id: 1})
    p = state.prepare([a, c], V, in_flight)
    assert p is not None and p.pending == [-1, 1]
    counts, _ = p.counts(0, 2, torch.device("cpu"))
    assert torch.equal(counts[0], _expected_row(a, [], V)) and torch.equal(counts[1], _expected_row(c, [21], V))
    counts, values = p.counts(1, 2, torch.device("cpu"), lo=1)  # c alone, in a chunk from row 1
    assert torch.equal(counts[0], _expected_row(c, [21], V)) and values[0].tolist() == [0.0]
    a.status = a.status.FINISHED_STOPPED
    c.num_pending_tokens = 0
    c.output_token_ids.append(21)  # read
    p = state.prepare([c], V, None)
    assert p is not None and torch.equal(p.counts(0, 1, torch.device("cpu"))[0][0], _expected_row(c, [], V))
    assert a not in state.histories and set(state.histories) == {b, c}


class _LiveBytes(TorchDispatchMode):
    """The most bytes of tensors made inside the mode alive at once (each storage once), checked after every op."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                seen = self.live.get(s.data_ptr())
                if seen is None or seen[0].expired():
                    self.live[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def test_penalised_chunks_fit_in_the_room_measured_for_the_samplers_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the workspace reserves for sampling is the sampler's working set measured with every cut on (the
    start-up profile, engine/workspace_profile.py; on the CPU SAMPLER_BYTES_PER_ENTRY per entry of a chunk). A batch
    whose every row is penalised, with histories over the whole vocabulary (the most the copied array can hold),
    peaks no higher on the greedy path, on the temperature path, or with every cut on, so the penalties need no
    room of their own."""
    V, B = 2048, SAMPLE_ROWS_PER_CHUNK + 5  # one whole chunk and a partial one
    device = torch.device("cpu")
    # the copy to the device is a new tensor there: count it (on the CPU the host array itself is used)
    monkeypatch.setattr(penalties_module, "to_device", lambda host, device: host.clone())
    g = torch.Generator().manual_seed(0)
    reqs = [_request(i, torch.randperm(V, generator=g).tolist(), torch.randint(0, V, (3 * V,), generator=g).tolist(),
                     repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1) for i in range(B)]
    for r in reqs[::3]:
        r.num_pending_tokens = 1
    in_flight = (torch.randint(0, V, (B,), generator=g), {r.seq_id: r.seq_id for r in reqs})
    logits = torch.randn(B, V, generator=g)
    sampler = Sampler(device, 0)

    def peak(params: SamplingParams, penalised: bool) -> int:
        pen = PenaltyHistory(device).prepare(reqs, V, in_flight) if penalised else None
        with _LiveBytes() as mode:
            sampler(logits, [params] * B, [None] * B, None, pen)
        return mode.peak

    profile = peak(SamplingParams(temperature=0.8, top_k=50, top_p=0.9), penalised=False)
    assert profile <= SAMPLE_ROWS_PER_CHUNK * V * SAMPLER_BYTES_PER_ENTRY  # the CPU bound holds the measured set
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3),
                   SamplingParams(temperature=0.8, top_k=50, top_p=0.9)):
        assert peak(params, penalised=True) <= profile, params


def test_penalties_apply_only_to_their_rows_in_vllms_order() -> None:
    """The sampler's edit of a chunk: rows without a penalty keep their logits bit for bit; a penalised row gets the
    repetition penalty first (divide positive, multiply negative logits), then the frequency and presence terms;
    -inf stays -inf."""
    V = 8
    req = _request(0, [1, 2], [2, 3, 3], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    p = PenaltyHistory(torch.device("cpu")).prepare([_request(1, [0], []), req], V, None)
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
