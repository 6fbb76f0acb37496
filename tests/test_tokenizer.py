"""Tokenizer files: the real LLaDA-8B-Instruct chat template and special tokens, and a tokenizer.json."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from llada_jax.system.errors import LladaError
from llada_jax.weights.tokenizer import eot_id_from_files, load_tokenizer, read_special_tokens, render_chat_template
from tests.conftest import LLADA_8B_DIR


def test_real_instruct_chat_template_renders_one_user_turn():
    special, template = read_special_tokens(LLADA_8B_DIR)
    assert special["bos_token"] == "<|startoftext|>" and special["eos_token"] == "<|endoftext|>"
    text = render_chat_template(template, [{"role": "user", "content": "  What is 2+2? "}], special)
    assert text == ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


# A Llama-3.1-style template: the date from strftime_now, the turns until a {% break %}, a {% continue %}.
LLAMA3_STYLE = (
    "{{- bos_token }}{%- set date_string = strftime_now('%d %b %Y') %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\nToday Date: ' + date_string + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'ipython' %}{% continue %}{% endif %}"
    "{%- if message['content'] == 'STOP' %}{% break %}{% endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")


def test_templates_render_as_transformers_renders_them():
    import datetime

    turns = [{"role": "user", "content": "hi "}, {"role": "ipython", "content": "x"},
             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "STOP"},
             {"role": "user", "content": "never shown"}]
    today = datetime.datetime.now().strftime("%d %b %Y")
    assert render_chat_template(LLAMA3_STYLE, turns, {"bos_token": "<s>"}) == (
        f"<s><|start_header_id|>system<|end_header_id|>\n\nToday Date: {today}<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nhello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    non_ascii = [{"role": "user", "content": "caf\u00e9 \u2615"}]
    assert render_chat_template("{{ messages | tojson }}", non_ascii, {}) == \
        '[{"role": "user", "content": "caf\u00e9 \u2615"}]'
    assert render_chat_template("{{ messages[0] | tojson(indent=1, sort_keys=true) }}", non_ascii, {}) == \
        '{\n "content": "caf\u00e9 \u2615",\n "role": "user"\n}'
    marked = "{% for m in messages %}{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}"
    assert render_chat_template(marked, non_ascii, {}) == "[caf\u00e9 \u2615]"


def test_a_template_that_raises_is_a_one_line_error():
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('turns must start with the user') }}"
                "{% endif %}")
    with pytest.raises(LladaError, match="chat template failed: turns must start with the user"):
        render_chat_template(template, [{"role": "assistant", "content": "x"}], {})


@pytest.mark.parametrize("template, words", [("{{ 1/0 }}", "ZeroDivisionError"),
                                             ("{% for i in range(10**12) %}{% endfor %}", "OverflowError"),
                                             ("{{ messages.pop() }}", "access to attribute 'pop'")])
def test_a_template_that_fails_at_any_step_is_a_one_line_error(template, words):
    with pytest.raises(LladaError, match=f"chat template failed: {words}"):
        render_chat_template(template, [{"role": "user", "content": "x"}], {})


def test_a_template_that_never_ends_is_stopped_in_one_line(monkeypatch):
    """The checkpoint's template is code: nested loops of the sandbox's longest range would run for hours."""
    import sys

    from llada_jax.weights import tokenizer

    monkeypatch.setattr(tokenizer, "RENDER_SECONDS", 0.5)
    before = sys.gettrace()
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(LladaError, match=r"chat template did not finish rendering within 0.5 s"):
        render_chat_template(endless, [{"role": "user", "content": "x"}], {})
    assert sys.gettrace() is before  # the clock is off again (a debugger's or coverage's tracer is back)
    assert render_chat_template("{{ messages[0]['content'] }}", [{"role": "user", "content": "x"}], {}) == "x"


def test_real_instruct_eot_id_is_read_from_added_tokens():
    assert eot_id_from_files(LLADA_8B_DIR) == 126348


@pytest.fixture
def char_model_dir(tmp_path):
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ?")}
    special = ["<|startoftext|>", "<|endoftext|>", "<|eot_id|>", "<|mdm_mask|>", "<|start_header_id|>",
               "<|end_header_id|>", "\n"]  # every piece of the chat template
    for token in special:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(special)
    backend.save(str(tmp_path / "tokenizer.json"))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(LLADA_8B_DIR / name, tmp_path / name)
    return tmp_path


def test_tokenizer_json_round_trips_text_and_knows_special_tokens(char_model_dir):
    tokenizer = load_tokenizer(char_model_dir)
    ids = tokenizer.encode("hello world")
    assert len(ids) == 11 and tokenizer.decode(ids) == "hello world"
    assert tokenizer.token_id("<|mdm_mask|>") == 31
    prompt = tokenizer.encode(tokenizer.chat_prompt("hi"))
    assert prompt[0] == tokenizer.token_id("<|startoftext|>")


def test_missing_chat_template_is_a_clear_error(char_model_dir):
    config = json.loads((char_model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (char_model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(LladaError, match="no chat_template"):
        load_tokenizer(char_model_dir).chat_prompt("hi")


@pytest.mark.parametrize("file, change, words", [
    ("tokenizer_config.json", [], "expected a JSON object"),
    ("special_tokens_map.json", [], "expected a JSON object"),
    ("tokenizer_config.json", {"chat_template": 123}, "chat_template must be a template's text"),
    ("tokenizer_config.json", {"chat_template": ["x"]}, None),  # no default among the named: none
    ("tokenizer_config.json", {"added_tokens_decoder": [1, 2]}, "added_tokens_decoder must map token ids"),
    ("tokenizer_config.json", {"added_tokens_decoder": {"abc": {"content": "<|eot_id|>"}}}, "not a token id"),
    ("tokenizer_config.json", {"added_tokens_decoder": {"٣": {"content": "<|eot_id|>"}}}, "not a token id"),
])
def test_malformed_tokenizer_files_are_one_line_errors(char_model_dir, file, change, words):
    path = char_model_dir / file
    path.write_text(json.dumps(change if isinstance(change, list) else {**json.loads(path.read_text()), **change}))

    def read():
        return eot_id_from_files(char_model_dir), load_tokenizer(char_model_dir)

    if words is None:
        assert read()[1].chat_template is None
        return
    with pytest.raises(LladaError, match=words) as caught:
        read()
    assert "\n" not in str(caught.value)


def test_text_far_too_long_for_the_context_is_refused_before_tokenizing(char_model_dir):
    tokenizer = load_tokenizer(char_model_dir)
    bound = 4 * tokenizer.longest_token_chars * 8
    assert len(tokenizer.encode("a" * bound, limit=8)) == bound  # within the bound: tokenized (and too long)
    with pytest.raises(LladaError, match=f"the text \\({bound + 1} characters\\) cannot fit a context of 8 tokens"):
        tokenizer.encode("a" * (bound + 1), limit=8)


def test_corrupt_tokenizer_json_is_a_clear_error(char_model_dir):
    (char_model_dir / "tokenizer.json").write_text("{}")
    with pytest.raises(LladaError, match="cannot load tokenizer"):
        load_tokenizer(char_model_dir)


@pytest.mark.parametrize("text, char", [("héllo", "é"), ("a → b", "→"), ("ok ✓", "✓"), ("日本", "日")])
def test_text_outside_the_vocabulary_is_refused_naming_its_first_character(char_model_dir, text, char):
    tokenizer = load_tokenizer(char_model_dir)
    with pytest.raises(LladaError, match=f"no token for '{char}' \\(U\\+{ord(char):04X}\\)"):
        tokenizer.encode(text)
    assert tokenizer.decode(tokenizer.encode("what?")) == "what?"  # the unknown token's own text is fine


def rebuilt(char_model_dir, model) -> object:
    """The fixture's tokenizer with its model swapped (its vocabulary kept), loaded back."""
    backend = Tokenizer.from_file(str(char_model_dir / "tokenizer.json"))
    backend.model = model
    backend.save(str(char_model_dir / "tokenizer.json"))
    return load_tokenizer(char_model_dir)


