"""Shared fixtures of the envace.models tests: one tiny-Qwen3 build per cache, loaded offline."""

from __future__ import annotations

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The default build ($ENVACE_CACHE/models/tiny-qwen3), built once and reused across sessions."""
    from envace.models import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def qwen_tokenizer_hf(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
