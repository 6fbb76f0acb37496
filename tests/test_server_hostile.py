"""`llada serve` against requests no client library would send, over raw HTTP: every one is a 4xx in OpenAI's
error shape naming the field, none a 500, none stalls other requests, and the connection stays usable."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import pytest

import llada_jax
import llada_jax.server.app
import llada_jax.server.guards
from llada_jax.server.guards import MAX_BODY_BYTES
from llada_jax.system.locations import EMBEDDED_DIR
from tests.test_server import NAME, QUESTIONS, hooked, serving, wait_for

CHAT = {"model": NAME, "messages": [{"role": "user", "content": QUESTIONS[0]}]}


@pytest.fixture(scope="module")
def embedded():
    return llada_jax.load(EMBEDDED_DIR)


@pytest.fixture(scope="module")
def server(embedded):
    with serving(embedded, max_batch=4, max_queue=8) as (url, engine):
        yield url.removeprefix("http://").removesuffix("/v1"), engine


def connect(server) -> http.client.HTTPConnection:
    host, port = server[0].split(":")
    return http.client.HTTPConnection(host, int(port), timeout=60)


def ask(connection, path: str, body=None, headers=None) -> tuple[int, dict]:
    """(status, JSON body) of one request on `connection` (kept open); `body` is sent as JSON unless bytes."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection.request("POST" if data is not None else "GET", path, data,
                       {"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def post(server, path: str, body) -> tuple[int, dict]:
    connection = connect(server)
    try:
        return ask(connection, path, body)
    finally:
        connection.close()


BAD = [  # (path, body, the field, words of the message)
    ("completions", {"model": NAME, "prompt": "\ud800"}, "prompt", "lone UTF-16 surrogate"),
    ("completions", {"model": NAME, "prompt": ["sort 1", "x\udc00"]}, "prompt", "lone UTF-16 surrogate"),
    ("completions", {"model": "\ud800", "prompt": "sort 1"}, "model", "lone UTF-16 surrogate"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "a\ud800"}]}, "messages",
     "messages.0.content: holds"),
    ("completions", {"model": NAME, "prompt": "sort 1", "max_tokens": "5"}, "max_tokens", "valid integer"),
    ("completions", {"model": NAME, "prompt": "sort 1", "max_tokens": True}, "max_tokens", "valid integer"),
    ("completions", {"model": NAME, "prompt": "sort 1", "temperature": "0.5"}, "temperature", "valid number"),
    ("completions", {"model": NAME, "prompt": "sort 1", "stream": "true"}, "stream", "valid boolean"),
    ("completions", {"model": NAME, "prompt": [1.0, 2.0]}, "prompt", "must be a string"),
    ("completions", {"model": NAME, "prompt": "sort 1", "logprobs": 0}, "logprobs", "unsupported"),
    ("completions", {"model": NAME, "prompt": [2**70]}, "prompt", "outside the vocabulary"),
    ("completions", {"model": NAME, "prompt": "sort 1", "stream_options": {}}, "stream_options",
     "stream_options: only allowed with stream=true"),
    ("completions", {"model": NAME, "prompt": ["sort 1", "sort 2"], "n": 8}, "prompt", "16 generations"),
    ("completions", {"model": NAME, "prompt": "a" * 20_000}, "prompt", "cannot fit a context of 256 tokens"),
    ("completions", {"model": NAME, "prompt": "a" * 300, "max_tokens": 8}, "prompt", "maximum context length is 256"),
    ("chat/completions", {**CHAT, "max_tokens": 8, "max_completion_tokens": 8}, "max_completion_tokens",
     "not both"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user"}]}, "messages", "a user message needs content"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages", "'image_url' are unsupported"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages", "a text part needs its text"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": ""}] * 4097}, "messages",
     "at most 4096 items"),
    ("chat/completions", {**CHAT, "steps": 10**12}, "steps", "more than the answer's 32 tokens"),
    ("chat/completions", {**CHAT, "block_length": 1000}, "block_length", "longer than the model's context of 256"),
    ("chat/completions", {**CHAT, "policy": "dual-cache+revision", "temperature": 0.5}, None,
     "revision re-scores with argmax readouts"),
]


@pytest.mark.parametrize("path,body,param,words", BAD, ids=[f"{case[2]}-{index}" for index, case in enumerate(BAD)])
def test_a_bad_field_is_a_400_naming_it(server, path, body, param, words):
    status, error = post(server, f"/v1/{path}", body)
    assert status == 400 and error["error"]["param"] == param and words in error["error"]["message"], error


def test_nan_is_no_temperature_and_null_is_a_default(server):
    status, error = post(server, "/v1/chat/completions", b'{"model": "%s", "temperature": NaN, "messages": '
                                                          b'[{"role": "user", "content": "sort 3 1"}]}' % NAME.encode())
    assert status == 400 and "temperature: Input should be a finite number" in error["error"]["message"]
    status, answer = post(server, "/v1/chat/completions", {**CHAT, "n": None, "stream": None})
    assert status == 200 and answer["choices"][0]["message"]["content"] == "0 1 2 3 4 5 6 7 8 9"


def test_a_body_that_is_not_a_json_object_says_so(server):
    for body in (b"", b"null", b"[1]"):
        status, error = post(server, "/v1/completions", body)
        assert status == 400 and "must be a JSON object" in error["error"]["message"], error


