"""The tiny random-init Qwen3 + real Qwen3 tokenizer, built offline into a cache directory.

The directory is a regular Hugging Face checkpoint (``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``)
plus ``envace_manifest.json``, written last, that marks it complete and records the hash of the
build recipe. ``AutoModelForCausalLM`` / ``AutoTokenizer`` load it with no network access.

Building is atomic: everything goes into a temporary sibling directory that is renamed into place;
an ``flock`` on a sibling lock file makes concurrent builders wait for the first one instead of
duplicating the work, and a reader never sees a half-written directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from envace.cache import cache_dir
from envace.models import tokenizer as _tok

__all__ = [
    "MANIFEST_NAME",
    "RECIPE_VERSION",
    "TinyQwen3Spec",
    "build_tiny_model",
    "default_cache_dir",
    "default_model_dir",
    "ensure_tiny_model",
    "file_sha256",
    "is_complete",
    "load_tokenizer",
    "recipe_hash",
]

# Bump when anything that changes the produced files changes in a way the recipe dict below misses.
RECIPE_VERSION = 1
MANIFEST_NAME = "envace_manifest.json"
DEFAULT_NAME = "tiny-qwen3"


@dataclasses.dataclass(frozen=True)
class TinyQwen3Spec:
    """Size and init of the tiny model. Everything else mirrors Qwen3 (rope, norms, ids)."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    # head size 32: vLLM's CPU attention accepts 32, 64, 80, 96, 112, 128... (16 is refused at the first request);
    # 2 query heads x 32 and 1 key/value head keep the projections of the earlier 4 x 16 / 2 x 16 layout
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    intermediate_size: int = 128
    vocab_size: int = 151936  # len(tokenizer)=151669 padded as Qwen3 does
    max_position_embeddings: int = 40960
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    dtype: str = "float32"  # float32 keeps CPU logprobs exact; Qwen3 ships bfloat16
    seed: int = 0

    def qwen3_config(self) -> Any:
        from transformers import Qwen3Config

        eos = _tok.QWEN3_SPECIAL_START_ID + 2  # <|im_end|>
        bos = _tok.QWEN3_SPECIAL_START_ID  # <|endoftext|>
        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=0.02,
            rms_norm_eps=1e-6,
            use_cache=True,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=self.num_hidden_layers,
            attention_dropout=0.0,
            bos_token_id=bos,
            eos_token_id=eos,
            dtype=self.dtype,
            architectures=["Qwen3ForCausalLM"],
        )


DEFAULT_SPEC = TinyQwen3Spec()


def default_cache_dir() -> Path:
    """``$ENVACE_CACHE`` (default ``~/.cache/envace``)."""
    return cache_dir()


def default_model_dir() -> Path:
    return default_cache_dir() / "models" / DEFAULT_NAME


def recipe(spec: TinyQwen3Spec = DEFAULT_SPEC) -> dict[str, Any]:
    """Everything the produced files depend on (library versions aside, recorded in the manifest)."""
    return {
        "recipe_version": RECIPE_VERSION,
        "spec": dataclasses.asdict(spec),
        "added_tokens": [list(t) for t in _tok.QWEN3_ADDED_TOKENS],
        "eos": _tok.EOS_TOKEN,
        "pad": _tok.PAD_TOKEN,
        "chat_template_sha256": hashlib.sha256(_tok.chat_template().encode()).hexdigest(),
        "qwen_tiktoken_sha256": _tok.qwen_tiktoken_sha256(),
        "generation_config": _generation_config_dict(spec),
    }


