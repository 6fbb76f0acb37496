"""The embedded model's tokenizer: one id per character, LLaDA's special tokens, and a chat template
producing LLaDA-8B-Instruct's turn format. Written as HF files (`tokenizer.json`,
`tokenizer_config.json`, `special_tokens_map.json`) so the standard loader reads it."""

from __future__ import annotations

import json
import string
from pathlib import Path

BOS, EOS, EOT, MASK = "<|startoftext|>", "<|endoftext|>", "<|eot_id|>", "<|mdm_mask|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
SPECIAL = (EOS, BOS, HEADER_START, HEADER_END, EOT, MASK)
# Whole words of the chat format, one token each, to keep prompts short.
WORDS = ("user", "assistant")
CHARACTERS = " \n" + string.digits + string.ascii_lowercase + string.ascii_uppercase + ".,?!+-=*#:;'()/<>_%$"

# Same turn layout as LLaDA-8B-Instruct: BOS before the first turn, header, blank line, trimmed text, EoT.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if loop.first %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def vocabulary() -> dict[str, int]:
    tokens = list(SPECIAL) + list(WORDS) + list(CHARACTERS)
    return {token: index for index, token in enumerate(tokens)}


def vocab_size() -> int:
    """Vocabulary size rounded up to a multiple of 8."""
    return -(-len(vocabulary()) // 8) * 8


def build_backend():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocabulary(), unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tokenizer.add_tokens([AddedToken(w, special=False, normalized=False) for w in WORDS])
    return tokenizer


def write_tokenizer_files(out_dir: Path) -> None:
    out_dir = Path(out_dir)
    build_backend().save(str(out_dir / "tokenizer.json"))
    ids = vocabulary()
    added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": t in SPECIAL} for t in SPECIAL + WORDS}
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "add_bos_token": False,
              "add_eos_token": False, "chat_template": CHAT_TEMPLATE, "added_tokens_decoder": added,
              "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "mask_token": MASK}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
