"""`llada serve`: the official `openai` client against the server on 127.0.0.1 (the embedded model):
answers equal `generate` alone, however many requests run together, streamed or whole; stop sequences;
bad requests as typed 400/404 errors naming the field; a full queue as 429; a client that disconnects
cancels its generation. The engine alone: requests joining at any step each decode as alone."""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.backends.select import select_backend
from llada_jax.cli import main
from llada_jax.server.app import create_app
from llada_jax.server.engine import Busy, Engine
from llada_jax.server.requests import Defaults, Served
from llada_jax.system.locations import EMBEDDED_DIR
from llada_jax.weights.tokenizer import answer_text
from policies.generation import prepare_generation
from policies.options import GenerationOptions
from tests.conftest import TINY

NAME = "tiny-llada"
DEFAULTS = Defaults(gen_length=32, block_length=8, steps=32, policy="dual-cache+speculative", threshold=0.9)
QUESTIONS = ["sort 7 2 9 4 1 8 3 6 5 0", "reverse 3 1 4 1 5", "sort 9 8 7", "copy 1 2 3 4 5 6",
             "reverse 2 7 1 8 2 8", "sort 5 3 1", "copy 9 9 1", "sort 4 6 2 8 0"]


@pytest.fixture(scope="module")
def embedded():
    return llada_jax.load(EMBEDDED_DIR)


@contextlib.contextmanager
def serving(model, max_batch: int = 4, max_queue: int = 8, make_backend=None, api_key=None, defaults=DEFAULTS):
    """The app on uvicorn in a thread; yields (base URL, engine)."""
    served = Served(NAME, model.config, model.tokenizer, defaults)
    engine = Engine(make_backend or functools.partial(select_backend, model), 256, max_batch, max_queue)
    with running(create_app(served, engine, api_key)) as url:
        yield url, engine