def recipe_hash(spec: TinyQwen3Spec = DEFAULT_SPEC) -> str:
    blob = json.dumps(recipe(spec), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def _generation_config_dict(spec: TinyQwen3Spec) -> dict[str, Any]:
    del spec
    start = _tok.QWEN3_SPECIAL_START_ID
    # Qwen3's generation_config.json.
    return {
        "bos_token_id": start,
        "eos_token_id": [start + 2, start],
        "pad_token_id": start,
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None


def is_complete(path: str | os.PathLike[str], spec: TinyQwen3Spec = DEFAULT_SPEC, verify: bool = False) -> bool:
    """True when ``path`` holds a finished build of this recipe (``verify``: also check sha256 of every file)."""
    path = Path(path)
    manifest = _read_manifest(path)
    if not manifest or manifest.get("recipe_hash") != recipe_hash(spec):
        return False
    return files_intact(path, manifest.get("files"), verify)


def files_intact(path: Path, files: Any, verify: bool = False) -> bool:
    """Every file a manifest lists (``{name: {"size", "sha256"}}``) is there with its size (and hash)."""
    if not isinstance(files, dict) or not files:
        return False
    for name, meta in files.items():
        f = path / name
        try:
            if f.stat().st_size != meta["size"]:
                return False
        except (OSError, KeyError, TypeError):
            return False
        if verify and file_sha256(f) != meta.get("sha256"):
            return False
    return True


def _qwen3_tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json in the layout of Qwen3's (class PreTrainedTokenizerFast, template in its own file)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(_tok.QWEN3_SPECIAL_START_ID + i): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for i, (content, special) in enumerate(_tok.QWEN3_ADDED_TOKENS)
        },
        "additional_special_tokens": list(_tok.ADDITIONAL_SPECIAL_TOKENS),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": _tok.EOS_TOKEN,
        "errors": "replace",
        "model_max_length": _tok.MODEL_MAX_LENGTH,
        "pad_token": _tok.PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def build_tiny_model(out: str | os.PathLike[str], spec: TinyQwen3Spec = DEFAULT_SPEC) -> Path:
    """Write tokenizer + random-init tiny Qwen3 + manifest into the (new or empty) directory ``out``.

    Not atomic by itself; :func:`ensure_tiny_model` builds into a temporary directory with it.
    """
    _tok._offline_env()
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    tokenizer = _tok.build_qwen3_tokenizer()
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"vocab_size {spec.vocab_size} < len(tokenizer) {len(tokenizer)}")
    tokenizer.save_pretrained(out)
    (out / "tokenizer_config.json").write_text(
        json.dumps(_qwen3_tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
    )
    (out / "chat_template.jinja").write_text(_tok.chat_template(), encoding="utf-8")

    config = spec.qwen3_config()
    dtype = getattr(torch, spec.dtype)
    with _fork_rng():
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(config)
    model = model.to(dtype).eval()
    model.generation_config = GenerationConfig(**_generation_config_dict(spec))
    with _no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)

    files = {}
    for f in sorted(out.iterdir()):
        if f.is_file() and f.name != MANIFEST_NAME:
            os.chmod(f, 0o644)
            files[f.name] = {"size": f.stat().st_size, "sha256": file_sha256(f)}
    import tokenizers
    import transformers

    manifest = {
        "name": DEFAULT_NAME,
        "recipe_hash": recipe_hash(spec),
        "recipe": recipe(spec),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "build_seconds": round(time.time() - t0, 2),
        "files": files,
    }
    tmp = out / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / MANIFEST_NAME)
    return out


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _fork_rng() -> Iterator[None]:
    """Seed locally: the caller's global torch RNG state is restored afterwards."""
    import torch

    state = torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


@contextlib.contextmanager
def _build_lock(final: Path) -> Iterator[None]:
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final.parent / f".{final.name}.lock"
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: atomic rename alone still protects readers
        yield
        return
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _install(tmp: Path, final: Path) -> None:
    """Move the finished build ``tmp`` to ``final``, replacing a stale ``final`` if any."""
    try:
        os.rename(tmp, final)
        return
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
            raise
    # ``final`` exists but is stale or incomplete (or forced): swap it out, then drop it.
    old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
    if final.exists() or final.is_symlink():
        os.rename(final, old / final.name)
    try:
        os.rename(tmp, final)
    finally:
        shutil.rmtree(old, ignore_errors=True)


def ensure_tiny_model(
    path: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    spec: TinyQwen3Spec = DEFAULT_SPEC,
) -> Path:
    """Return the directory of the tiny Qwen3 checkpoint, building it first if it is missing or stale.

    ``path`` defaults to ``$ENVACE_CACHE/models/tiny-qwen3``. ``force`` rebuilds even a complete one.
    """
    return _ensure(path, force=force, spec=spec)[0]


def _ensure(
    path: str | os.PathLike[str] | None, *, force: bool = False, spec: TinyQwen3Spec = DEFAULT_SPEC
) -> tuple[Path, bool]:
    """(directory, whether this call built it)."""
    final = Path(path).expanduser() if path is not None else default_model_dir()
    final = final.absolute()
    if not force and is_complete(final, spec):
        return final, False
    with _build_lock(final):
        # Another process may have finished it while we waited for the lock.
        if not force and is_complete(final, spec):
            return final, False
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.build-", dir=final.parent))
        try:
            build_tiny_model(tmp, spec)
            os.chmod(tmp, 0o755)
            _install(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final, True


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Any:
    """The Qwen3 tokenizer (with chat template) of the tiny-model directory, built if needed; offline."""
    _tok._offline_env()
    from transformers import AutoTokenizer

    directory = ensure_tiny_model(path)
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
