"""Evaluation (``trace2env/evaluate.py``): agreement with held-out traces, the paired bootstrap over trajectories,
the multi-system table and its CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
from t2e_kvenv import record

import trace2env.__main__ as cli
from trace2env import build_worldbook, load_worldbook, parse_trace
from trace2env.baselines import PREDICT_STAGE
from trace2env.evaluate import evaluate, evaluate_systems, format_table, paired_bootstrap
from trace2env.judge import JUDGE_STAGE
from trace2env.providers import ScriptedProvider


def steps_of(values_per_trace, metric="exact"):
    return [{"trace_id": f"t{i}", "transition_id": f"t{i}s{j}", metric: v}
            for i, vals in enumerate(values_per_trace) for j, v in enumerate(vals)]


def test_identical_systems_differ_by_zero_with_zero_width():
    rng = np.random.default_rng(1)
    vals = [rng.random(rng.integers(1, 9)).tolist() for _ in range(25)]
    r = paired_bootstrap(steps_of(vals), steps_of(vals), "exact", n_boot=2000)
    assert r["diff"] == 0.0 and r["ci95"] == (0.0, 0.0) and r["traces"] == 25 and r["pairs"] == sum(map(len, vals))


def test_known_difference_point_estimate_and_interval():
    rng = np.random.default_rng(2)
    base = [rng.random(rng.integers(2, 7)) for _ in range(40)]
    shifted = [b + 0.25 for b in base]
    r = paired_bootstrap(steps_of(shifted), steps_of(base), "exact", n_boot=2000)
    assert r["diff"] == pytest.approx(0.25) and r["ci95"] == pytest.approx((0.25, 0.25))  # a constant shift
    # noisy per-step differences: the estimate is the step mean of the differences, the CI covers it
    noise = [rng.normal(0.1, 0.3, len(b)) for b in base]
    other = [b + e for b, e in zip(base, noise, strict=True)]
    r = paired_bootstrap(steps_of(other), steps_of(base), "exact", n_boot=4000, seed=3)
    assert r["diff"] == pytest.approx(np.concatenate(noise).mean())
    lo, hi = r["ci95"]
    assert lo < r["diff"] < hi and lo < 0.1 < hi and hi - lo < 0.25
    # system - baseline: swapping the arguments flips the sign
    r2 = paired_bootstrap(steps_of(base), steps_of(other), "exact", n_boot=4000, seed=3)
    assert r2["diff"] == pytest.approx(-r["diff"]) and r2["ci95"] == pytest.approx((-hi, -lo))


def test_interval_covers_the_true_difference_about_95_percent_with_clustered_steps():
    """Each trajectory has its own offset (steps within it are correlated): resampling trajectories keeps
    the 95 % coverage; resampling steps would be far too narrow (coverage ~50 % here)."""
    rng = np.random.default_rng(4)
    true, covered, reps = 0.2, 0, 150
    for rep in range(reps):
        lens = rng.integers(5, 15, size=30)
        offsets = rng.normal(0.0, 0.5, size=30)
        diff = [true + o + rng.normal(0.0, 0.05, n) for o, n in zip(offsets, lens, strict=True)]
        zero = [np.zeros(n) for n in lens]
        lo, hi = paired_bootstrap(steps_of(diff), steps_of(zero), "exact", n_boot=1000, seed=rep)["ci95"]
        covered += lo <= true <= hi
    assert 0.85 <= covered / reps <= 0.99, covered / reps


def test_masked_values_are_dropped_from_pairs():
    a = steps_of([[80.0, None, 60.0], [40.0]], "judge")
    b = steps_of([[70.0, 50.0, None], [20.0]], "judge")
    r = paired_bootstrap(a, b, "judge", n_boot=500)
    assert r["pairs"] == 2 and r["traces"] == 2 and r["diff"] == pytest.approx((10.0 + 20.0) / 2)
    empty = paired_bootstrap(steps_of([[None]], "judge"), b, "judge")
    assert empty["pairs"] == 0 and np.isnan(empty["diff"])


@pytest.fixture(scope="module")
def kv(tmp_path_factory):
    d = tmp_path_factory.mktemp("kve")
    train = [parse_trace({**record(s, n=20), "metadata": {"initial_state_id": "empty"}}) for s in range(8)]
    held = [{**record(s, n=8), "metadata": {"initial_state_id": "empty"}} for s in range(300, 305)]
    p = d / "held.jsonl"
    p.write_text("".join(json.dumps(h) + "\n" for h in held))
    return load_worldbook(build_worldbook(train, d / "wb")), [parse_trace(h) for h in held], p


def judge_answers():
    return {JUDGE_STAGE: {"format": 5, "factuality": 3, "consistency": 4, "realism": 4, "quality": 3}}


def test_systems_table_with_paired_differences(kv):
    from trace2env.judge import LLMJudge

    wb, held, _ = kv
    p = ScriptedProvider({PREDICT_STAGE: {"observation": '{"ok": true, "key": "a"}'}})
    rep = evaluate_systems(wb, held, ["evidence", "rules", "direct"], provider=p, judge=LLMJudge(ScriptedProvider(
        judge_answers())), n_boot=500)
    ev, ru, di = rep["systems"]
    assert [s["system"] for s in rep["systems"]] == ["evidence", "rules", "direct"] and rep["baseline"] == "evidence"
    assert ev["steps"] == ru["steps"] == di["steps"] == 40
    # no masking: the paired difference is the difference of the means
    for name, s in (("rules", ru), ("direct", di)):
        for m in ("exact", "key_overlap", "answered", "judge"):
            assert rep["paired"][name][m]["diff"] == pytest.approx(s[m] - ev[m])
            assert rep["paired"][name][m]["pairs"] == 40
    assert ru["exact"] < ev["exact"]
    assert (ev["mode"], ru["mode"], di["mode"], di["prompt_version"]) == ("evidence", "rules", None, "direct_v1")
    assert di["judge"] == pytest.approx(np.mean([100, 50, 75, 75, 50])) and di["judge_failures"] == 0
    table = format_table(rep)
    lines = table.splitlines()
    assert lines[0].split()[:6] == ["system", "steps", "exact", "%", "key_overlap", "%"] and "judge" in lines[0]
    row = next(x for x in lines if x.startswith("rules "))
    assert f"{100 * ru['exact']:.1f} [{100 * ru['exact_ci95'][0]:.1f}, {100 * ru['exact_ci95'][1]:.1f}]" in row
    assert "paired difference vs evidence" in table
    prow = [x for x in lines if x.startswith("rules ")][1]
    d = rep["paired"]["rules"]["exact"]
    assert f"{100 * d['diff']:+.1f} [{100 * d['ci95'][0]:+.1f}, {100 * d['ci95'][1]:+.1f}]" in prow


def test_cli_systems_table_and_json(kv, tmp_path, capsys, monkeypatch):
    wb, _, held_path = kv
    monkeypatch.setattr(cli, "_provider", lambda args: ScriptedProvider(
        {PREDICT_STAGE: {"observation": "{}"}, "world_model_step": {"tool": "submit", "arguments": {"observation": "{}"}}}))
    monkeypatch.setattr(cli, "_judge_provider", lambda args: ScriptedProvider(judge_answers()) if args.judge_model else None)
    out = tmp_path / "r.json"
    rc = cli.main(["eval", str(wb.root), str(held_path), "--systems", "evidence,direct,trace_rag,worldbook_prompt,harness_only",
                   "--judge-model", "j", "--judge-base-url", "http://x/v1", "--n-boot", "300", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for name in ("evidence", "direct", "trace_rag", "worldbook_prompt", "harness_only"):
        assert any(line.startswith(name + " ") for line in text.splitlines())
    assert "judge 0-100" in text and "paired difference vs evidence" in text
    saved = json.loads(out.read_text())
    assert [s["system"] for s in saved["systems"]] == ["evidence", "direct", "trace_rag", "worldbook_prompt", "harness_only"]
    assert set(saved["paired"]) == {"direct", "trace_rag", "worldbook_prompt", "harness_only"}
    assert len(saved["steps"]["direct"]) == 40 and saved["systems"][1]["judge"] == pytest.approx(70.0)
    capsys.readouterr()
    assert cli.main(["eval", str(wb.root), str(held_path), "--systems", "rules", "--mode", "rules"]) == 2
    assert "not both" in capsys.readouterr().err
    monkeypatch.setattr(cli, "_provider", lambda args: None)
    assert cli.main(["eval", str(wb.root), str(held_path), "--systems", "evidence,direct"]) == 2
    assert "needs a model provider" in capsys.readouterr().err


def test_cli_provider_limits_reach_every_provider(monkeypatch):
    """--max-tokens (also the cap: no doubling), --repair-rounds and --max-payload-chars configure the systems'
    provider and the judge's alike; without them the providers keep their defaults."""
    seen = []
    monkeypatch.setattr(cli, "_eval", lambda args, split, provider, judge: seen.append((provider, judge)) or 0)
    argv = ["eval", "WB", "T.jsonl", "--systems", "evidence,direct", "--base-url", "http://h/v1", "--model", "m",
            "--judge-base-url", "http://j/v1", "--judge-model", "jm"]
    assert cli.main([*argv, "--max-tokens", "16", "--repair-rounds", "0", "--max-payload-chars", "8000"]) == 0
    assert cli.main(argv) == 0
    limits = [[(p.config.max_tokens, p.config.max_tokens_cap, p.config.repair_rounds, p.config.max_payload_chars)
               for p in pair] for pair in seen]
    assert limits == [[(16, 16, 0, 8000)] * 2, [(2048, 16384, 2, 60000)] * 2]