def test_a_tokenizer_that_drops_what_it_cannot_spell_is_refused_not_obeyed(char_model_dir):
    """A BPE without an unknown token skips characters it lacks: "héllo" would be asked as "hllo"."""
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ?")}
    tokenizer = rebuilt(char_model_dir, models.BPE(vocab, [], unk_token=None))
    assert tokenizer.decode(tokenizer.encode("hello")) == "hello"
    for text in ("héllo", "ééé"):
        with pytest.raises(LladaError, match="no token for 'é' \\(U\\+00E9\\)"):
            tokenizer.encode(text)


def test_a_vocabulary_without_its_unknown_token_is_a_one_line_error(char_model_dir):
    tokenizer = rebuilt(char_model_dir, models.WordLevel({"a": 0, "b": 1}, unk_token="[UNK]"))
    with pytest.raises(LladaError, match="the tokenizer cannot encode the text: WordLevel error: Missing"):
        tokenizer.encode("abc")


@pytest.mark.parametrize("text, words", [("ab\udcffc", "not valid UTF-8 (an undecodable byte or a lone surrogate "
                                                       "at character 2)"),
                                         (b"ab", "text must be a string, got bytes"), (None, "got NoneType")])
def test_text_that_is_not_text_is_a_one_line_error(char_model_dir, text, words):
    with pytest.raises(LladaError, match=re.escape(words)):
        load_tokenizer(char_model_dir).encode(text)


def test_embedded_model_refuses_unrepresentable_prompt_in_one_line(capsys):
    from llada_jax.cli import main

    assert main(["generate", "--no-visual", "héllo → ✓ 日本"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err == ("llada: error: the model's vocabulary has no token for 'é' (U+00E9), "
                            "the first such character of the text\n")


def test_a_prompt_far_too_long_for_the_model_is_refused_in_one_line(capsys):
    from llada_jax.cli import main

    assert main(["generate", "--no-visual", "a" * 20_000]) == 1  # the embedded model: 256 tokens
    assert capsys.readouterr().err == ("llada: error: the text (20000 characters) cannot fit a context of 256 "
                                       "tokens\n")


@pytest.mark.parametrize("turn", [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                  {"role": "user", "content": None}, {"role": "user"}, {"content": "hi"}, "hi"])
def test_a_chat_turn_that_is_not_text_is_refused_not_rendered_as_its_python_spelling(char_model_dir, turn):
    with pytest.raises(LladaError, match="a chat turn must be {'role': text, 'content': text}, got "):
        load_tokenizer(char_model_dir).chat([turn])
