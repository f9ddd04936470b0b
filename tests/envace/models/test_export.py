"""``python -m envace.models export``: a Hugging Face checkpoint from verl's sharded FSDP checkpoint.

The checkpoint is written the way verl's trainer writes it: two ranks (gloo on CPU) shard the tiny Qwen3 with FSDP2
(``fully_shard``, one unit per decoder layer and the root) and save through verl's own ``FSDPCheckpointManager``
into ``RUN/global_step_3/actor``. The weights are first moved off the build (a seeded perturbation, the same on both
ranks), so an export that returned the base model, one rank's shard, or shards in the wrong order would differ.
"""

from __future__ import annotations

import json
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

    # the tiny model is fp32 (its config says so): the export keeps the trained weights exactly (verl's merge would
    # round them to bf16, --dtype bfloat16 below)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    reference = torch.load(fsdp_run / "reference.pt")
    exported = model.state_dict()
    assert set(exported) == set(reference)
    for name, want in reference.items():
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], want), name
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and "<tool_call>" in tok.chat_template  # a served model can be called with tools
    ids = tok("hello", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()


def _measure_merge(mode: str, actor: str, out: str) -> None:
    """Child process: write ``actor``'s Hugging Face checkpoint to ``out`` with verl's own merger (``mode`` "verl",
    what the export ran before it memory-mapped the shards) or the export ("envace"), and print, as JSON, the growth
    of the process's anonymous resident memory at each sample point (see the module docstring) over its value once
    everything the merge imports is imported."""
    import transformers
    import verl.model_merger.fsdp_model_merger as fsdp
    from verl.model_merger.base_model_merger import ModelMergerConfig

    from envace.models.export import export

    def anon() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))

    samples: list[int] = []

    def sampled(owner, name, after=True):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if not after:
                samples.append(anon())
            result = fn(*args, **kwargs)
            if after:
                samples.append(anon())
            return result

        setattr(owner, name, wrapper)

    sampled(torch, "load")
    sampled(fsdp.FSDPModelMerger, "_merge_by_placement")
    sampled(transformers.PreTrainedModel, "save_pretrained", after=False)
    transformers.AutoConfig.from_pretrained(Path(actor) / "huggingface")  # its imports before the baseline
    base = anon()
    if mode == "verl":
        fsdp.FSDPModelMerger(ModelMergerConfig(operation="merge", backend="fsdp", local_dir=actor, target_dir=out,
                                               hf_model_config_path=str(Path(actor) / "huggingface"))).merge_and_save()
    else:
        export(actor, out, "bfloat16")  # verl's merge's dtype, whatever the model's
    print(json.dumps({"growth": [s - base for s in samples]}))


def _merge_in_child(mode: str, actor: Path, out: Path) -> list[int]:
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from test_export import _measure_merge; "
            f"_measure_merge(*sys.argv[1:])")
    # a fixed mmap threshold: glibc serves every large buffer from its own mapping and unmaps it when freed, so the
    # resident memory tracks the live tensors (its default threshold grows and keeps freed buffers in the heap)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run([sys.executable, "-c", code, mode, str(actor), str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["growth"]