@contextlib.contextmanager
def running(app):
    """`app` on uvicorn in a thread; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join()


@pytest.fixture(scope="module")
def server(embedded):
    with serving(embedded) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="unused", max_retries=0, timeout=60)


def alone(model, question: str, **options) -> str:
    """The answer `generate` gives the chat prompt alone, as the server cuts it (at EOS / EoT)."""
    ids = np.array(model.tokenizer.encode(model.tokenizer.chat_prompt(question)))
    setting = dict(gen_length=32, block_length=8, steps=32, policy="dual-cache+speculative", threshold=0.9)
    result = llada_jax.generate(model, ids, **{**setting, **options})
    return answer_text(model.tokenizer, result.output_ids, model.config)


def streamed_chat(client, question: str, **extra) -> tuple[str, str, list]:
    """(text, finish reason, chunks) of a streamed chat answer."""
    chunks = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}],
                                                 stream=True, stream_options={"include_usage": True}, **extra))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1
    return text, finish[0], chunks


def test_models_lists_the_served_model(client):
    before = time.time()
    models = client.models.list().data
    assert [model.id for model in models] == [NAME]
    assert before - 3600 < models[0].created <= before  # the server's start time


def test_fields_clients_send_at_neutral_values_are_accepted(client, embedded):
    out = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": QUESTIONS[0]}], response_format={"type": "text"},
        tool_choice="none", store=False, parallel_tool_calls=False, user="someone", metadata={"team": "a"},
        service_tier="auto", seed=3, logit_bias={}, presence_penalty=0, frequency_penalty=0, n=1, top_p=1,
        stream_options=None, modalities=["text"])
    assert out.choices[0].message.content == alone(embedded, QUESTIONS[0]) == "0 1 2 3 4 5 6 7 8 9"


def test_fields_the_api_does_not_have_are_ignored_with_a_warning(client, embedded, caplog):
    with caplog.at_level("WARNING", logger="llada.serve"):
        out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                             extra_body={"colour": "blue", "top_k": 5})
    assert out.choices[0].message.content == alone(embedded, QUESTIONS[0])
    assert any("colour, top_k" in record.getMessage() for record in caplog.records)


UNSUPPORTED = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools", "tools are unsupported"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice is unsupported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "'json_object' is unsupported"),
    ({"store": True}, "store", "store is unsupported"),
    ({"extra_body": {"reasoning_effort": "high"}}, "reasoning_effort", "reasoning_effort is unsupported"),
]


@pytest.mark.parametrize("fields,param,words", UNSUPPORTED, ids=[case[1] for case in UNSUPPORTED])
def test_fields_that_cannot_be_honoured_are_refused_as_unsupported(client, fields, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "sort 3 1"}], **fields)
    assert caught.value.body["param"] == param and words in caught.value.body["message"], caught.value.body


def test_an_api_key_guards_every_v1_route(embedded):
    with serving(embedded, api_key="s3cret") as (url, _):
        with pytest.raises(openai.AuthenticationError, match="wrong API key"):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        with pytest.raises(urllib.error.HTTPError) as caught:  # no Authorization header at all
            urllib.request.urlopen(f"{url}/models", timeout=30)
        assert caught.value.code == 401 and "no API key" in json.loads(caught.value.read())["error"]["message"]
        keyed = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0, timeout=60)
        out = keyed.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTIONS[0]}])
        assert out.choices[0].message.content == alone(embedded, QUESTIONS[0])
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as health:
            assert json.loads(health.read())["status"] == "ok"


def test_streaming_chat_answers_as_generate_alone(client, embedded):
    text, finish, chunks = streamed_chat(client, QUESTIONS[0])
    assert text == alone(embedded, QUESTIONS[0]) == "0 1 2 3 4 5 6 7 8 9"
    assert finish == "stop"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == len(embedded.tokenizer.encode(text))


@pytest.mark.slow
def test_concurrent_streams_each_answer_as_alone(client, embedded, server):
    """Eight streams at once, over four rows: each answer is its prompt's answer alone."""
    answers: dict[str, str] = {}

    def ask(question):
        answers[question] = streamed_chat(client, question, extra_body={"policy": "dual-cache"})[0]

    threads = [threading.Thread(target=ask, args=(question,)) for question in QUESTIONS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == {question: alone(embedded, question, policy="dual-cache", threshold=None)
                       for question in QUESTIONS}
    assert server[1].load == {"running": 0, "waiting": 0}


@pytest.mark.parametrize("policy", ["vanilla", "prefix-cache+speculative@0.7", "dual-cache+revision@0.5"])
def test_streamed_text_is_the_whole_answer(client, policy):
    """The pieces streamed as they settle add up to the answer given whole (revision: settled at the end)."""
    extra = {"extra_body": {"policy": policy}, "max_tokens": 24}
    whole = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTIONS[3]}], **extra)
    text, finish, _ = streamed_chat(client, QUESTIONS[3], **extra)
    assert text == whole.choices[0].message.content and finish == whole.choices[0].finish_reason


def test_completions_take_batches_of_prompts_and_ids(client, embedded):
    prompts = [embedded.tokenizer.chat_prompt(question) for question in QUESTIONS[:2]]
    ids = embedded.tokenizer.encode(prompts[1])
    out = client.completions.create(model=NAME, prompt=prompts, max_tokens=30, n=2)
    assert [choice.index for choice in out.choices] == [0, 1, 2, 3]
    want = [alone(embedded, question) for question in QUESTIONS[:2]]
    assert [choice.text for choice in out.choices] == [want[0], want[0], want[1], want[1]]
    assert out.usage.prompt_tokens == sum(len(embedded.tokenizer.encode(p)) for p in prompts)
    assert client.completions.create(model=NAME, prompt=ids, max_tokens=32).choices[0].text == want[1]


def test_stop_sequences_cut_the_answer(client):
    question = QUESTIONS[0]
    whole = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}], stop=["5 6"])
    assert whole.choices[0].message.content == "0 1 2 3 4 " and whole.choices[0].finish_reason == "stop"
    assert streamed_chat(client, question, stop=["5 6", "xyz"])[:2] == ("0 1 2 3 4 ", "stop")


