"""ASGI guards around the app: a request body over `MAX_BODY_BYTES` is refused (413) before any of it is parsed;
one that stops arriving for `BODY_IDLE_S` is answered 408 and its connection closed (uvicorn has no body-read
timeout: a body shorter than its Content-Length held the connection forever); an unexpected error is answered as
a one-line 500 on a connection that stays usable (Starlette's own handler re-raises after answering, so uvicorn
logs the error twice and drops the keep-alive connection)."""

from __future__ import annotations

import asyncio
import logging

from fastapi.responses import JSONResponse

from llada_jax.server.responses import error_body

# The largest legitimate request (a full queue's prompts at a long context, as JSON token ids) is far below this.
MAX_BODY_BYTES = 32 * 2**20
BODY_IDLE_S = 30.0  # the longest wait for the next piece of a request body
log = logging.getLogger("llada.serve")


class BodyLimit:
    """Reads an HTTP request's body, at most `limit` bytes of it, before the app sees it."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), BODY_IDLE_S)
            except TimeoutError:
                return await self._stalled(scope, receive, send)
            if message["type"] != "http.request":  # the client went away while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            more = message.get("more_body", False)
        replayed = False

        async def replay():  # the body once, then the connection's own messages (a disconnect)
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _stalled(self, scope, receive, send):
        message = f"the request body stopped arriving for {BODY_IDLE_S:g} s"
        await JSONResponse(error_body(message), status_code=408, headers={"Connection": "close"})(scope, receive, send)

    async def _refuse(self, scope, receive, send):
        message = f"the request body is larger than the server takes ({self.limit // 2**20} MiB)"
        await JSONResponse(error_body(message), status_code=413, headers={"Connection": "close"})(scope, receive, send)


class OneLineErrors:
    """An exception the app did not handle: logged once with its traceback, answered as an OpenAI 500 body."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as error:  # a defect; a response already under way cannot be replaced
            if started:
                raise
            log.error("request failed", exc_info=error)
            body = error_body(f"internal error: {type(error).__name__}: {error}", "server_error")
            await JSONResponse(body, status_code=500)(scope, receive, send)
