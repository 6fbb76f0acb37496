"""The OpenAI response bodies: whole completions, stream chunks and errors. Each choice also carries `nfe`
(the forward passes its generation ran), an extension field; under `canvas` a chunk's choice carries the
denoising canvas of that step."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

from llada_jax.server.runs import Update


@dataclasses.dataclass
class Response:
    """One request's response: `chat` or text completion, its id and creation time. With `include_usage` a
    stream's chunks carry `usage`: null until the last (OpenAI's form)."""

    model: str
    chat: bool
    prompt_tokens: int
    include_usage: bool = False
    id: str = ""
    created: int = 0

    def __post_init__(self):
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def whole(self, finals: list[tuple[str, Update]]) -> dict:
        """The non-streamed body: per choice (its whole text, its last update)."""
        choices = []
        for index, (text, last) in enumerate(finals):
            choice = {"index": index, "logprobs": None, "finish_reason": last.finish_reason, "nfe": last.nfe}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {**self._head(False), "choices": choices, "usage": self.usage(sum(last.tokens for _, last in finals))}

    def opening(self, choices: int) -> list[str]:
        """A chat stream's first chunks: the assistant role, per choice (a text stream opens with no chunk)."""
        if not self.chat:
            return []
        return [self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for index in range(choices)]

    def chunk(self, update: Update) -> str:
        choice = {"index": update.index, "logprobs": None, "finish_reason": update.finish_reason}
        if self.chat:
            choice["delta"] = {"content": update.delta} if update.delta or update.finish_reason is None else {}
        else:
            choice["text"] = update.delta
        if update.canvas is not None:
            choice["canvas"] = update.canvas
        if update.last:
            choice["nfe"] = update.nfe
        return self._chunk(choice)

    def usage_chunk(self, completion_tokens: int) -> str:
        return sse({**self._head(True), "choices": [], "usage": self.usage(completion_tokens)})

    def _chunk(self, choice: dict) -> str:
        return sse({**self._head(True), "choices": [choice], **({"usage": None} if self.include_usage else {})})


def sse(body: dict | str) -> str:
    """One server-sent event."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


DONE = sse("[DONE]")


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """The OpenAI error body, which the `openai` client reads into its exceptions."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
