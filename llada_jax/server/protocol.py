"""The OpenAI request bodies the server takes, as pydantic models: types and ranges are checked here, so a bad field
is a 400 naming it before anything runs. Types are strict, as OpenAI's API checks them (`"5"` is not an integer,
`true` is not a number, NaN is no temperature); `null` stands for a field's default. Fields of the OpenAI API
that LLaDA cannot honour are accepted at their neutral value (what clients send routinely: `response_format`
text, `tool_choice` none/auto without tools, `store` false, ...) and otherwise refused as unsupported, never
silently answered without them. Fields the API does not have are ignored (`unknown_fields` names them for a
logged warning), as vLLM does.

Extension fields (the `openai` client sends them with `extra_body`): `block_length`, `steps`, `policy`
(`POLICY[@THRESHOLD]`, as `llada generate --policy`), `threshold`, `cfg_scale`, `remasking`, and `canvas`
(stream the denoising canvas of every step in each chunk's choice).
"""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOPS = 4
MAX_CHOICES = 8
MAX_MESSAGES = 4096  # more never fit a context (each renders its role's tokens); bounds validating on the event loop


class FieldError(ValueError):
    """A rule over the whole body broken by one field, `param` (pydantic locates such errors at the body)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _neutral(name: str, value, neutral: tuple) -> None:
    if value not in neutral:
        raise ValueError(f"{name} is unsupported by llada-jax (accepted only at its neutral value); leave it unset")


class Lenient(BaseModel):
    """A body part that keeps unknown fields aside (`model_extra`) instead of refusing them; its text holds
    characters only (JSON can spell a lone UTF-16 surrogate, which no tokenizer or encoder takes)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _characters(self):
        for name in type(self).model_fields:
            for text in _texts(getattr(self, name)):
                if not text.isascii():
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError as error:
                        raise FieldError(name, f"holds {text[error.start]!r}, a lone UTF-16 surrogate, which is "
                                               "not a character") from None
        return self

    def unknown_fields(self, prefix: str = "") -> list[str]:
        names = [prefix + name for name in self.model_extra or {}]
        for name in type(self).model_fields:
            value = getattr(self, name)
            for index, part in enumerate(value if isinstance(value, list) else [value]):
                if isinstance(part, Lenient):
                    at = f"{name}[{index}]." if isinstance(value, list) else f"{name}."
                    names += part.unknown_fields(prefix + at)
        return names


class StreamOptions(Lenient):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # padding against side channels: nothing to pad here


class ResponseFormat(Lenient):
    type: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind):
        if kind != "text":
            raise ValueError(f"{kind!r} is unsupported by llada-jax (structured output); use 'text' or leave it unset")
        return kind


def _texts(value) -> list[str]:
    """The strings in a field's value (nested lists included; nested models check their own)."""
    if isinstance(value, str):
        return [value]
    return [text for part in value for text in _texts(part)] if isinstance(value, list) else []


def _null_is_default(cls, value, info):
    """OpenAI's API takes `null` for a field's default."""
    return cls.model_fields[info.field_name].default if value is None else value


SERVICE_TIERS = (None, "auto", "default")


class GenerationFields(Lenient):
    """What completions and chat completions share."""

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
    # OpenAI platform fields with nothing to do here (no storage, one tier)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # llada-jax extensions
    block_length: int | None = Field(None, ge=1)
    steps: int | None = Field(None, ge=1)
    policy: str | None = Field(None, min_length=1, max_length=200)
    threshold: float | None = Field(None, gt=0.0, le=1.0)
    cfg_scale: float | None = Field(None, ge=0.0, le=100.0)
    remasking: Literal["low_confidence", "random"] | None = None
    canvas: bool = False

    _defaults = field_validator("n", "stream", "canvas", mode="before")(classmethod(_null_is_default))

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

    @field_validator("store")
    @classmethod
    def _store(cls, value):
        _neutral("store", value, (None, False))
        return value

    @field_validator("service_tier")
    @classmethod
    def _service_tier(cls, value):
        _neutral("service_tier", value, SERVICE_TIERS)
        return value

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed with stream=true")
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

    _echo_default = field_validator("echo", mode="before")(classmethod(_null_is_default))

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt):
        if isinstance(prompt, list) and (not prompt or any(isinstance(p, (str, list)) and not p for p in prompt)):
            raise ValueError("a prompt must not be empty")
        if isinstance(prompt, str) and not prompt:
            raise ValueError("a prompt must not be empty")
        return prompt

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported(cls, value, info):
        _neutral(info.field_name, value, (None, False, ""))
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value):
        _neutral("logprobs", None if value is None else "any", (None,))  # even 0 asks for the chosen tokens'
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value):
        _neutral("best_of", value, (None, 1))
        return value

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [cast(str | list[int], self.prompt)]
        return list(cast(list[str] | list[list[int]], self.prompt))


class ContentPart(Lenient):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are unsupported by llada-jax (text only)")
        if self.text is None:
            raise ValueError("a text part needs its text")
        return self


class Message(Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: list[ContentPart] | str | None = None  # the list first: its errors are the ones worth reporting
    name: str | None = None
    tool_calls: list | None = None
    refusal: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, value):
        _neutral("tool_calls", value or None, (None,))
        return value

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None:  # OpenAI's API takes none only beside tool calls, which are not supported
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        parts = self.content if isinstance(self.content, list) else []
        return self.content if isinstance(self.content, str) else "".join(part.text or "" for part in parts)


class ChatRequest(GenerationFields):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: Any = None
    response_format: ResponseFormat | None = None
    tools: list | None = None
    functions: list | None = None
    tool_choice: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None

    @field_validator("logprobs", "top_logprobs", "audio", "prediction", "reasoning_effort", "web_search_options")
    @classmethod
    def _unsupported(cls, value, info):
        _neutral(info.field_name, value, (None, False))
        return value

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} are unsupported by llada-jax (no tool calling); leave them unset")
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value, info):
        _neutral(info.field_name, value, (None, "none", "auto"))
        return value

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, value):
        _neutral("modalities", value, (None, ["text"]))
        return value

    @model_validator(mode="after")
    def _length(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise FieldError("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def answer_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def turns(self) -> list[dict]:
        """The conversation as the chat template takes it (a developer message is a system message)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]