def test_the_export_holds_the_bf16_weights_and_one_parameter_and_writes_verls_bytes(fsdp_run, tmp_path):
    """With ``--dtype bfloat16``: the need counted from the shards is the bf16 size of every entry and of the largest;
    the export's memory stays within it (verl's own merger's does not); its files are verl's own merge's, byte for
    byte."""
    from envace.models.export import MemoryNeed

    actor = fsdp_run / "global_step_3" / "actor"
    reference = torch.load(fsdp_run / "reference.pt")
    weights = sum(2 * t.numel() for t in reference.values())  # every entry merged to bf16 (lm_head, tied, too)
    largest = max(2 * t.numel() for t in reference.values())
    need = MemoryNeed.of(torch.load(actor / "model_world_size_2_rank_0.pt", mmap=True, weights_only=False))
    assert (need.weights, need.largest) == (weights, largest)

    bound = weights + largest + (4 << 20)  # 4 MiB for the shards' unpickled objects and the allocator's pages
    ours = _merge_in_child("envace", actor, tmp_path / "envace")
    verls = _merge_in_child("verl", actor, tmp_path / "verl")
    assert min(len(ours), len(verls)) >= 2 + len(reference)  # every shard's load and every parameter's merge
    assert max(ours) <= bound, f"the export held {max(ours) / 2**20:.1f} MiB, its bound is {bound / 2**20:.1f} MiB"
    # the tiny model ties its embedding (merged twice, as lm_head too): its bf16 weights are as large as its fp32
    # ones, so verl's merger exceeds the bound by what it holds besides them, rank 0's fp32 shard (18.6 MiB)
    assert max(verls) > bound, "the measurement no longer sees the fp32 shard verl's merger holds"

    names = sorted(p.name for p in (tmp_path / "verl").iterdir())
    assert "model.safetensors" in names and sorted(p.name for p in (tmp_path / "envace").iterdir()) == names
    for name in names:
        assert (tmp_path / "envace" / name).read_bytes() == (tmp_path / "verl" / name).read_bytes(), name


