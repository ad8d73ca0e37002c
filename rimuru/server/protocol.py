"""Request and response bodies of the OpenAI API subset we serve (pydantic), plus vLLM's extra fields.

Unknown fields are ignored, as vLLM does, so existing clients keep working; fields we cannot honour (best_of other
than n, suffix, tools, structured output) are accepted at their neutral values only and rejected with a 400
otherwise, never silently dropped. Served: logit_bias (keys: token ids as strings, as OpenAI's); the presence,
frequency and repetition penalties (vLLM's ranges: [-2, 2], [-2, 2], > 0); logprobs: completions' `logprobs: k`,
chat's `logprobs: true` with `top_logprobs: k` (k = -1: the whole vocabulary, as vLLM takes it); vLLM's
`prompt_logprobs: k` (not with stream=true, as vLLM); and completions' `echo` (the prompt before the completion, its
tokens' logprobs before the generated ones; with max_tokens=0 the prompt alone, as vLLM).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationInfo, field_validator

TokenIds = list[NonNegativeInt]
PromptInput = str | list[str] | TokenIds | list[TokenIds]
# what a union field must hold, said once instead of one pydantic message per member of the union
UNION_FIELD_HELP = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids (integers >= 0) or a list of such "
              "lists",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: Annotated[int, Field(ge=1, le=64)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None  # 64 bits, as vLLM takes it
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0  # vLLM's: EOS and stop_token_ids cannot end a choice before this many tokens
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    # Accepted only at their neutral values.
    best_of: int | None = None
    # vLLM's: the prompt tokens' logprobs and this many top ones each (-1: the whole vocabulary)
    prompt_logprobs: Annotated[int, Field(ge=-1)] | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None  # neutral: {"type": "text"}
    user: str | None = None

    def token_limit(self) -> int | None:
        """The most tokens to generate for each choice; None: up to the model's context."""
        raise NotImplementedError

    def num_logprobs(self) -> int | None:
        """`SamplingParams.logprobs`: top logprobs per generated token; None: no logprobs."""
        raise NotImplementedError

    def echoes(self) -> bool:
        """Whether the response repeats the prompt before the completion (completions' `echo`)."""
        return False

    def num_prompt_logprobs(self) -> int | None:
        """`SamplingParams.prompt_logprobs`: the request's own, or with echo its `logprobs` (vLLM's: the echoed
        prompt's tokens carry logprobs as the generated ones do)."""
        if self.prompt_logprobs is None and self.echoes():
            return self.num_logprobs()
        return self.prompt_logprobs

    def unsupported(self) -> list[str]:
        """The fields set to a value this server cannot honour."""
        bad = {
            "best_of": self.best_of not in (None, self.n),
            "response_format": self.response_format not in (None, {"type": "text"}),
        }
        return [name for name, is_bad in bad.items() if is_bad]


class CompletionRequest(GenerationRequest):
    prompt: PromptInput
    max_tokens: int | None = 16  # 0 only with echo: the prompt alone comes back
    logprobs: Annotated[int, Field(ge=-1)] | None = None  # top logprobs per token, beside the sampled one's
    echo: bool = False
    suffix: str | None = None

    def token_limit(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def echoes(self) -> bool:
        return self.echo

    def unsupported(self) -> list[str]:
        return super().unsupported() + (["suffix"] if self.suffix else [])


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False  # the sampled tokens' logprobs, and top_logprobs more per token
    top_logprobs: Annotated[int, Field(ge=-1)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None  # neutral: none, or auto / none without tools

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value not in (None, 0) and not info.data.get("logprobs"):
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true")
        return value

    def token_limit(self) -> int | None:  # OpenAI's newer name wins over the deprecated one
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> list[str]:
        bad = {
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none") and not (self.tool_choice == "auto"
                                                                             and not self.tools),
        }
        return super().unsupported() + [name for name, is_bad in bad.items() if is_bad]


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "rimuru"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
