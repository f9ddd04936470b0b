"""Worldbooks as a verified unit (issue 33, findings 1-6): the manifest is covered by its own digest, every artifact
is parsed and validated, paths stay inside the package, a folder of books loads all or nothing, a book records
the pool of its traces, and the ``python -m trace2env`` commands answer user mistakes with one line and exit 2.

Tampering rewrites a file *and* re-hashes it into the manifest (and re-seals the manifest where the test says
so): the checks below the hashes must catch what the hashes alone would let through."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from t2e_kvenv import record

from trace2env import WorldbookIntegrityError, align, build_worldbook, load_worldbook, load_worldbooks, parse_trace
from trace2env.__main__ import main
from trace2env.models import WorldbookManifest
from trace2env.package import _sha256, compile_worldbook, manifest_digest


def _trace(seed: int, pool: str | None = "synthetic", env: str = "kv") -> dict:
    raw = record(seed)
    raw["metadata"] = {**raw.get("metadata", {}), "env_id": env, **({"pool": pool} if pool else {})}
    return raw


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A folder of two valid books (environments kv-a and kv-b), never modified: tests copy it."""
    root = tmp_path_factory.mktemp("books") / "books"
    for env, seeds in (("kv-a", range(4)), ("kv-b", range(4, 8))):
        build_worldbook([parse_trace(_trace(s, env=env)) for s in seeds], root / env, environment_id=env)
    return root


@pytest.fixture
def books(pristine, tmp_path) -> Path:
    out = tmp_path / "books"
    shutil.copytree(pristine, out)
    for p in out.rglob("*"):
        if p.is_file():
            os.chmod(p, 0o644)
    return out


def _manifest(book: Path) -> dict:
    return json.loads((book / "manifest.json").read_text())


def _write_manifest(book: Path, data: dict, *, reseal: bool) -> None:
    if reseal:
        data["digest"] = manifest_digest(WorldbookManifest.model_validate(data))
    (book / "manifest.json").write_text(json.dumps(data))


def _rewrite(book: Path, rel: str, text: str | bytes, *, rehash: bool = True, reseal: bool = True) -> None:
    """Replace ``rel`` and, like a careful forger, re-hash it into the manifest and re-seal the manifest."""
    p = book / rel
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    if rehash:
        m = _manifest(book)
        m["files"][rel] = _sha256(p)
        _write_manifest(book, m, reseal=reseal)


def test_finding1_a_book_without_its_manifest_refuses_the_whole_folder(books, capsys):
    (books / "kv-b" / "manifest.json").unlink()
    with pytest.raises(WorldbookIntegrityError, match=r"^kv-b/manifest.json: missing"):
        load_worldbooks(books)
    assert main(["check", str(books)]) == 1
    assert "kv-b/manifest.json: missing" in capsys.readouterr().err
    # a stray entry, or an interrupted build's hidden leftover, refuses the folder too
    shutil.rmtree(books / "kv-b")
    (books / ".kv-c.tmp123").mkdir()
    (books / "notes.txt").write_text("x")
    with pytest.raises(WorldbookIntegrityError, match=r"^\.kv-c\.tmp123/manifest.json: missing"):
        load_worldbooks(books)
    shutil.rmtree(books / ".kv-c.tmp123")
    with pytest.raises(WorldbookIntegrityError, match=r"^notes.txt: unexpected entry"):
        load_worldbooks(books)


def test_finding1_two_books_for_one_environment_are_refused(books):
    shutil.copytree(books / "kv-a", books / "kv-a-again")
    with pytest.raises(WorldbookIntegrityError, match="a second worldbook for environment 'kv-a'"):
        load_worldbooks(books)


@pytest.mark.parametrize(("key", "value"), [("environment_id", "kv-z"), ("transition_count", 1),
                                            ("metadata", {"executable_rules": 99})])
def test_finding2_an_edit_of_the_manifest_itself_is_caught(books, key, value, capsys):
    book = books / "kv-a"
    m = _manifest(book)
    m[key] = value
    _write_manifest(book, m, reseal=False)
    with pytest.raises(WorldbookIntegrityError, match="manifest.json: digest mismatch"):
        load_worldbook(book)
    assert main(["check", str(book)]) == 1
    assert "manifest.json: digest mismatch" in capsys.readouterr().err
    with pytest.raises(WorldbookIntegrityError, match="^kv-a/manifest.json"):  # never silently dropped
        load_worldbooks(books)
    # re-sealed, the counts still have to agree with the artifacts
    if key != "environment_id":
        _write_manifest(book, m, reseal=True)
        with pytest.raises(WorldbookIntegrityError, match="manifest.json: .* but .* holds"):
            load_worldbook(book)


