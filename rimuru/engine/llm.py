"""The offline Python API, shaped as vLLM's: `LLM(model, ...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from rimuru.config import EngineConfig
from rimuru.engine.llm_engine import LLMEngine
from rimuru.engine.outputs import RequestOutput
from rimuru.engine.sampling_params import SamplingParams

Prompt = str | dict[str, Any]


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order; a prompt is a string or {"prompt_token_ids": [...]}."""
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
                    self.engine.add_request(rid, engine_prompt, sub)
                    submitted.append(rid)
                    ids.append(rid)
                groups.append(ids)
        except Exception:
            for rid in submitted:
                self.engine.abort_request(rid)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(submitted), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
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
                                         metrics=first.metrics, num_cached_tokens=first.num_cached_tokens))
        return results

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def reset_prefix_cache(self) -> int:
        """Frees every prefix-cache page no request holds (vLLM's `LLM.reset_prefix_cache`); returns how many."""
        return self.engine.reset_prefix_cache()


def _engine_prompt(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and "prompt" in prompt:
        return str(prompt["prompt"])
    raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