@pytest.mark.slow
def test_max_tokens_cuts_an_answer_generated_in_whole_blocks(client, embedded):
    """17 tokens asked in blocks of 16: the canvas has two blocks and the answer is its first 17 tokens (the
    tiny vocabulary spells a character a token), streamed or not."""
    two_blocks = alone(embedded, QUESTIONS[0], gen_length=32, block_length=16, steps=32)
    assert two_blocks == "0 1 2 3 4 5 6 7 8 9"
    ask = dict(max_tokens=17, extra_body={"block_length": 16})
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTIONS[0]}], **ask)
    assert out.choices[0].message.content == two_blocks[:17] and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 17
    assert streamed_chat(client, QUESTIONS[0], **ask)[:2] == (two_blocks[:17], "length")


BAD_REQUESTS = [
    ({"max_tokens": 4000}, "max_tokens", "maximum context length is 256"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"top_p": 0.5}, "top_p", "only top_p=1"),
    ({"n": 50}, "n", "less than or equal to 8"),
    ({"presence_penalty": 0.5}, "presence_penalty", "unsupported"),
    ({"logprobs": True}, "logprobs", "unsupported"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"extra_body": {"policy": "turbo"}}, "policy", "unknown policy 'turbo'"),
    ({"extra_body": {"block_length": 8, "steps": 6}}, "steps", "not divisible"),
    ({"extra_body": {"policy": "dual-cache@0.9", "threshold": 0.5}}, "threshold", "give the commit threshold once"),
    ({"extra_body": {"remasking": "sideways"}}, "remasking", "'low_confidence' or 'random'"),
]


@pytest.mark.parametrize("fields,param,words", BAD_REQUESTS, ids=[case[1] for case in BAD_REQUESTS])
def test_bad_requests_name_the_field(client, fields, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "sort 3 1"}], **fields)
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error


def test_bad_prompts_and_models(client, server):
    with pytest.raises(openai.NotFoundError, match="gpt-5"):
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary") as caught:
        client.completions.create(model=NAME, prompt=[1, 2, 999])
    assert caught.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="no token for"):
        client.completions.create(model=NAME, prompt="caf\u00e9")
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=NAME, messages=[])
    raw = urllib.request.Request(f"{server[0]}/chat/completions", b"{not json", {"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(raw, timeout=30)
    assert caught.value.code == 400 and "not valid JSON" in json.loads(caught.value.read())["error"]["message"]


def test_serve_refuses_a_taken_port_in_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--port", str(taken.getsockname()[1])]) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("llada: error: cannot listen on 127.0.0.1:") and "\n" not in error


def test_serve_takes_the_model_positionally_or_by_flag_once(capsys, tmp_path, monkeypatch):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    assert main(["serve", str(tmp_path / "nowhere"), "--port", port]) == 1
    assert f"{tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--model", str(tmp_path), "--port", port]) == 1
    assert "either positionally or with --model" in capsys.readouterr().err
    assert main(["serve", "--temperature", "inf", "--port", port]) == 1
    assert "--temperature and --cfg-scale must be finite numbers >= 0" in capsys.readouterr().err
    monkeypatch.setenv("LLADA_API_KEY", " ")
    assert main(["serve", "--port", port]) == 1
    assert "must not be empty" in capsys.readouterr().err


def test_a_client_that_disconnects_cancels_its_generation(embedded):
    """The client reads the first chunk and closes its connection: the generation stops at its next step,
    freeing its row. A raw socket, because the `openai` client's `stream.close()` (httpx2's pool) may keep
    the connection open, and then the server rightly sees no disconnect."""
    gate = threading.Event()
    with serving(embedded, make_backend=slowed(embedded, gate)) as (url, engine):
        host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {"model": NAME, "stream": True, "max_tokens": 64, "policy": "vanilla",
                "messages": [{"role": "user", "content": QUESTIONS[0]}]}
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")  # the assistant role
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        assert wait_for(lambda: engine.cancelled == 1), (engine.cancelled, engine.load)
        gate.set()
        assert wait_for(lambda: engine.load == {"running": 0, "waiting": 0})


def test_a_full_queue_answers_429(embedded):
    gate = threading.Event()
    with serving(embedded, max_batch=1, max_queue=1, make_backend=slowed(embedded, gate)) as (url, engine):
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        ask = functools.partial(client.chat.completions.create, model=NAME,
                                messages=[{"role": "user", "content": QUESTIONS[2]}], extra_body={"policy": "vanilla"})
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(ask().choices[0].message.content)) for _ in range(2)]
        for thread in threads:
            thread.start()
        assert wait_for(lambda: engine.load == {"running": 1, "waiting": 1})
        with pytest.raises(openai.RateLimitError, match="at capacity"):
            ask()
        gate.set()
        for thread in threads:
            thread.join()
        assert answers == [alone(embedded, QUESTIONS[2], policy="vanilla", threshold=None)] * 2