def test_finding3_check_of_a_folder_checks_every_book(books, capsys):
    assert main(["check", str(books)]) == 0
    assert "ok" in capsys.readouterr().out
    _rewrite(books / "kv-a", "invariants.json", "[")
    _rewrite(books / "kv-b", "provenance.json", "[]")
    assert main(["check", str(books)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in err] == ["kv-a/invariants.json", "kv-b/provenance.json"]


@pytest.mark.parametrize(("rel", "text", "expect"), [
    ("invariants.json", "[{", "invariants.json: not valid JSON"),
    ("action_schema.json", "{}", "action_schema.json: expected an object with exactly the key 'actions'"),
    ("evidence/sources.json", '[{"source_id": 1}]', "evidence/sources.json: "),
    ("provenance.json", '{"rule:x": 3}', "provenance.json: "),
    ("validation/replay.json", "[]", "validation/replay.json: expected an object"),
    ("index.sqlite", b"not a database", "index.sqlite: not a readable evidence index"),
    ("evidence/transitions.jsonl", "\xff", "evidence/transitions.jsonl: "),
])
def test_finding4_every_artifact_is_parsed_even_when_rehashed(books, rel, text, expect, capsys):
    book = books / "kv-a"
    _rewrite(book, rel, text)
    with pytest.raises(WorldbookIntegrityError) as e:
        load_worldbook(book)
    assert str(e.value).startswith(expect)
    assert main(["check", str(book)]) == 1  # one line naming the file, no traceback
    err = capsys.readouterr().err
    assert err.startswith(expect) and "Traceback" not in err


def test_finding4_an_emptied_index_is_caught(books):
    book = books / "kv-a"
    db = book / "index.sqlite"
    con = sqlite3.connect(db)
    con.execute("DELETE FROM evidence")
    con.commit()
    con.close()
    _rewrite(book, "index.sqlite", db.read_bytes())
    with pytest.raises(WorldbookIntegrityError, match="index.sqlite: 0 evidence rows"):
        load_worldbook(book)


@pytest.mark.parametrize("rel", ["../../etc/hostname", "/etc/hostname", "notes.txt"])
def test_finding4_manifest_entries_stay_inside_the_package_and_are_artifacts(books, rel):
    book = books / "kv-a"
    m = _manifest(book)
    m["files"][rel] = "0" * 64
    _write_manifest(book, m, reseal=True)
    with pytest.raises(WorldbookIntegrityError) as e:
        load_worldbook(book)
    assert e.value.path == rel and ("outside the package" in e.value.reason or "not an artifact" in e.value.reason)


def test_finding4_a_link_out_of_the_package_is_refused(books, tmp_path):
    book = books / "kv-a"
    outside = tmp_path / "outside.json"
    outside.write_text("[]")
    (book / "invariants.json").unlink()
    (book / "invariants.json").symlink_to(outside)
    with pytest.raises(WorldbookIntegrityError, match="invariants.json: path outside the package"):
        load_worldbook(book)


def test_finding5_a_book_records_its_pool_and_refuses_mixed_pools(tmp_path, capsys):
    wb = load_worldbook(build_worldbook([parse_trace(_trace(s)) for s in range(3)], tmp_path / "a",
                                        environment_id="kv"))
    assert wb.manifest.source_pool == "synthetic" and wb.manifest.source_environments == ("kv",)
    mixed = [parse_trace(_trace(0)), parse_trace(_trace(1, pool="bfcl_multi_turn"))]
    with pytest.raises(ValueError, match="several pools"):
        build_worldbook(mixed, tmp_path / "b", environment_id="kv")
    assert not (tmp_path / "b").exists()
    f = tmp_path / "mixed.jsonl"
    f.write_text(json.dumps(_trace(0)) + "\n" + json.dumps(_trace(1, pool=None)) + "\n")
    assert main(["build", str(f), "--out", str(tmp_path / "c"), "--environment-id", "kv"]) == 2
    err = capsys.readouterr().err
    assert "several pools (<no pool>, synthetic)" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "c").exists()


