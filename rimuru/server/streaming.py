"""Server-sent events of one streamed response: each engine output becomes the delta the client lacks (its new
text, and the logprobs of its new tokens when asked; with completions' echo, each choice's first delta starts with
its prompt, server/echo.py).

    data: {chunk of choice i}      one per engine output that adds tokens (or finishes its choice)
    data: {chunk, no choice, usage}  only with stream_options.include_usage
    data: [DONE]

Once the first event is out the HTTP status is sent, so a failure is reported in-band as an OpenAI
error body, then `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from rimuru.engine.outputs import RequestOutput
from rimuru.server.async_engine import EngineDeadError, RequestStream
from rimuru.server.echo import echoed
from rimuru.server.errors import error_body
from rimuru.server.responses import Body, ChoiceDelta, ResponseHead, TokenEntries, response_usage, token_texts_length

Chunk = Callable[[ResponseHead, ChoiceDelta | None, Body | None], Body]


def sse(payload: Body | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def event_stream_response(events: AsyncIterator[str]) -> StreamingResponse:
    # X-Accel-Buffering: a proxy (nginx) in front must pass each event on at once, not buffer the stream
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def stream_events(
    stream: RequestStream,
    head: ResponseHead,
    chunk: Chunk,
    prompts: list[list[int]],
    include_usage: bool,
    count_error: Callable[[int], None],
) -> AsyncIterator[str]:
    # Running outputs never carry a possible start of a stop string (the engine holds it back, as vLLM's
    # detokenizer does), so text only ever grows and each delta is what the client has not seen.
    sent_text: dict[int, int] = {}  # choice -> characters sent
    sent_tokens: dict[int, int] = {}  # choice -> tokens covered by what was sent
    sent_offset: dict[int, int] = {}  # choice -> completions' text_offset after the logprobs sent
    last: dict[int, RequestOutput] = {}  # choice -> its latest output, for the usage chunk
    try:
        while not stream.done():
            # a batch: every output queued for this stream, the latest per choice (a lagging loop coalesces)
            for index, out in await stream.next_batch():
                last[index] = out
                c = out.outputs[0]
                if len(c.token_ids) == sent_tokens.get(index, 0) and c.finish_reason is None:
                    continue  # nothing new for the client
                done = sent_tokens.get(index, 0)
                first = index not in sent_tokens
                text = c.text[sent_text.get(index, 0):]
                new_ids: list[int] = c.token_ids[done:]
                new_logprobs: TokenEntries | None = None if c.logprobs is None else list(c.logprobs[done:])
                first_token_text = None
                echo = head.echo
                if echo is not None and first:  # the prompt's part goes before the choice's first delta
                    p = index // head.n
                    text, new_ids, new_logprobs = echoed(out, echo.texts[p], text, new_ids, new_logprobs,
                                                         echo.without_generation)
                    first_token_text = echo.first_token_texts[p]
                elif echo is not None and echo.without_generation:  # the generated token is left out
                    text, new_ids, new_logprobs = "", [], None if new_logprobs is None else []
                delta = ChoiceDelta(index, text, c.finish_reason, c.stop_reason, first=first, token_ids=new_ids,
                                    logprobs=new_logprobs, text_offset=sent_offset.get(index, 0),
                                    first_token_text=first_token_text)
                if new_logprobs is not None:
                    sent_offset[index] = delta.text_offset + token_texts_length(new_ids, new_logprobs,
                                                                                first_token_text)
                sent_text[index] = len(c.text)
                sent_tokens[index] = len(c.token_ids)
                yield sse(chunk(head, delta, None))
        if include_usage:
            yield sse(chunk(head, None, response_usage(head, prompts, last)))
    except Exception as exc:
        status = 503 if isinstance(exc, EngineDeadError) else 500
        count_error(status)
        yield sse(error_body(status, f"generation failed: {exc}", code="engine_error"))
    finally:
        stream.close()
    yield sse("[DONE]")
