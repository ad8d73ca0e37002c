"""OpenAI request -> engine `SamplingParams`, with the checks that give a client a precise 400.

The engine checks the same limits again when a request is added; checking here first lets the error
name the OpenAI parameter (`param`) and use OpenAI's codes (`context_length_exceeded`).
"""

from __future__ import annotations

from rimuru.engine.sampling_params import SamplingParams
from rimuru.server.errors import APIError
from rimuru.server.generation_config import SamplingDefaults
from rimuru.server.protocol import GenerationRequest

NO_DEFAULTS = SamplingDefaults()


def reject_unsupported(req: GenerationRequest) -> None:
    bad = req.unsupported()
    if bad:
        raise APIError(400, f"'{bad[0]}' is not supported by this server", param=bad[0], code="unsupported")
    if req.stream and req.prompt_logprobs not in (None, 0):  # vLLM's rule and message
        raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs",
                       code="invalid_value")


def echo_without_generation(req: GenerationRequest) -> bool:
    """Completions' echo with max_tokens=0 (OpenAI's): the prompt alone is returned; as vLLM, the engine still
    generates one token, which the response leaves out."""
    return req.echoes() and req.token_limit() == 0


def to_sampling_params(req: GenerationRequest, prompt_len: int, max_model_len: int, choice: int,
                       defaults: SamplingDefaults = NO_DEFAULTS) -> SamplingParams:
    """The params of one choice (`choice` in [0, n)) of one prompt; each choice gets its own seed so that
    n seeded choices differ from each other and still repeat across identical requests. `defaults` (the model's
    generation config) fill what the request leaves out."""
    max_tokens = 1 if echo_without_generation(req) else req.token_limit()
    if max_tokens is None:
        max_tokens = defaults.max_tokens
    if max_tokens is not None and max_tokens < 1:
        hint = " (0 only with echo)" if max_tokens == 0 and "echo" in type(req).model_fields else ""
        raise APIError(400, f"max_tokens must be at least 1{hint}, got {max_tokens}", param="max_tokens",
                       code="invalid_value")
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens; this model's maximum context length is {max_model_len} tokens",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise APIError(
            400,
            f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds the "
            f"maximum context length of {max_model_len} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    try:
        return SamplingParams(
            n=1,  # the server adds one engine request per choice
            temperature=_first(req.temperature, defaults.temperature, 1.0),
            top_p=_first(req.top_p, defaults.top_p, 1.0),
            top_k=_first(req.top_k, defaults.top_k, -1),
            presence_penalty=_first(req.presence_penalty, 0.0),
            frequency_penalty=_first(req.frequency_penalty, 0.0),
            repetition_penalty=_first(req.repetition_penalty, defaults.repetition_penalty, 1.0),
            seed=None if req.seed is None else _wrap_int64(req.seed + choice),
            max_tokens=max_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=req.num_logprobs(),
            prompt_logprobs=req.num_prompt_logprobs(),
            logit_bias=_logit_bias(req.logit_bias),
        )
    except ValueError as exc:
        raise APIError(400, str(exc), param=getattr(exc, "param", None), code="invalid_value") from exc


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids as strings."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias",
                           code="invalid_value") from None
    return out


def _first(*values: float | int | None) -> float | int:
    return next(v for v in values if v is not None)


def _wrap_int64(seed: int) -> int:
    """Choice i of a seeded request draws from seed + i, kept within the 64 bits a generator takes."""
    return (seed + 2**63) % 2**64 - 2**63