def slowed(model, gate: threading.Event):
    """A `make_backend` whose steps wait for `gate` (a generation that runs until the test lets it go on)."""
    return hooked(model, lambda: gate.wait(30))


def hooked(model, before):
    """A `make_backend` whose every step first calls `before()`."""
    return lambda request: Hooked(select_backend(model, request), before)


class Hooked:
    def __init__(self, backend, before):
        self.backend, self.before = backend, before

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def full(self, *args):
        self.before()
        return self.backend.full(*args)

    def window(self, *args):
        self.before()
        return self.backend.window(*args)


def wait_for(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@settings(max_examples=6)
@given(lengths=st.lists(st.integers(1, 20), min_size=2, max_size=5), delays=st.lists(st.integers(0, 3), max_size=5),
       seed=st.integers(0, 1000))
@pytest.mark.slow
def test_requests_joining_at_any_step_decode_as_alone(tiny_model, lengths, delays, seed):
    """Continuous batching: generations submitted while others run (different lengths, settings, policies)
    each give the tokens and forward passes of their prompt alone."""
    settings_ = [dict(policy="dual-cache", threshold=None), dict(policy="dual-cache+speculative:2:0.3", threshold=0.3),
                 dict(policy="vanilla", threshold=None, temperature=0.8), dict(policy="prefix-cache", threshold=0.5)]
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, TINY.mask_token_id, length) for length in lengths]
    options = [dict(gen_length=16, block_length=8, steps=8, seed=index, **settings_[index % len(settings_)])
               for index in range(len(prompts))]
    engine = Engine(functools.partial(select_backend, tiny_model), 64, max_batch=3, max_queue=8)
    try:
        tickets = []
        for index, prompt in enumerate(prompts):
            tickets.append(engine.submit(prepare_generation(tiny_model.config, prompt,
                                                            GenerationOptions(**options[index]))))
            time.sleep(0.005 * (delays[index] if index < len(delays) else 0))
        results = [ticket.future.result(timeout=120) for ticket in tickets]
    finally:
        engine.close()
    for prompt, option, result in zip(prompts, options, results):
        want = llada_jax.generate(tiny_model, prompt, loop="host", **option)
        assert (result.output_ids.tolist(), result.nfe) == (want.output_ids.tolist(), want.nfe)


def gated_engine(model, max_queue: int):
    """(gate, an engine of one row whose steps wait for the gate, a short generation to submit to it)."""
    gate = threading.Event()
    engine = Engine(slowed(model, gate), 64, max_batch=1, max_queue=max_queue)
    prepared = prepare_generation(model.config, np.arange(10, 14),
                                  GenerationOptions(gen_length=8, block_length=8, steps=8))
    return gate, engine, prepared


def test_the_engine_refuses_past_its_queue(tiny_model):
    gate, engine, prepared = gated_engine(tiny_model, max_queue=0)
    try:
        first = engine.submit(prepared)
        with pytest.raises(Busy, match="1 generations running, 0 waiting"):
            engine.submit(prepared)
        gate.set()
        first.future.result(timeout=60)
        engine.submit(prepared).future.result(timeout=60)  # room again
    finally:
        gate.set()
        engine.close()


def test_a_waiting_generation_whose_future_is_cancelled_frees_its_place(tiny_model):
    """Cancelled through its future (not its ticket) while it waits: the engine skips it and keeps no row for it."""
    gate, engine, prepared = gated_engine(tiny_model, max_queue=1)
    try:
        first, second = engine.submit(prepared), engine.submit(prepared)
        assert second.future.cancel()
        gate.set()
        first.future.result(timeout=60)
        assert wait_for(lambda: engine.load == {"running": 0, "waiting": 0})
        engine.submit(prepared).future.result(timeout=60)
    finally:
        gate.set()
        engine.close()
