"""The tiny random-init Qwen3 checkpoint: offline loading, generation, caching, atomicity, determinism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from envace.models import MANIFEST_NAME, ensure_tiny_model, is_complete, recipe_hash
from envace.models.tiny import build_tiny_model, default_model_dir, file_sha256

REPO = Path(__file__).resolve().parents[3]


def test_default_dir_follows_envace_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path))
    assert default_model_dir() == tmp_path / "models" / "tiny-qwen3"
    monkeypatch.delenv("ENVACE_CACHE")
    assert default_model_dir() == Path.home() / ".cache" / "envace" / "models" / "tiny-qwen3"


def test_directory_contents(tiny_model_dir):
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        MANIFEST_NAME,
    } <= names
    assert is_complete(tiny_model_dir, verify=True)
    manifest = json.loads((tiny_model_dir / MANIFEST_NAME).read_text())
    assert manifest["recipe_hash"] == recipe_hash()
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643] and gen["pad_token_id"] == 151643


def test_loads_offline_and_generates(tiny_model_dir, qwen_tokenizer_hf):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), local_files_only=True)
    cfg = model.config
    assert cfg.model_type == "qwen3" and type(model).__name__ == "Qwen3ForCausalLM"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 2, 1)
    assert cfg.head_dim == 32 and cfg.intermediate_size == 128 and cfg.vocab_size == 151936
    assert cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert cfg.eos_token_id == 151645 and cfg.bos_token_id == 151643
    assert model.generation_config.eos_token_id == [151645, 151643]
    assert 9_000_000 < sum(p.numel() for p in model.parameters()) < 11_000_000

    prompt = qwen_tokenizer_hf.apply_chat_template(
        [{"role": "user", "content": "Hello"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=151643)
    n_prompt = prompt["input_ids"].shape[1]
    assert out.shape[0] == 1 and n_prompt < out.shape[1] <= n_prompt + 5
    assert isinstance(qwen_tokenizer_hf.decode(out[0, n_prompt:]), str)
    with torch.no_grad():
        again = model.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=151643)
    assert torch.equal(out, again)


def test_reuse_is_a_noop(tiny_model_dir):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()}
    assert ensure_tiny_model() == tiny_model_dir
    assert {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()} == before


def test_fresh_build_is_bit_identical(tiny_model_dir, tmp_path):
    """Determinism: a second, independent build produces the same weights and tokenizer."""
    import torch

    torch.manual_seed(12345)
    state = torch.random.get_rng_state()
    out = build_tiny_model(tmp_path / "again")
    assert torch.equal(torch.random.get_rng_state(), state)  # the build does not disturb the global RNG
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja"):
        assert file_sha256(out / name) == file_sha256(tiny_model_dir / name), name


def test_stale_or_damaged_builds_are_rebuilt(tiny_model_dir, tmp_path):
    import shutil

    target = tmp_path / "m"
    shutil.copytree(tiny_model_dir, target)
    assert is_complete(target, verify=True)

    # manifest of another recipe -> stale
    manifest_text = (target / MANIFEST_NAME).read_text()
    manifest = json.loads(manifest_text)
    manifest["recipe_hash"] = "0" * 64
    (target / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert not is_complete(target)
    (target / MANIFEST_NAME).write_text(manifest_text)
    assert is_complete(target)

    # same size, different bytes: only the full verification notices
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert is_complete(target) and not is_complete(target, verify=True)

    # damaged file (size differs) -> incomplete -> rebuilt in place, atomically swapped in
    weights.write_bytes(b"junk")
    assert not is_complete(target)
    assert ensure_tiny_model(target) == target.absolute()
    assert is_complete(target, verify=True)
    assert file_sha256(target / "model.safetensors") == file_sha256(tiny_model_dir / "model.safetensors")
    # no temporary build / old directories are left behind
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["m"]


def test_cli_concurrent_builders(tmp_path):
    """Two `python -m envace.models build` at once: both print the same complete directory."""
    target = tmp_path / "cli"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "envace.models", "build", "--out", str(target)]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr
        assert stdout.strip().splitlines()[-1] == str(target.absolute())
    assert is_complete(target, verify=True)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["cli"]
    # the second builder waited for the first and reused its build: one build only
    assert sorted(err.strip().splitlines()[-1].split()[0] for _, err in outs) == ["built", "reused"]

    res = subprocess.run(cmd + ["--verify"], check=False, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip() == str(target.absolute())
    assert res.stderr.strip().splitlines()[-1].startswith("reused in")
