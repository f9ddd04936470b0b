"""``python -m envace.models export``: a Hugging Face checkpoint from verl's sharded FSDP checkpoint.

The checkpoint is written the way verl's trainer writes it: two ranks (gloo on CPU) shard the tiny Qwen3 with FSDP2
(``fully_shard``, one unit per decoder layer and the root) and save through verl's own ``FSDPCheckpointManager``
into ``RUN/global_step_3/actor``. The weights are first moved off the build (a seeded perturbation, the same on both
ranks), so an export that returned the base model, one rank's shard, or shards in the wrong order would differ.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[3]


def _save_rank(rank: int, world: int, init_file: str, model_dir: str, run: str) -> None:
    """One trainer rank: load, perturb (seeded: the same on every rank), shard with FSDP2, save via verl."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        gen = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        if rank == 0:
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, Path(run) / "reference.pt")
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        manager = FSDPCheckpointManager(model, optimizer=None, processing_class=AutoTokenizer.from_pretrained(model_dir),
                                        checkpoint_config={"save_contents": ["model"], "load_contents": ["model"]})
        manager.save_checkpoint(str(Path(run) / "global_step_3" / "actor"), global_step=3)
        if rank == 0:
            (Path(run) / "latest_checkpointed_iteration.txt").write_text("3")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A run directory holding verl's 2-rank FSDP2 checkpoint of the perturbed tiny Qwen3 at step 3."""
    run = tmp_path_factory.mktemp("run")
    init_file = str(run / "pg-init")
    args = ", ".join(repr(a) for a in (init_file, str(tiny_model_dir), str(run)))
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from test_export import _save_rank; "
            f"_save_rank(int(sys.argv[1]), 2, {args})")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    return run


def _export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "envace.models", "export", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, check=False, env=dict(os.environ, HF_HUB_OFFLINE="1"))


