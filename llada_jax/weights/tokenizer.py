"""Tokenizer of an HF model directory: `tokenizer.json` via `tokenizers`, special tokens and the chat
template from `tokenizer_config.json` / `special_tokens_map.json`."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from llada_jax.system.errors import LladaError

if TYPE_CHECKING:  # loaded with the first tokenizer (see load_tokenizer), not by every import
    from tokenizers import Tokenizer as HFTokenizer

EOT_TOKEN = "<|eot_id|>"
# A token covers at most the vocabulary's longest token of normalized text, and a normalizer (NFC) composes at most
# a few characters into one: text longer than that bound cannot fit, and is refused before tokenizing it.
TEXT_MARGIN = 4
RENDER_SECONDS = 2.0  # a chat template renders in milliseconds; one still running after this never ends


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    backend: HFTokenizer
    chat_template: str | None
    special_tokens: dict          # role -> token text: bos_token, eos_token, ...

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """Token ids as HF's `tokenizer(text)["input_ids"]` gives them (post-processor applied). Text the
        vocabulary cannot represent is refused, naming its first character: a tokenizer with an unknown
        token would silently encode another prompt (byte-level BPE, like LLaDA-8B's, represents all). With
        `limit` (a context's tokens), text far too long for it is refused before the tokenizer spends seconds
        and gigabytes on it."""
        check_text(text)
        if limit is not None and len(text) > limit * self.longest_token_chars * TEXT_MARGIN:
            raise LladaError(f"the text ({len(text)} characters) cannot fit a context of {limit} tokens")
        try:
            encoding = self.backend.encode(text, add_special_tokens=True)
        except Exception as err:  # the tokenizers library raises plain Exceptions (a vocabulary without its unk)
            raise LladaError(f"the tokenizer cannot encode the text: {str(err).splitlines()[0]}") from None
        unknown = getattr(self.backend.model, "unk_token", None)
        unknown_id = self.backend.token_to_id(unknown) if unknown else None
        spans = [(start, end) for token_id, (start, end) in zip(encoding.ids, encoding.offsets)
                 if end > start and not (token_id == unknown_id and text[start:end] != unknown)]
        missing = first_uncovered(text, spans)  # an unknown token, or a character the tokenizer dropped
        if missing is not None:
            char = text[missing]
            raise LladaError(f"the model's vocabulary has no token for {char!r} (U+{ord(char):04X}), "
                             "the first such character of the text")
        return encoding.ids

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters of (normalized) text one token covers: a byte-level token's text spells a byte
        per character, a piece's at least one per character."""
        return max(len(token) for token in self.backend.get_vocab(with_added_tokens=True))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        return self.backend.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def chat_prompt(self, user_text: str) -> str:
        """One user turn rendered with the checkpoint's chat template and the generation prompt."""
        return self.chat([{"role": "user", "content": user_text}])

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """A conversation (`{"role", "content"}` turns) rendered with the chat template (and the assistant's
        generation prompt)."""
        if not self.chat_template:
            raise LladaError("this model's tokenizer_config.json has no chat_template, so it takes plain prompts only "
                             "(drop --chat; a server: /v1/completions)")
        for message in messages:  # a template would render anything else as its Python spelling
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise LladaError(f"a chat turn must be {{'role': text, 'content': text}}, got {message!r:.80}")
        return render_chat_template(self.chat_template, messages, self.special_tokens, add_generation_prompt)


def answer_text(tokenizer: Tokenizer, output_ids, config) -> str:
    """The decoded answer: everything before the first EoT/EOS (what follows is the canvas's padding)."""
    ids = [int(token) for token in output_ids]
    for stop in (config.eot_token_id, config.eos_token_id):
        if stop in ids:
            ids = ids[: ids.index(stop)]
    return tokenizer.decode(ids)


def check_text(text) -> None:
    """Text the tokenizer can take: a string whose characters UTF-8 can spell (not a lone surrogate, which is
    what an undecodable byte of a command line becomes)."""
    if not isinstance(text, str):
        raise LladaError(f"text must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise LladaError(f"the text is not valid UTF-8 (an undecodable byte or a lone surrogate at character "
                         f"{err.start})") from None


def first_uncovered(text: str, spans: list[tuple[int, int]]) -> int | None:
    """The first non-whitespace character of `text` outside every `(start, end)` span, or None."""
    covered = bytearray(len(text))
    for start, end in spans:
        covered[start:end] = b"\1" * (end - start)
    return next((index for index, flag in enumerate(covered) if not flag and not text[index].isspace()), None)


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
    """Compile a chat template once, in a sandbox, as transformers compiles it: loop controls (`break`,
    `continue`), `{% generation %}` blocks, `raise_exception`, `strftime_now`, and `tojson` that keeps
    non-ASCII text and takes json.dumps' options."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _generation_blocks()])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(template)
    except TemplateError as err:
        raise LladaError(f"chat template does not parse: {err}") from None


def _raise_exception(message):
    from jinja2 import TemplateError

    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _generation_blocks():
    """`{% generation %}...{% endgeneration %}` (marks the assistant's text for training masks): its body, as is."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlocks(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationBlocks


def render_chat_template(template: str, messages: list[dict], special_tokens: dict,
                         add_generation_prompt: bool = True) -> str:
    """Render a jinja chat template with the variables transformers passes (no tools, no documents)."""
    from jinja2 import TemplateError

    template_code = _compiled_template(template)
    try:
        with time_bound(RENDER_SECONDS):
            return template_code.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=None, documents=None, **special_tokens)
    except TooSlow:
        raise LladaError(f"chat template did not finish rendering within {RENDER_SECONDS:g} s (a loop without "
                         "end?); fix the model's tokenizer_config.json") from None
    except Exception as err:  # the checkpoint's template is code: any error it raises is the template's
        detail = str(err) if isinstance(err, TemplateError) else f"{type(err).__name__}: {err}"
        raise LladaError(f"chat template failed: {detail}") from None


class TooSlow(Exception):
    pass


@contextlib.contextmanager
def time_bound(seconds: float):
    """Python code run inside (a compiled template: the checkpoint's code) raises TooSlow once `seconds` have
    passed, at its next line: a trace function on this thread checks the clock."""
    deadline = time.monotonic() + seconds
    previous = sys.gettrace()

    def tracer(frame, event, arg):
        if time.monotonic() > deadline:
            raise TooSlow
        return tracer

    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def read_special_tokens(model_dir: Path) -> tuple[dict, str | None]:
    """Special token texts (bos_token, eos_token, ...) and the chat template, if the files exist."""
    special: dict = {}
    template = None
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise LladaError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise LladaError(f"{path}: expected a JSON object")
        for key in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token"):
            text = _token_text(data.get(key))
            if text is not None:
                special[key] = text
        template = data.get("chat_template", template)
    if isinstance(template, list):  # HF allows a list of named templates
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise LladaError(f"{model_dir}: chat_template must be a template's text or a list of named templates, "
                         f"got {type(template).__name__}")
    return special, template


def eot_id_from_files(model_dir: Path) -> int | None:
    """The id of `<|eot_id|>` as declared in tokenizer_config.json's added tokens, if any."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        added = json.loads(path.read_text()).get("added_tokens_decoder", {})
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None  # not a JSON object: reading the tokenizer refuses the file in one line
    if not isinstance(added, dict):
        raise LladaError(f"{path}: added_tokens_decoder must map token ids to tokens")
    for token_id, entry in added.items():
        if isinstance(entry, dict) and entry.get("content") == EOT_TOKEN:
            if not (token_id.isascii() and token_id.isdigit()):
                raise LladaError(f"{path}: added_tokens_decoder names {EOT_TOKEN} with id {token_id!r}, not a token id")
            return int(token_id)
    return None


def load_tokenizer(model_dir: Path) -> Tokenizer | None:
    """The model's tokenizer, or None when the directory has no tokenizer.json."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer as HFTokenizer

    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers library raises plain Exceptions for bad files
        raise LladaError(f"{path}: cannot load tokenizer ({str(err).splitlines()[0]})") from None
    special, template = read_special_tokens(Path(model_dir))
    return Tokenizer(backend, template, special)