def test_unseeded_sampling_varies_and_a_seed_repeats(server):
    ask = {**CHAT, "temperature": 100}
    texts = [post(server, "/v1/chat/completions", ask)[1]["choices"][0]["message"]["content"] for _ in range(3)]
    assert len(set(texts)) > 1
    seeded = [post(server, "/v1/chat/completions", {**ask, "seed": 5})[1]["choices"][0]["message"]["content"]
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_health_and_models_answer_head_requests(server):
    connection = connect(server)
    try:
        for path in ("/health", "/v1/models"):
            connection.request("HEAD", path)
            response = connection.getresponse()
            assert response.status == 200 and response.read() == b""
    finally:
        connection.close()


def test_the_model_is_retrieved_by_its_id(server):
    connection = connect(server)
    try:
        assert ask(connection, f"/v1/models/{NAME}")[1]["id"] == NAME
        status, error = ask(connection, "/v1/models/gpt-5")
        assert status == 404 and error["error"]["code"] == "model_not_found"
    finally:
        connection.close()


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    for chunked in (False, True):
        connection = connect(server)
        try:
            connection.putrequest("POST", "/v1/completions")
            connection.putheader("Content-Type", "application/json")
            if chunked:  # no length declared: refused once more than the limit has come
                connection.putheader("Transfer-Encoding", "chunked")
                connection.endheaders()
                piece = b" " * 2**20
                for _ in range(MAX_BODY_BYTES // len(piece) + 1):
                    connection.send(b"%x\r\n%s\r\n" % (len(piece), piece))
                connection.send(b"0\r\n\r\n")
            else:  # a length over the limit: refused before a byte of the body is sent
                connection.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
                connection.endheaders()
            response = connection.getresponse()
            assert response.status == 413 and "larger than the server takes" in json.loads(response.read())["error"][
                "message"]
        finally:
            connection.close()
    assert post(server, "/v1/chat/completions", CHAT)[0] == 200


def test_a_body_that_stops_arriving_is_answered_408_and_its_connection_closed(server, monkeypatch):
    """A body shorter than its Content-Length (a client gone quiet, or a slow-body attack) does not hold the
    connection: after BODY_IDLE_S without a byte, a 408, and the server closes it."""
    monkeypatch.setattr(llada_jax.server.guards, "BODY_IDLE_S", 0.5)
    connection = connect(server)
    try:
        connection.putrequest("POST", "/v1/chat/completions")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", "100")
        connection.endheaders()
        connection.send(b'{"model": ')
        response = connection.getresponse()
        assert response.status == 408
        assert json.loads(response.read())["error"]["message"] == "the request body stopped arriving for 0.5 s"
        assert response.getheader("Connection") == "close"
        assert connection.sock is None or connection.sock.recv(1) == b""  # closed by the server
    finally:
        connection.close()
    assert post(server, "/v1/chat/completions", CHAT)[0] == 200


def test_an_unexpected_error_is_one_500_and_the_connection_goes_on(server, monkeypatch, caplog):
    def broken(*_args):
        raise RuntimeError("a defect")

    monkeypatch.setattr(llada_jax.server.app, "jobs_of", broken)
    connection = connect(server)
    try:
        with caplog.at_level("ERROR"):
            status, error = ask(connection, "/v1/chat/completions", CHAT)
        assert status == 500 and error["error"]["message"] == "internal error: RuntimeError: a defect"
        assert [record.getMessage() for record in caplog.records if record.levelname == "ERROR"] == ["request failed"]
        monkeypatch.undo()
        assert ask(connection, "/v1/chat/completions", CHAT)[0] == 200  # the same keep-alive connection
    finally:
        connection.close()


def test_prompts_are_tokenized_off_the_event_loop(server, monkeypatch):
    """A long prompt's tokenizing must not stall every other request: it runs where no event loop runs."""
    loops = []

    def jobs_of(*args):
        try:
            loops.append(asyncio.get_running_loop())
        except RuntimeError:
            loops.append(None)
        return original(*args)

    original = llada_jax.server.app.jobs_of
    monkeypatch.setattr(llada_jax.server.app, "jobs_of", jobs_of)
    assert post(server, "/v1/chat/completions", CHAT)[0] == 200 and loops == [None]


def test_a_lowercase_bearer_scheme_is_a_bearer_scheme(embedded):
    with serving(embedded, api_key="s3cret") as (url, engine):
        connection = connect((url.removeprefix("http://").removesuffix("/v1"), engine))
        try:
            assert ask(connection, "/v1/models", headers={"Authorization": "bearer s3cret"})[0] == 200
            assert ask(connection, "/v1/models", headers={"Authorization": "bearer wrong"})[0] == 401
        finally:
            connection.close()


def test_stream_chunks_carry_null_usage_until_the_last(server):
    connection = connect(server)
    try:
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        lines = connection.getresponse().read().decode().split("\n\n")
    finally:
        connection.close()
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines if line and line != "data: [DONE]"]
    assert all(chunk["usage"] is None for chunk in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] > 0


def test_a_client_gone_from_a_whole_response_cancels_it(embedded):
    """Not streamed, and every step sends an update (the canvas): the run still notices the client left."""
    steps = [0]
    with serving(embedded, make_backend=paced(embedded, 0.05, steps)) as (url, engine):
        connection = connect((url.removeprefix("http://").removesuffix("/v1"), engine))
        body = {**CHAT, "max_tokens": 64, "policy": "vanilla", "canvas": True}
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        assert wait_for(lambda: steps[0] >= 3)  # compiled, and updates come faster than a poll's interval
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        assert wait_for(lambda: engine.cancelled == 1), engine.load  # without it the 64 steps finish (3.2 s)
        assert wait_for(lambda: engine.load == {"running": 0, "waiting": 0})


def paced(model, seconds: float, steps: list[int]):
    """A `make_backend` whose every step takes at least `seconds`, counted in `steps[0]` as it starts."""
    def before():
        time.sleep(seconds)
        steps[0] += 1
    return hooked(model, before)
