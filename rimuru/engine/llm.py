"""The offline Python API, shaped as vLLM's: `LLM(model, ...).generate(prompts, sampling_params)`, `.chat(messages)`,
`.shutdown()`."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm import tqdm

from rimuru.config import EngineConfig
from rimuru.engine.llm_engine import LLMEngine
from rimuru.engine.outputs import RequestOutput
from rimuru.engine.sampling_params import SamplingParams

Prompt = str | dict[str, Any]
ChatMessage = Mapping[str, Any]  # {"role": ..., "content": ...}, as the chat template reads it


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self._engine: LLMEngine | None = None  # set first: __del__ runs even when the engine fails to start
        self.config = EngineConfig(model=model, **kwargs)
        self._engine = LLMEngine(self.config)
        self._ids = itertools.count()

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("this LLM was shut down")
        return self._engine

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order; a prompt is a string or {"prompt_token_ids": [...]}."""
        engine = self.engine
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # n > 1 runs as n engine requests (seed + i when seeded), gathered into one output
        groups: list[list[str]] = []
        submitted: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                engine_prompt = _engine_prompt(prompt)
                ids = []
                for i in range(p.n):
                    sub = replace(p, n=1, seed=None if p.seed is None else p.seed + i)
                    rid = str(next(self._ids))
                    engine.add_request(rid, engine_prompt, sub)
                    submitted.append(rid)
                    ids.append(rid)
                groups.append(ids)
        except Exception:
            for rid in submitted:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()
            raise
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(submitted), desc="generate", disable=not use_tqdm)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        results = []
        for ids in groups:
            first = final[ids[0]]
            outs = []
            for i, rid in enumerate(ids):
                comp = final[rid].outputs[0]
                comp.index = i
                outs.append(comp)
            results.append(RequestOutput(request_id=first.request_id, prompt=first.prompt,
                                         prompt_token_ids=first.prompt_token_ids, outputs=outs, finished=True,
                                         metrics=first.metrics, num_cached_tokens=first.num_cached_tokens,
                                         prompt_logprobs=first.prompt_logprobs))
        return results

    def chat(self, messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a list of them, each
        rendered with the tokenizer's chat template (or `chat_template`, a Jinja string) and generated; one
        RequestOutput per conversation, its `prompt` the rendered text."""
        conversations = [messages] if not messages or isinstance(messages[0], Mapping) else list(messages)
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError(f"{self.config.model} has no tokenizer: LLM.chat needs one with a chat template "
                             "(LLM.generate takes {'prompt_token_ids': [...]} without one)")
        template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError(f"the tokenizer of {self.config.model} has no chat template: pass chat_template=... "
                             "or use LLM.generate")
        texts, prompts = [], []
        for conv in conversations:
            text = tokenizer.apply_chat_template([dict(m) for m in conv], chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message,
                                                 **(chat_template_kwargs or {}))
            # as vLLM: the template writes the control tokens as text, so they are tokenized as control tokens,
            # and nothing is added (a template that wants a BOS writes it)
            texts.append(text)
            prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        results = self.generate(prompts, sampling_params, use_tqdm)
        for out, text in zip(results, texts, strict=True):
            out.prompt = text
        return results

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def reset_prefix_cache(self) -> int:
        """Frees every prefix-cache page no request holds (vLLM's `LLM.reset_prefix_cache`); returns how many."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Frees the engine's memory now (the page pool, the model, the host expert store) and hands cached device
        memory back to the driver, so another engine in this process can have it; this LLM serves nothing after.
        `del llm` does the same. The engine goes even where `llm.engine` is still referenced elsewhere."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        device = engine.device
        engine.shutdown()
        del engine  # the last reference: reference counting frees it here
        if device.type == "cuda":
            torch.cuda.empty_cache()  # a second engine measures the device's free memory when it starts

    def __del__(self) -> None:
        if not sys.is_finalizing():  # at interpreter exit torch may be half torn down; the process frees it all
            self.shutdown()



def _engine_prompt(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and "prompt" in prompt:
        return str(prompt["prompt"])
    raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
