"""The OpenAI generation endpoints: POST /v1/completions and /v1/chat/completions.

Each handler only turns its request into prompt token ids; the rest is the shared path in `serving.py`.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from rimuru.server.auth import require_api_key
from rimuru.server.echo import make_echo
from rimuru.server.prompts import chat_prompt, completion_prompts
from rimuru.server.protocol import ChatCompletionRequest, CompletionRequest
from rimuru.server.request_body import read_request
from rimuru.server.responses import CHAT_COMPLETION, COMPLETION
from rimuru.server.sampling import echo_without_generation
from rimuru.server.serving import create_response
from rimuru.server.state import ServerState


def openai_router(state: ServerState) -> APIRouter:
    router = APIRouter(dependencies=[Depends(require_api_key(state.config.api_key))])
    tokenizer = state.engine.tokenizer

    @router.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        req = await read_request(request, CompletionRequest, state.config)
        prompts = completion_prompts(tokenizer, req.prompt, state.engine.vocab_size)
        echo = make_echo(tokenizer, req.prompt, prompts, echo_without_generation(req)) if req.echo else None
        return await create_response(request, state, req, prompts, COMPLETION, echo)

    @router.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        req = await read_request(request, ChatCompletionRequest, state.config)
        prompts = [chat_prompt(tokenizer, req.messages)]
        return await create_response(request, state, req, prompts, CHAT_COMPLETION)

    return router