def test_export_writes_the_trained_weights_as_a_hugging_face_checkpoint(fsdp_run, tmp_path, capsys):
    actor = fsdp_run / "global_step_3" / "actor"
    assert sorted(p.name for p in actor.glob("model_world_size_*.pt")) == [
        "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]
    out = tmp_path / "hf"
    from envace.models.__main__ import main

    assert main(["export", str(fsdp_run), str(out)]) == 0  # the run directory: its latest checkpoint
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    assert list(out.glob("*.safetensors")) and (out / "config.json").is_file()
    assert not list(tmp_path.glob(".hf.export-*"))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    reference = torch.load(fsdp_run / "reference.pt")
    exported = model.state_dict()
    assert set(exported) == set(reference)
    for name, want in reference.items():  # verl's merger writes bf16
        assert torch.equal(exported[name].float(), want.bfloat16().float()), name
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and "<tool_call>" in tok.chat_template  # a served model can be called with tools
    ids = tok("hello", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()


def test_export_names_what_is_wrong_and_writes_nothing(fsdp_run, tmp_path):
    assert _export(str(tmp_path / "nowhere"), str(tmp_path / "o")).returncode == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _export(str(empty), str(tmp_path / "o"))
    assert proc.returncode == 2 and "is not a verl FSDP checkpoint" in proc.stderr
    assert proc.stderr.startswith("python -m envace.models: error: ")  # the PROG: error: form of docs/cli.md
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("x")
    proc = _export(str(fsdp_run / "global_step_3"), str(taken))
    assert proc.returncode == 2 and "already exists" in proc.stderr and os.listdir(taken) == ["keep.txt"]
    # a checkpoint copied without one rank's shard
    partial = tmp_path / "partial" / "actor"
    partial.mkdir(parents=True)
    for f in (fsdp_run / "global_step_3" / "actor").iterdir():
        if f.name != "model_world_size_2_rank_1.pt":
            (partial / f.name).symlink_to(f)
    proc = _export(str(partial), str(tmp_path / "o"))
    assert proc.returncode == 2 and "model_world_size_2_rank_1.pt" in proc.stderr
    assert not (tmp_path / "o").exists()


def _copy_actor(fsdp_run: Path, dest: Path) -> Path:
    """A copy of step 3's actor directory (links to the original files) whose files a test may replace."""
    actor = dest / "actor"
    actor.mkdir(parents=True)
    for f in (fsdp_run / "global_step_3" / "actor").iterdir():
        (actor / f.name).symlink_to(f)
    return actor


@pytest.fixture
def no_merge(monkeypatch) -> list[str]:
    """verl's merge replaced by a recorder: an export that reaches it appends 'merged' and writes nothing."""
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    calls: list[str] = []
    monkeypatch.setattr(FSDPModelMerger, "merge_and_save", lambda self: calls.append("merged"))
    return calls


def test_an_output_that_cannot_be_created_is_refused_before_the_merge(fsdp_run, tmp_path, capsys, no_merge):
    from envace.models.__main__ import main

    (tmp_path / "a-file").write_text("x")
    for out, why in ((tmp_path / "a-file" / "sub" / "hf", f"{tmp_path / 'a-file'} is a file, not a directory"),
                     # /proc/self takes no new entries, for root too: a read-only place on every Linux machine
                     (Path("/proc/self/hf"), "/proc/self is not writable")):
        assert main(["export", str(fsdp_run), str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"python -m envace.models: error: OUT {out}: ") and why in err, err
        assert len(err.strip().splitlines()) == 1
    assert no_merge == []


@pytest.mark.parametrize(("damage", "why"), [
    (lambda b: b[: len(b) // 2], "File is not a zip file"),  # a copy cut short
    (lambda b: b[:1000] + b[2000:], "a damaged model shard"),  # a copy that lost a block in the middle
    (lambda b: b"", "(0 bytes"),
])
def test_a_damaged_shard_is_named_and_exits_3_before_the_merge(fsdp_run, tmp_path, capsys, no_merge, damage, why):
    from envace.models.__main__ import main

    actor = _copy_actor(fsdp_run, tmp_path / "ckpt")
    shard = actor / "model_world_size_2_rank_1.pt"
    data = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(damage(data))
    assert main(["export", str(actor), str(tmp_path / "hf")]) == 3  # damaged stored data (docs/cli.md)
    err = capsys.readouterr().err
    assert err.startswith(f"python -m envace.models: error: {shard}: ") and why in err, err
    assert len(err.strip().splitlines()) == 1
    assert no_merge == [] and not (tmp_path / "hf").exists()


@pytest.mark.parametrize(("text", "why"), [
    ("{\n  \"model_type\": qwen3\n}", "line 2 column 17: not JSON"),
    ("", "line 1 column 1: not JSON"),
    ("[1, 2]", "expected a JSON object (a model config), got list"),
    ('{"model_type": "nonsense"}', "transformers can load: The checkpoint you are trying to load has model type"),
    ('{"model_type": "qwen3", "hidden_size": "abc"}', "Field 'hidden_size' expected int"),
])
def test_a_bad_model_config_is_a_usage_error_naming_the_file(fsdp_run, tmp_path, capsys, no_merge, text, why):
    from envace.models.__main__ import main

    actor = _copy_actor(fsdp_run, tmp_path / "ckpt")
    hf = actor / "huggingface"
    hf.unlink()
    hf.mkdir()
    for f in (fsdp_run / "global_step_3" / "actor" / "huggingface").iterdir():
        (hf / f.name).symlink_to(f)
    (hf / "config.json").unlink()
    (hf / "config.json").write_text(text)
    assert main(["export", str(actor), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m envace.models: error: {hf / 'config.json'}: ") and why in err, err
    assert len(err.strip().splitlines()) == 1 and no_merge == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_shard_with_any_bytes_missing_is_refused(fsdp_run, tmp_path, data):
    """Any run of bytes cut from a shard (a truncated or partial copy) is found by the header check."""
    from envace.models.export import DamagedCheckpointError, _check_shard

    whole = (fsdp_run / "global_step_3" / "actor" / "model_world_size_2_rank_0.pt").read_bytes()
    start = data.draw(st.integers(0, len(whole) - 1), label="start")
    stop = data.draw(st.integers(start + 1, len(whole)), label="stop")
    shard = tmp_path / "model_world_size_2_rank_0.pt"
    shard.write_bytes(whole[:start] + whole[stop:])
    with pytest.raises(DamagedCheckpointError, match=str(shard)):
        _check_shard(shard)


@pytest.mark.slow
def test_an_exported_checkpoint_is_served_and_answers_with_its_chat_template(fsdp_run, tmp_path, capsys):
    """The point of the export: an OpenAI-compatible server (``transformers serve`` on CPU, as the evaluation
    scripts start it with ``--server transformers``) loads OUT and answers a chat request with tools."""
    import json
    import urllib.request

    from envace.eval.server import launch_server
    from envace.models.__main__ import main

    out = tmp_path / "hf"
    assert main(["export", str(fsdp_run / "global_step_3"), str(out)]) == 0
    capsys.readouterr()
    tool = {"type": "function", "function": {"name": "get_time", "description": "the time",
                                             "parameters": {"type": "object", "properties": {}}}}
    with launch_server(str(out), "transformers", startup_timeout=600, log_path=tmp_path / "server.log") as srv:
        body = {"model": srv.model, "messages": [{"role": "user", "content": "What time is it?"}], "tools": [tool],
                "max_tokens": 8, "temperature": 0}
        req = urllib.request.Request(f"{srv.base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            reply = json.loads(resp.read())
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] >= 1, reply
