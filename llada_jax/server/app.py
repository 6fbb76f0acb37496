"""The OpenAI-compatible HTTP server (FastAPI on uvicorn): `/v1/completions`, `/v1/chat/completions`
(streamed as server-sent events with `stream=true`), `/v1/models` and `/health`.

Errors come as OpenAI error bodies: 400 for a bad field (named in `param`, also for a request that asks for
more generations than the server holds), 401 for a missing or wrong API key (when the server has one), 404 for
an unknown model, 413 for a body over `guards.MAX_BODY_BYTES`, 429 when every row runs and the queue is full,
500 when a generation fails. Fields the API does not have are ignored with a logged warning. Prompts are
tokenized off the event loop. A client that goes away cancels its generations at their next step.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from llada_jax.server.engine import Busy, Engine
from llada_jax.server.guards import BodyLimit, OneLineErrors
from llada_jax.server.protocol import ChatRequest, CompletionRequest
from llada_jax.server.requests import RequestError, Served, check_model, jobs_of
from llada_jax.server.responses import DONE, Response, error_body, sse
from llada_jax.server.runs import Run, Update

RETRY_AFTER_S = 1
log = logging.getLogger("llada.serve")


def create_app(served: Served, engine: Engine, api_key: str | None = None) -> FastAPI:
    """The server's ASGI app; `engine` is closed when the app shuts down. With `api_key`, every `/v1` request
    must carry it as its bearer token."""
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        engine.close()

    app = FastAPI(title="llada-jax", lifespan=lifespan)
    _add_error_handlers(app)
    if api_key:
        _require_api_key(app, api_key)
    app.add_middleware(OneLineErrors)
    app.add_middleware(BodyLimit)  # the outermost: a body too large is refused before anything reads it
    started = int(time.time())
    model_card = {"id": served.name, "object": "model", "created": started, "owned_by": "llada-jax",
                  "max_model_len": served.context}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok", "model": served.name, **engine.load}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model(served, model)
        return model_card

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _answer(served, engine, body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await _answer(served, engine, body, request, chat=True)

    return app


async def _answer(served: Served, engine: Engine, body, request: Request, chat: bool):
    unknown = body.unknown_fields()
    if unknown:
        log.warning("ignoring fields the API does not have: %s", ", ".join(unknown))
    jobs = await run_in_threadpool(jobs_of, served, body, engine.capacity)  # tokenizing may take a while
    run = Run(engine, jobs, served.tokenizer, body.canvas)
    response = Response(served.name, chat, sum(job.prompt_tokens for job in jobs[:: body.n]), body.include_usage)
    if body.stream:
        return EventStream(_stream(run, response, request), run)
    texts: list[str] = [""] * len(jobs)
    lasts: list[Update | None] = [None] * len(jobs)
    async for update in run.updates(poll=request.is_disconnected):
        texts[update.index] += update.delta
        if update.last:
            lasts[update.index] = update
    failed = next((last.error for last in lasts if last is not None and last.error is not None), None)
    if None in lasts or failed is not None:  # the client went away (nobody reads this), or a generation failed
        return JSONResponse(error_body(f"generation failed: {failed or 'cancelled'}", "server_error"), status_code=500)
    return JSONResponse(response.whole([(text, last) for text, last in zip(texts, lasts) if last is not None]))


class EventStream(StreamingResponse):
    """Server-sent events that cancel their run however the response ends: a client that disconnects stops
    the response at any await, where the body's generators may be left suspended, not closed."""

    def __init__(self, body, run: Run):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.run = run

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.cancel()


async def _stream(run: Run, response: Response, request: Request):
    """The SSE body: the chat role, then each settled piece of text per choice, usage, [DONE]. A failed
    generation ends the stream with an error event (the `openai` client raises it)."""
    for chunk in response.opening(len(run.jobs)):
        yield chunk
    tokens = 0
    async for update in run.updates(poll=request.is_disconnected):  # polling also resumes reading the socket
        if update.error is not None:
            yield sse(error_body(f"generation failed: {update.error}", "server_error"))
            return
        tokens += update.tokens if update.last else 0
        yield response.chunk(update)
    if response.include_usage:
        yield response.usage_chunk(tokens)
    yield DONE


def _require_api_key(app: FastAPI, api_key: str) -> None:
    expected = api_key.encode()

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            scheme, _, key = given.strip().partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), expected):
                message = "a wrong API key" if given else "no API key (send it as the bearer token)"
                return JSONResponse(error_body(f"the request carries {message}", "invalid_request_error", None,
                                               "invalid_api_key"), status_code=401)
        return await call_next(request)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_request, error: RequestValidationError):
        return JSONResponse(error_body(*_validation_message(error.errors())), status_code=400)

    @app.exception_handler(RequestError)
    async def refused(_request, error: RequestError):
        return JSONResponse(error_body(str(error), error.kind, error.param, error.code), status_code=error.status)

    @app.exception_handler(Busy)
    async def busy(_request, error: Busy):
        return JSONResponse(error_body(str(error), "rate_limit_error", None, "server_busy"), status_code=429,
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(HTTPException)
    async def http(_request, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(error.detail), kind), status_code=error.status_code)


def _validation_message(errors: Sequence[dict]) -> tuple[str, str, str | None]:
    """(message, kind, param) of the first bad field."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", \
            "invalid_request_error", None
    location = [str(part) for part in first["loc"][1:]] if first["loc"][:1] == ("body",) else []
    named = getattr(first.get("ctx", {}).get("error"), "param", None)  # a rule across fields names its field
    location += [named] if named else []
    message = first["msg"].removeprefix("Value error, ")
    if not location:
        if first.get("type") in ("missing", "model_attributes_type", "dict_type", "model_type"):
            message = "it must be a JSON object (Content-Type: application/json)"
        return f"the request body is invalid: {message}", "invalid_request_error", None
    param = location[0]
    if len(location) > 1 and _type_tag(location[1]):  # pydantic names a union's alternatives in the location
        return f"{param}: {UNION_HINTS.get(param, 'has the wrong type')}", "invalid_request_error", param
    if first.get("type") == "missing":
        message = "field required"
    return f"{'.'.join(part for part in location if not _type_tag(part))}: {message}", "invalid_request_error", param


UNION_HINTS = {"prompt": "must be a string, a list of strings, a list of token ids or a list of such lists",
               "stop": "must be a string or a list of strings"}


def _type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or part.startswith(("list[", "dict["))
