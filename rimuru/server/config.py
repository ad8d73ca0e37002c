"""The HTTP server's configuration, built once from the command line (`cli.py`) or by a caller."""

from __future__ import annotations

from dataclasses import dataclass, field

from rimuru.server.generation_config import SamplingDefaults


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str  # the `model` responses carry; clients may send it or an alias, any other name gets a 404
    model_path: str = ""  # shown as the model card's `root`
    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 8 * 2**20  # larger request bodies get a 413 before they are parsed
    aliases: tuple[str, ...] = ()  # more names the model answers to (vLLM: --served-model-name A B ...)
    enable_log_requests: bool = False  # log every request's id, prompt length and sampling parameters (vLLM's flag)
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (vLLM's flag)
    # what a request leaves out, from the model's generation_config.json (--generation-config)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *(a for a in self.aliases if a != self.served_model_name))

    @classmethod
    def from_cli_args(cls, names: list[str] | None, model: str, api_key: str | None,
                      max_body_bytes: int, enable_log_requests: bool = False,
                      enable_prompt_tokens_details: bool = False,
                      sampling_defaults: SamplingDefaults | None = None) -> ServerConfig:
        """`--served-model-name` as vLLM reads it: one or more names, the first one in responses (default: MODEL)."""
        names = names or [model]
        return cls(served_model_name=names[0], aliases=tuple(names[1:]), model_path=model, api_key=api_key,
                   max_body_bytes=max_body_bytes, enable_log_requests=enable_log_requests,
                   enable_prompt_tokens_details=enable_prompt_tokens_details,
                   sampling_defaults=sampling_defaults or SamplingDefaults())
