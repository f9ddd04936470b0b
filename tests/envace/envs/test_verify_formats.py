"""``python -m envace.envs verify`` reads BFCL's and τ²'s own formats and verifies in batches (issue 33, findings 9
and 14): call strings with positional arguments, BFCL's possible-answer layout as a batch file, τ²'s action objects
with a requestor; one JSON line per task and a summary; a malformed batch verifies nothing and exits 2 naming the
line; a non-UTF-8 file exits 2 (not 1, which means "verdict failed")."""

from __future__ import annotations

import json

import pytest

from envace.envs.__main__ import main
from envace.envs.base import get_pool

TASK = "multi_turn_base_0"


@pytest.fixture(scope="module")
def bfcl():
    return get_pool("bfcl_multi_turn")


def _run(argv, capsys):
    code = main(argv)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_finding9_a_non_utf8_actions_file_exits_2_with_one_line(tmp_path, capsys):
    f = tmp_path / "actions.json"
    f.write_bytes(b"\xff\xfe[]")
    code, out, err = _run(["verify", "bfcl_multi_turn", TASK, str(f)], capsys)
    assert code == 2 and out == "" and err.strip() == f"python -m envace.envs: error: {f}: not UTF-8 text (byte 0)"


def test_finding14_bfcl_call_strings_with_positional_arguments_verify(bfcl, tmp_path, capsys):
    positional = next(t for t in bfcl.task_ids() if any(
        "(" in c and "=" not in c and not c.endswith("()") for turn in bfcl.ground_truth(t) for c in turn))
    gt = bfcl.ground_truth(positional)
    f = tmp_path / "native.json"
    f.write_text(json.dumps(gt))
    code, out, _ = _run(["verify", "bfcl_multi_turn", positional, str(f)], capsys)
    assert code == 0 and json.loads(out)["format"] == "bfcl" and json.loads(out)["passed"] is True
    # BFCL's decoded result layout (turn -> step -> calls) and a list-of-calls string verify the same way
    steps = [[[c] for c in turn] for turn in gt]
    steps[0] = ["[" + ", ".join(gt[0]) + "]"] if gt[0] else []
    f.write_text(json.dumps(steps))
    assert _run(["verify", "bfcl_multi_turn", positional, str(f)], capsys)[0] == 0
    # a call that does not bind is the model's mistake: scored, not a crash
    wrong = [list(turn) for turn in gt]
    first = next(i for i, turn in enumerate(wrong) if turn)
    wrong[first][0] = wrong[first][0].replace("(", "(1, 2, 3, 4, 5, ", 1)
    f.write_text(json.dumps(wrong))
    code, out, _ = _run(["verify", "bfcl_multi_turn", positional, str(f)], capsys)
    assert code == 1 and json.loads(out)["passed"] is False


def test_finding14_all_800_bfcl_gold_results_verify_in_one_batch(bfcl, tmp_path, capsys):
    """BFCL's possible-answer layout ({"id", "ground_truth"}, call strings) for every multi-turn task."""
    f = tmp_path / "gold.jsonl"
    f.write_text("".join(json.dumps({"id": t, "ground_truth": bfcl.ground_truth(t)}) + "\n" for t in bfcl.task_ids()))
    code, out, _ = _run(["verify", "bfcl_multi_turn", "--batch", str(f)], capsys)
    lines = [json.loads(line) for line in out.splitlines()]
    summary = lines.pop()["summary"]
    assert code == 0 and summary["tasks"] == summary["passed"] == 800 and summary["formats"] == {"bfcl": 800}
    assert [r["task_id"] for r in lines] == bfcl.task_ids() and all(r["passed"] for r in lines)


def test_finding14_a_batch_reports_failures_and_refuses_malformed_lines(bfcl, tmp_path, capsys):
    ids = bfcl.task_ids()[:3]
    recs = [{"task_id": t, "actions": bfcl.ground_truth(t)} for t in ids]
    recs[1]["actions"] = [[] for _ in recs[1]["actions"]]  # does nothing: fails
    recs[2] = {"task_id": ids[2], "actions": [[c.to_dict() for c in turn] for turn in bfcl.gold_actions(ids[2])]}
    f = tmp_path / "b.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    code, out, _ = _run(["verify", "bfcl_multi_turn", "--batch", str(f)], capsys)
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and [r.get("passed") for r in lines[:3]] == [True, False, True]
    assert [r["format"] for r in lines[:3]] == ["bfcl", "envace", "envace"]  # turns without calls: no strings
    assert lines[3]["summary"]["failed"] == 1
    for bad, expect in (('{"task_id": "x"', ":3: not valid JSON"),
                        ('{"task_id": "nope", "actions": []}', ":3: unknown"),
                        (json.dumps({"task_id": ids[2], "actions": [["cd("]]}), ":3: turn 0, call 0: not a call"),
                        ('{"actions": []}', ":3: expected {\"task_id\""),
                        (json.dumps(recs[0]), f":3: task '{ids[0]}' again (first on line 1)")):
        f.write_text("".join(json.dumps(r) + "\n" for r in recs[:2]) + bad + "\n")
        code, out, err = _run(["verify", "bfcl_multi_turn", "--batch", str(f)], capsys)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert f"{f}{expect}" in err, err
    f.write_text("")
    assert _run(["verify", "bfcl_multi_turn", "--batch", str(f)], capsys)[2].strip().endswith("holds no task")
    code, _, err = _run(["verify", "bfcl_multi_turn", TASK, str(f), "--batch", str(f)], capsys)
    assert code == 2 and "not both" in err


def test_finding14_tau2_action_objects_with_a_requestor_verify(tmp_path, capsys):
    kw = json.dumps({"tau2": {"domains": ["telecom"]}})
    pool = get_pool("tau2", domains=("telecom",))
    tid = next(t for t in pool.task_ids() if any(getattr(c, "requestor", "") == "user"
                                                 for turn in pool.gold_actions(t) for c in turn))
    actions = [{"action_id": f"a{i}", "name": c.name, "arguments": dict(c.arguments), "requestor": c.requestor}
               for i, c in enumerate(pool.gold_actions(tid)[0])]
    f = tmp_path / "tau2.json"
    f.write_text(json.dumps(actions))
    code, out, _ = _run(["--pool-kwargs", kw, "verify", "tau2", tid, str(f)], capsys)
    assert json.loads(out)["format"] == "tau2" and code == 0, out
    f.write_text(json.dumps([a for a in actions if a["requestor"] == "assistant"]))  # the user's side dropped
    code, out, _ = _run(["--pool-kwargs", kw, "verify", "tau2", tid, str(f)], capsys)
    assert code == 1 and json.loads(out)["passed"] is False
