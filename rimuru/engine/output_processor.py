"""A step's sampled tokens become request outputs: append (with their logprobs when asked, and the prompt logprobs
its chunks brought), detokenise, check stop conditions, finish.

Finished requests leave the scheduler here (their pages are freed at once); outputs are cumulative, as vLLM's.
"""

from __future__ import annotations

import time
from typing import Any

from rimuru.engine.detokenizer import detokenize_incrementally
from rimuru.engine.logprobs import TokenLogprobs
from rimuru.engine.outputs import CompletionOutput, Logprob, RequestOutput
from rimuru.engine.request import Request, RequestStatus
from rimuru.engine.scheduler import Scheduler, SchedulerOutput


class OutputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, scheduler: Scheduler,
                 requests: dict[str, Request], async_scheduling: bool) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.requests = requests  # the engine's live requests by id: finished ones are dropped here
        self.async_scheduling = async_scheduling  # each sampled row was counted as a pending token at launch
        self._token_texts: dict[int, str] = {}  # token id -> its text alone, for logprobs (a vocabulary at most)

    def process(self, sched: SchedulerOutput, tokens: list[int], logprobs: list[TokenLogprobs | None] | None = None,
                prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] | None = None) -> list[RequestOutput]:
        """`tokens`: the sampled token of each scheduled request that samples, in order; `logprobs`: their
        logprobs in the same order (None: no row asked); `prompt_logprobs`: by scheduled index, the prompt position
        of the step's first prompt logprob entry and the entries (None: no chunk asked). A request's prompt entries
        go in before its sampled token, so its first output holds them all."""
        if prompt_logprobs is not None:
            for index, (first, entries) in prompt_logprobs.items():
                self._add_prompt_logprobs(sched.scheduled[index].request, first, entries)
        outputs = []
        it = iter(tokens)
        lps = iter(logprobs) if logprobs is not None else None
        now = time.monotonic()
        for s in sched.scheduled:
            req = s.request
            if not s.samples:
                continue
            token = next(it)
            lp = next(lps) if lps is not None else None
            if self.async_scheduling:
                req.num_pending_tokens -= 1
            if req.status.finished:  # async: finished or aborted while this step was in flight; a wasted row
                continue
            req.output_token_ids.append(token)
            if req.logprobs is not None:
                assert lp is not None, f"{req.request_id} asked for logprobs but its row has none"
                req.logprobs.append(self._logprob_entry(token, lp))
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            status = self._check_stop(req, token)
            if status is not None:
                self.finish(req, status, now)
                outputs.append(final_output(req))
            else:
                outputs.append(running_output(req))
        return outputs

    def _add_prompt_logprobs(self, req: Request, first: int, entries: list[TokenLogprobs]) -> None:
        """Appends the entries that continue the request's prompt logprobs; a recomputed chunk (after a preemption)
        brings positions it has already, which stay as they are."""
        have = req.prompt_logprobs
        if have is None or req.status.finished:
            return
        for pos, lp in enumerate(entries, start=first):
            if pos == len(have):
                have.append(self._logprob_entry(req.prompt_token_ids[pos], lp))

    def _logprob_entry(self, token: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        """vLLM's shape: the sampled token first, then the top ones by rank; a sampled token among them keeps
        its first place in the dict and takes its top rank."""
        entry = {token: Logprob(lp.token_logprob, lp.rank, self._token_text(token))}
        for rank, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), start=1):
            entry[tid] = Logprob(value, rank, self._token_text(tid))
        return entry

    def _token_text(self, token: int) -> str | None:
        """The token decoded alone, as vLLM shows logprob tokens (special tokens kept)."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def finish(self, req: Request, status: RequestStatus, now: float) -> None:
        self.scheduler.finish(req, status)
        req.metrics.finished_time = now
        self.requests.pop(req.request_id, None)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        if self.tokenizer is not None:
            new_text = detokenize_incrementally(self.tokenizer, req, p.skip_special_tokens)
            # as vLLM: a stop string ends a request from its (min_tokens + 1)-th token on, where EOS and the stop
            # ids can first be sampled; one completed earlier stays in the text
            if p.stop_strings and new_text and req.num_output_tokens > p.min_tokens:
                # a stop string may straddle the old and new text: search the tail that could contain it
                start = max(0, len(req.output_text) - max(len(s) for s in p.stop_strings) + 1)
                req.output_text += new_text
                for stop in p.stop_strings:
                    at = req.output_text.find(stop, start)
                    if at != -1:
                        end = at + len(stop) if p.include_stop_str_in_output else at
                        req.output_text = req.output_text[:end]
                        req.stop_reason = stop
                        return RequestStatus.FINISHED_STOPPED
            else:
                req.output_text += new_text
        if token == req.eos_token_id and not p.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def final_output(req: Request) -> RequestOutput:
    comp = CompletionOutput(index=0, text=req.output_text, token_ids=list(req.output_token_ids),
                            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
                            logprobs=None if req.logprobs is None else list(req.logprobs))
    return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                         outputs=[comp], finished=req.status.finished, metrics=req.metrics,
                         num_cached_tokens=req.num_cached_tokens, prompt_logprobs=req.prompt_logprobs)


def running_output(req: Request) -> RequestOutput:
    """`final_output` of a request that is still running (no finish reason), without the status lookups.

    With stop strings cut from the output, the last `longest stop - 1` characters are held back (vLLM's stop
    buffer): they may be the start of a stop string that the next token completes, and the final text then drops
    them, so a streamed text that had sent them could not be taken back."""
    text = req.output_text
    p = req.params
    if p.stop_strings and not p.include_stop_str_in_output:
        hold = max(len(s) for s in p.stop_strings) - 1
        if hold:
            text = text[:-hold]
    comp = CompletionOutput(0, text, req.output_token_ids.copy(), None, req.stop_reason,
                            None if req.logprobs is None else req.logprobs.copy())
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], False, req.metrics,
                         req.num_cached_tokens, req.prompt_logprobs)