def test_finding5_eval_warns_when_the_traces_come_from_another_pool(tmp_path, capsys):
    book = build_worldbook([parse_trace(_trace(s)) for s in range(3)], tmp_path / "a", environment_id="kv")
    same, other = tmp_path / "same.jsonl", tmp_path / "other.jsonl"
    same.write_text(json.dumps(_trace(5)) + "\n")
    other.write_text(json.dumps(_trace(5, pool="bfcl_multi_turn")) + "\n")
    assert main(["eval", str(book), str(same), "--n-boot", "10"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["eval", str(book), str(other), "--n-boot", "10"]) == 0
    assert "built from traces of pool 'synthetic', but these traces come from bfcl_multi_turn" in \
        capsys.readouterr().err


def _one_line_exit_2(argv, capsys, *expect):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for e in expect:
        assert e in err, err


def test_finding6_build_and_eval_mistakes_are_one_line(books, tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(_trace(1)) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_trace(1)) + "\n" + json.dumps(_trace(2)) + "\n" + '{"events": [1,\n')
    _one_line_exit_2(["build", str(empty), "--out", str(tmp_path / "o")], capsys, "empty.jsonl: holds no trace")
    _one_line_exit_2(["build", str(bad), "--out", str(tmp_path / "o")], capsys, "bad.jsonl:3: not valid JSON")
    _one_line_exit_2(["build", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")], capsys, "nope.jsonl")
    _one_line_exit_2(["build", str(good), "--out", str(books)], capsys, f"--out {books} exists")
    assert not (tmp_path / "o").exists()
    _one_line_exit_2(["eval", str(tmp_path), str(good)], capsys, "not a worldbook package")
    _one_line_exit_2(["eval", str(tmp_path / "nowhere"), str(good)], capsys, "nowhere does not exist")
    _rewrite(books / "kv-a", "rules/index.jsonl", "x", rehash=False)
    _one_line_exit_2(["eval", str(books / "kv-a"), str(good)], capsys, "rules/index.jsonl: sha256 mismatch")
    for n in ("0", "-1", "x"):
        _one_line_exit_2(["eval", str(books / "kv-b"), str(good), "--n-boot", n], capsys, "--n-boot")
    _one_line_exit_2(["check", str(tmp_path / "nowhere")], capsys, "does not exist")
    _one_line_exit_2(["eval", str(books / "kv-b"), str(good), "--split-manifest", str(tmp_path / "no.json")], capsys,
                     "--split-manifest", "no.json: cannot read")
    _one_line_exit_2(["eval", str(books / "kv-b"), str(good), "--split-manifest", str(bad)], capsys,
                     "--split-manifest", "bad.jsonl: not a split manifest")


def _stripped(seed: int) -> dict:
    """A chat trace with its tool messages left out: actions, and not one observation."""
    raw = record(seed, fmt="messages")
    return {**raw, "messages": [m for m in raw["messages"] if m["role"] != "tool"],
            "metadata": {**raw["metadata"], "env_id": "kv", "pool": "synthetic"}}


def test_issue43_traces_without_observations_are_refused_and_check_reports_such_a_book(tmp_path, capsys):
    f = tmp_path / "stripped.jsonl"
    f.write_text("".join(json.dumps(_stripped(s)) + "\n" for s in range(3)))
    _one_line_exit_2(["build", str(f), "--out", str(tmp_path / "book")], capsys,
                     "build: the 3 training trace(s) hold 75 action(s) and not one observation")
    assert not (tmp_path / "book").exists()
    # a book built from such traces before the refusal (compiled directly here) is a problem for `check`
    traces = [parse_trace(_stripped(s)) for s in range(3)]
    transitions = [t for tr in traces for t in align(tr)]
    book = compile_worldbook(tmp_path / "old", environment_id="kv", traces=traces, transitions=transitions,
                             actions=[], state_fields=[], rules=[])
    assert main(["check", str(book)]) == 1
    assert capsys.readouterr().err == ("evidence/transitions.jsonl: no observation to learn from (75 action(s), none "
                                       "with an observation): rebuild from traces that keep the tool results\n")


def _strict(text: str):
    """``json.loads`` that refuses NaN and the infinities, as every JSON parser but Python's does."""
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_issue43_eval_writes_strict_json_even_with_nothing_to_score(tmp_path, capsys):
    """Held-out traces without observations leave every mean undefined: null in the printed summary and in --out,
    where ``json.dumps`` alone wrote NaN."""
    book = build_worldbook([parse_trace(_trace(s)) for s in range(3)], tmp_path / "a", environment_id="kv")
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps(_stripped(5)) + "\n")
    out = tmp_path / "f.json"
    assert main(["eval", str(book), str(held), "--n-boot", "10", "--out", str(out)]) == 0
    summary = _strict(capsys.readouterr().out)
    assert summary["steps"] == 0 and summary["exact"] is None and summary["exact_ci95"] == [None, None]
    assert _strict(out.read_text())["summary"] == summary
    assert "warning" not in capsys.readouterr().err


# -- a tampered package -----------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


def test_tampered_package_fails_to_load_naming_the_file(tmp_path):
    out = build_worldbook([parse_trace(record(1))], tmp_path / "wb")
    assert main(["check", str(out)]) == 0
    target = out / "rules" / "index.jsonl"
    os.chmod(target, 0o644)
    text = target.read_text()
    assert "ok" in text
    target.write_text(text.replace("ok", "OK"))
    with pytest.raises(WorldbookIntegrityError, match=r"rules/index.jsonl: sha256 mismatch") as e:
        load_worldbook(out)
    assert e.value.path == "rules/index.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "trace2env", "check", str(out)], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 1 and "rules/index.jsonl" in proc.stderr
    (out / "extra.txt").write_text("x")
    os.chmod(target, 0o644)
    target.unlink()
    with pytest.raises(WorldbookIntegrityError, match="rules/index.jsonl: listed in the manifest but missing"):
        load_worldbook(out)