def test_a_trace_the_worldbook_was_built_from_is_flagged_as_not_held_out(kv):
    """Trace ids are content hashes: evaluating a recording the worldbook was built from warns and is counted."""
    wb, held, _ = kv
    train_again = parse_trace({**record(0, n=20), "metadata": {"initial_state_id": "empty"}})
    assert evaluate(wb, held, n_boot=10)["summary"]["traces_in_worldbook"] == 0
    with pytest.warns(UserWarning, match="1 of 6 evaluated trace"):
        summary = evaluate(wb, [*held, train_again], n_boot=10)["summary"]
    assert summary["traces_in_worldbook"] == 1


# -- agreement with held-out traces (python -m trace2env eval) --------------------------------------------------------

def test_eval_measures_agreement_with_held_out_traces(kvbook, tmp_path, capsys):
    from trace2env.__main__ import main
    from trace2env.evaluate import bootstrap_ci, compare, evaluate

    assert compare('{"a": 1, "b": [1.0]}', '{"b":[1],"a":1}') == {"exact": 1.0, "key_overlap": 1.0}
    assert compare('{"a": 1}', '{"a": 2, "c": 0}') == {"exact": 0.0, "key_overlap": 0.5}
    held = [parse_trace({**record(s, n=30), "metadata": {"initial_state_id": "empty"}}) for s in range(100, 106)]
    ev = evaluate(kvbook, held, mode="evidence")["summary"]
    rules = evaluate(kvbook, held, mode="rules")["summary"]
    assert ev["steps"] == rules["steps"] == 180
    assert rules["routes"].keys() <= {"rule", "error"} and rules["exact"] < ev["exact"]  # evidence adds coverage
    assert ev["exact_when_answered"] == 1.0  # what the deterministic paths answer is right
    lo, hi = ev["exact_ci95"]
    assert lo <= ev["exact"] <= hi
    assert bootstrap_ci([(1.0, 1), (0.0, 1)], n_boot=500)[0] < 0.5 < bootstrap_ci([(1.0, 1), (0.0, 1)], n_boot=500)[1]
    p = tmp_path / "held.jsonl"
    p.write_text("".join(json.dumps({**record(s, n=30), "metadata": {"initial_state_id": "empty"}}) + "\n"
                         for s in range(100, 106)))
    assert main(["eval", str(kvbook.root), str(p), "--mode", "evidence", "--out", str(tmp_path / "r.json")]) == 0
    assert json.loads(capsys.readouterr().out)["exact"] == ev["exact"]
    assert len(json.loads((tmp_path / "r.json").read_text())["steps"]) == 180
    with pytest.raises(ValueError, match="needs a proposer"):
        evaluate(kvbook, held, mode="agent")
