"""The OpenAI request bodies the server takes, as pydantic models: types and ranges are checked here, so a
bad field is a 400 naming it before anything runs. Fields of the OpenAI API that LLaDA cannot honour are
accepted only at their neutral value (a request that asks for log-probabilities, penalties or a logit
bias is refused, never silently answered without them); fields the API does not have are refused.

Extension fields (the `openai` client sends them with `extra_body`): `block_length`, `steps`, `policy`
(`POLICY[@THRESHOLD]`, as `llada generate --policy`), `threshold`, `cfg_scale`, `remasking`, and `canvas`
(stream the denoising canvas of every step in each chunk's choice).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOPS = 4
MAX_CHOICES = 8


def _neutral(name: str, value, neutral: tuple) -> None:
    if value not in neutral:
        raise ValueError(f"{name} is not supported by LLaDA decoding; leave it unset")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class GenerationFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # llada-jax extensions
    block_length: int | None = Field(None, ge=1)
    steps: int | None = Field(None, ge=1)
    policy: str | None = Field(None, min_length=1, max_length=200)
    threshold: float | None = Field(None, gt=0.0, le=1.0)
    cfg_scale: float | None = Field(None, ge=0.0, le=100.0)
    remasking: Literal["low_confidence", "random"] | None = None
    canvas: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        if any(not text for text in stops):
            raise ValueError("a stop sequence must not be empty")
        return stops

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, top_p):
        if top_p is not None and top_p != 1.0:
            raise ValueError("only top_p=1 is supported (LLaDA samples from the whole distribution)")
        return top_p

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value, info):
        _neutral(info.field_name, value, (None, 0.0))
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        _neutral("logit_bias", value or None, (None,))
        return value

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt):
        if isinstance(prompt, list) and (not prompt or any(isinstance(p, (str, list)) and not p for p in prompt)):
            raise ValueError("a prompt must not be empty")
        if isinstance(prompt, str) and not prompt:
            raise ValueError("a prompt must not be empty")
        return prompt

    @field_validator("echo", "logprobs", "suffix")
    @classmethod
    def _unsupported(cls, value, info):
        _neutral(info.field_name, value, (None, False, 0))
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value):
        _neutral("best_of", value, (None, 1))
        return value

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(GenerationFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: Any = None

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _unsupported(cls, value, info):
        _neutral(info.field_name, value, (None, False))
        return value

    @model_validator(mode="after")
    def _length(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def answer_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def turns(self) -> list[dict]:
        """The conversation as the chat template takes it (a developer message is a system message)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]