def test_an_export_the_host_cannot_hold_is_refused_before_it_starts(fsdp_run, tmp_path, monkeypatch):
    """The CLI as a user runs it (stderr whole: torch's warnings would show there), on a host reporting one byte
    less than the need: exit 2, one line naming the need and what is available, nothing written."""
    from envace.models import export as ex

    actor = fsdp_run / "global_step_3" / "actor"
    # the export's dtype is the tiny model's, fp32: 4 bytes an element
    need = ex.MemoryNeed.of(torch.load(actor / "model_world_size_2_rank_0.pt", mmap=True, weights_only=False), 4)
    code = ("import sys; from envace.models import export as ex; from envace.models.__main__ import main; "
            f"ex.available_memory = lambda: ({need.total - 1}, 'on this host'); sys.exit(main(sys.argv[1:]))")
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-c", code, "export", str(fsdp_run), str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, check=False,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 2, proc.stderr
    mib = [f"{n / 2**20:.1f} MiB" for n in (need.total, need.weights, need.total - 1)]
    assert proc.stderr.startswith(f"python -m envace.models: error: exporting {actor} needs about {mib[0]} of "
                                  f"memory ({mib[1]} of weights, "), proc.stderr
    assert proc.stderr.endswith(f"and {mib[2]} is available on this host: free memory, or export on a larger host\n")
    assert len(proc.stderr.splitlines()) == 1 and proc.stdout == ""
    assert os.listdir(tmp_path) == []  # neither OUT nor its temporary sibling

    monkeypatch.setattr(ex, "available_memory", lambda: (need.total, "on this host"))
    ex._check_memory(actor, need)  # one byte more than the refused figure: exactly the need is enough


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_memory_cgroup_limit_below_the_hosts_memory_is_what_is_available(tmp_path, monkeypatch):
    from envace.models import export as ex

    gib = 1 << 30
    proc = tmp_path / "proc-self-cgroup"
    # cgroup v2: a job under a parent with a limit; file pages the kernel can drop (inactive) are not counted as used
    v2 = tmp_path / "v2"
    _write(v2 / "slurm" / "memory.max", f"{8 * gib}\n")
    _write(v2 / "slurm" / "memory.current", f"{6 * gib}\n")
    _write(v2 / "slurm" / "memory.stat", f"anon {5 * gib}\ninactive_file {gib}\n")
    _write(v2 / "slurm" / "job_7" / "memory.max", "max\n")
    _write(v2 / "slurm" / "job_7" / "memory.current", f"{6 * gib}\n")
    _write(v2 / "memory.max", f"{64 * gib}\n")  # the root's limit: 58 GiB more, not the smallest
    _write(v2 / "memory.current", f"{6 * gib}\n")
    proc.write_text("0::/slurm/job_7\n")
    assert ex._cgroup_headroom(proc, v2) == 3 * gib
    proc.write_text("0::/slurm/job_9\n")  # not visible here (a container's own cgroup is the mount's root)
    assert ex._cgroup_headroom(proc, v2) == 58 * gib
    # cgroup v1: memory.stat's hierarchical limit (the smallest above too), hybrid mode's v2 line holds no memory
    v1 = tmp_path / "v1"
    _write(v1 / "memory" / "docker" / "c1" / "memory.stat",
           f"total_inactive_file {gib // 2}\nhierarchical_memory_limit {16 * gib}\n")
    _write(v1 / "memory" / "docker" / "c1" / "memory.usage_in_bytes", f"{12 * gib}\n")
    proc.write_text("12:pids:/docker/c1\n4:memory:/docker/c1\n0::/docker/c1\n")
    assert ex._cgroup_headroom(proc, v1) == 4 * gib + gib // 2
    _write(v1 / "memory" / "docker" / "c1" / "memory.stat", "hierarchical_memory_limit 9223372036854771712\n")
    assert ex._cgroup_headroom(proc, v1) is None  # v1's "no limit"
    assert ex._cgroup_headroom(tmp_path / "no-such-file", v1) is None

    import psutil

    host = int(psutil.virtual_memory().available)
    monkeypatch.setattr(ex, "_cgroup_headroom", lambda: host // 2)
    assert ex.available_memory() == (host // 2, "under this process's cgroup memory limit")
    monkeypatch.setattr(ex, "_cgroup_headroom", lambda: None)
    have, where = ex.available_memory()
    assert where == "on this host" and have > 0


def test_the_verl_merger_lines_the_export_replaces_are_pinned():
    """The export overrides two loading steps of verl 0.9.1's FSDP merger and repeats its per-parameter merge
    (envace/models/export.py ``_mapped_merger_class``): the calls that reach the overrides and the merge's lines."""
    import inspect

    import verl
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    from envace.models.export import _mapped_merger_class

    assert verl.__version__ == "0.9.1"
    merger = _mapped_merger_class()
    assert merger.__mro__[1] is FSDPModelMerger
    for name in ("_load_rank_zero_state_dict", "_load_and_merge_state_dicts"):
        assert [*inspect.signature(getattr(merger, name)).parameters] == [
            *inspect.signature(getattr(FSDPModelMerger, name)).parameters], name
    flow = inspect.getsource(FSDPModelMerger.merge_and_save)
    merge = inspect.getsource(FSDPModelMerger._load_and_merge_state_dicts)
    for source, line in (
        (flow, "rank_zero_state_dict = self._load_rank_zero_state_dict(world_size)"),
        (flow, "self._load_and_merge_state_dicts(world_size, total_shards, mesh_shape, mesh_dim_names)"),
        (flow, "self.save_hf_model_and_tokenizer(merged_state_dict)"),
        (merge, 'state_dict = torch.load(model_path, map_location="cpu", weights_only=False)'),
        (merge, "state_dict[key].append(tensor._local_tensor.bfloat16())"),
        (merge, 'if mesh_dim_names[0] in ("dp", "ddp"):\n                        placements = placements[1:]'),
        (merge, "state_dict[key].append(tensor.bfloat16())"),
        (merge, "state_dict[key] = self._merge_by_placement(shards, placements[0])"),
        (merge, "state_dict[key] = merge_non_dtensor_shards(key, state_dict[key])"),
    ):
        assert line in source, f"verl 0.9.1's FSDPModelMerger no longer has {line!r}: re-read export.py against it"


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
    # bytes changed inside data.pkl (the archive's first record), which torch would unpickle without a CRC check
    (lambda b: b[:200] + bytes(255 - x for x in b[200:240]) + b[240:], "Bad CRC-32 for file"),
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
