"""Synthetic multi-environment pool: determinism, gold replay, perturbations, errors, splits, prompt size, CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from envace.envs.base import ToolCall, available_pools, flatten_turns, get_pool
from envace.envs.synthetic import DOMAINS, SHAPES, SyntheticPool

REPO = Path(__file__).resolve().parents[3]
DEPENDENT_SHAPES = {"lookup_act", "lookup_query", "copy_value", "transfer_chain", "create_verify", "filter_update"}


@pytest.fixture(scope="module")
def pool() -> SyntheticPool:
    p = get_pool("synthetic")
    assert isinstance(p, SyntheticPool)
    return p


@pytest.fixture(scope="module")
def partial_pool() -> SyntheticPool:
    return SyntheticPool(reward="partial")


def _first(pool: SyntheticPool, pred) -> str:
    return next(t for t in pool.task_ids() if pred(pool.task(t)))


def _tool(pool: SyntheticPool, task_id: str, op_prefix: str) -> dict:
    """The schema of the task's tool whose description starts with ``op_prefix``."""
    return next(t["function"] for t in pool.task(task_id).tools if t["function"]["description"].startswith(op_prefix))


# --------------------------------------------------------------------------------------------------
# size, determinism, environments
# --------------------------------------------------------------------------------------------------


def test_registered_and_default_size(pool):
    assert "synthetic" in available_pools()
    ids = pool.task_ids()
    assert len(ids) == 51 * 50 == len(set(ids))
    assert len(pool.environments()) == 51
    assert Counter(pool.task(t).env_id for t in ids) == {e: 50 for e in pool.environments()}
    spec = pool.task(ids[0])
    assert spec.pool == "synthetic" and spec.category in SHAPES and spec.env_id.startswith("syn-")
    assert spec.initial_state_summary and spec.verifier_text


def test_constructor_is_fast_and_sizes_configurable():
    start = time.perf_counter()
    p = SyntheticPool()
    p.task(p.task_ids()[-1])  # builds one environment lazily
    assert time.perf_counter() - start < 1.0
    small = get_pool("synthetic", n_envs=3, tasks_per_env=7, seed=5)
    assert len(small.task_ids()) == 21 and len(small.environments()) == 3
    assert {small.task(t).env_id for t in small.task_ids()} == set(small.environments())
    big = SyntheticPool(n_envs=2, tasks_per_env=120)
    assert len(big.task_ids()) == 240 and big.task_ids()[-1].endswith("/t119")
    for bad in ({"n_envs": 0}, {"tasks_per_env": 0}, {"reward": "dense"}, {"test_fraction": 1.5}):
        with pytest.raises(ValueError):
            SyntheticPool(**bad)


def _snapshot(p: SyntheticPool) -> list:
    return [
        (p.task(t), flatten_turns(p.gold_actions(t)), p.gold_observations(t), p.gold_replies(t)) for t in p.task_ids()
    ]


def test_deterministic_in_seed(pool):
    assert _snapshot(SyntheticPool(seed=0)) == _snapshot(pool)
    a, b = _snapshot(SyntheticPool(n_envs=9, seed=1)), _snapshot(SyntheticPool(n_envs=9, seed=2))
    assert len(a) == len(b)
    differing = sum(x[0].first_user_message != y[0].first_user_message or x[1] != y[1] for x, y in zip(a, b))
    assert differing > len(a) // 2
    assert [x[0].tools for x in a] != [y[0].tools for y in b]


def test_environments_are_distinct_with_3_to_8_tools(pool):
    envs = pool.environments()
    assert {e.split("-")[1] for e in envs} == {d.name for d in DOMAINS}
    signatures = set()
    for env_id in envs:
        tools = pool.env_tools(env_id)
        assert 3 <= len(tools) <= 8, env_id
        names = [t["function"]["name"] for t in tools]
        assert len(set(names)) == len(names)
        for t in tools:
            assert t["type"] == "function" and set(t["function"]) == {"name", "description", "parameters"}
            params = t["function"]["parameters"]
            assert params["type"] == "object" and set(params["required"]) == set(params["properties"])
        summary = pool.task(f"{env_id}/t00").initial_state_summary
        signatures.add((json.dumps(tools, sort_keys=True), summary))
    assert len(signatures) == len(envs)
    # different subsets/renamings within one domain
    bank = [e for e in envs if e.startswith("syn-bank-")]
    assert len({json.dumps(pool.env_tools(e), sort_keys=True) for e in bank}) == len(bank)
    assert len({len(pool.env_tools(e)) for e in envs}) >= 3


def test_task_shapes_and_dependent_chains(pool):
    shapes = Counter(pool.task(t).category for t in pool.task_ids())
    assert set(shapes) == set(SHAPES) and all(n >= 20 for n in shapes.values()), shapes
    per_env: dict[str, set[str]] = defaultdict(set)
    for tid in pool.task_ids():
        spec, gold = pool.task(tid), pool.gold_actions(tid)
        per_env[spec.env_id].add(spec.category)
        assert spec.metadata["n_calls"] == sum(map(len, gold)) and spec.metadata["n_turns"] == len(gold)
        assert len(gold) == (2 if spec.category == "multiturn" else 1)
        if spec.category in DEPENDENT_SHAPES | {"multiturn"}:
            # a later call uses a value that an earlier observation returned and the instruction does not name
            text = " ".join(pool.user_messages(tid))
            calls = [c for turn in gold for c in turn]
            observations = [o for turn in pool.gold_observations(tid) for o in turn]
            seen: set[str] = set()
            dependent = False
            for call, obs in zip(calls, observations, strict=True):
                for v in call.arguments.values():
                    if str(v) in seen and not re.search(rf"(?<!\w){re.escape(str(v))}(?!\w)", text):
                        dependent = True
                seen |= {str(v) for v in _values(json.loads(obs))}
            assert dependent, tid
    assert all(len(shapes) >= 5 for shapes in per_env.values())


def _values(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _values(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _values(v)
    else:
        yield obj


# --------------------------------------------------------------------------------------------------
# gold replay and perturbations
# --------------------------------------------------------------------------------------------------


def test_every_gold_replays_to_one(pool, partial_pool):
    start = time.perf_counter()
    for p in (pool, partial_pool):
        for tid in p.task_ids():
            gold = p.gold_actions(tid)
            verdict = p.replay(tid, gold)
            assert verdict.reward == 1.0 and verdict.passed, (tid, verdict.details)
            assert p.replay(tid, gold, replies=p.gold_replies(tid)).reward == 1.0, tid
            assert not any("error" in json.loads(o) for turn in p.gold_observations(tid) for o in turn)
    assert time.perf_counter() - start < 30


def test_gold_episode_by_hand_matches_observations(pool):
    for tid in pool.task_ids()[::37]:
        ep = pool.start(tid)
        turns, observations, replies = pool.gold_actions(tid), pool.gold_observations(tid), pool.gold_replies(tid)
        for t, turn in enumerate(turns):
            assert [ep.execute(c) for c in turn] == observations[t]
            nxt = ep.end_turn(replies[t])
            assert nxt == (pool.user_messages(tid)[t + 1] if t + 1 < len(turns) else None)
        assert ep.done and ep.verify().reward == 1.0
        traj = pool.gold_trajectory(tid)
        assert traj[0] == {"role": "user", "content": pool.task(tid).first_user_message}
        assert sum(m["role"] == "tool" for m in traj) == sum(map(len, turns))
        assert [m["content"] for m in traj if m["role"] == "assistant" and m["content"]] == replies


def _perturb_value(v, statuses):
    if isinstance(v, int):
        return v + 1
    if v in statuses:
        return next(s for s in statuses if s != v)
    return v + "x"


def _last_call_perturbations(pool: SyntheticPool, tid: str):
    """(name, actions) pairs: the last call dropped, then each of its arguments changed."""
    gold = pool.gold_actions(tid)
    domain = next(d for d in DOMAINS if d.name == pool.task(tid).metadata["domain"])
    dropped = [list(turn) for turn in gold]
    dropped[-1] = dropped[-1][:-1]
    yield "dropped", dropped
    last = gold[-1][-1]
    for key, value in last.arguments.items():
        wrong = [list(turn) for turn in gold]
        wrong[-1][-1] = ToolCall(last.name, {**last.arguments, key: _perturb_value(value, domain.statuses)})
        yield f"wrong {key}", wrong


def test_perturbed_sequences_score_lower(pool, partial_pool):
    between = Counter()
    total = 0
    for tid in pool.task_ids():
        for name, actions in _last_call_perturbations(pool, tid):
            total += 1
            binary = pool.replay(tid, actions)
            assert binary.reward == 0.0 and not binary.passed, (tid, name)
            partial = partial_pool.replay(tid, actions)
            assert 0.0 <= partial.reward < 1.0, (tid, name)
            between[name.split()[0]] += 0.0 < partial.reward < 1.0
            assert partial.details["passed_checks"] < partial.details["total_checks"]
    assert between["dropped"] > 1000 and between["wrong"] > 1000, (between, total)


def test_answer_checks_read_the_reply(pool, partial_pool):
    tid = _first(pool, lambda s: s.category == "lookup_query")
    gold = pool.gold_actions(tid)
    assert pool.replay(tid, gold, replies=["I do not know."]).reward == 0.0
    assert partial_pool.replay(tid, gold, replies=["I do not know."]).reward == 0.5
    assert pool.replay(tid, gold, replies=pool.gold_replies(tid)).reward == 1.0
    # the question turn of a multi-turn task is checked on that turn's reply
    tid = _first(pool, lambda s: s.category == "multiturn" and "?" in pool.user_messages(s.task_id)[1])
    replies = pool.gold_replies(tid)
    assert pool.replay(tid, pool.gold_actions(tid), replies=replies).reward == 1.0
    assert pool.replay(tid, pool.gold_actions(tid), replies=replies[::-1]).reward == 0.0


def test_nothing_done_and_wrong_turns(pool, partial_pool):
    tid = _first(pool, lambda s: s.category == "multiturn")
    assert pool.replay(tid, [[], []]).reward == 0.0
    assert 0.0 < partial_pool.replay(tid, [[]]).reward < 1.0  # "nothing else changed" still holds
    gold = pool.gold_actions(tid)
    assert pool.replay(tid, [gold[0]]).reward == 0.0  # the second turn never happened
    assert pool.replay(tid, [*gold, gold[-1]]).reward == 1.0  # extra turns beyond the task are ignored


# --------------------------------------------------------------------------------------------------
# episodes: errors, fork, turns
# --------------------------------------------------------------------------------------------------


def _error(obs: str) -> str:
    out = json.loads(obs)
    assert set(out) == {"error"}, obs
    return out["error"]


def test_error_observations(pool):
    tid = _first(pool, lambda s: s.category == "act")
    ep = pool.start(tid)
    get = _tool(pool, tid, "Get ")
    (id_param,) = get["parameters"]["properties"]
    some_id = pool.task(tid).initial_state_summary.split(": ", 1)[1].split()[0]
    assert "unknown tool" in _error(ep.execute(ToolCall("rm_rf", {})))
    assert "required" in _error(ep.execute(ToolCall(get["name"], {})))
    assert "not of type 'string'" in _error(ep.execute(ToolCall(get["name"], {id_param: 17})))
    assert "unexpected argument" in _error(ep.execute(ToolCall(get["name"], {id_param: some_id, "x": 1})))
    assert "unknown" in _error(ep.execute(ToolCall(get["name"], {id_param: "ZZ99"})))
    assert json.loads(ep.execute(ToolCall(get["name"], {id_param: some_id})))["id"] == some_id
    find = _tool(pool, tid, "Find ")
    (name_param,) = find["parameters"]["properties"]
    assert "no " in _error(ep.execute(ToolCall(find["name"], {name_param: "Nobody Here"})))
    assert _error(ep.execute({"name": get["name"], "arguments": "{not json"}))  # raw dict, unparsable
    assert json.loads(ep.execute({"name": get["name"], "arguments": json.dumps({id_param: some_id})}))["id"] == some_id
    # the state is untouched by all of that
    assert ep.state == pool.start(tid).state


def test_schema_enum_range_and_insufficient_funds(pool):
    tid = _first(pool, lambda s: any(t["function"]["description"].startswith("Move ") for t in s.tools))
    ep = pool.start(tid)
    move = _tool(pool, tid, "Move ")
    src, dst, amount = move["parameters"]["properties"]
    ids = [part.split()[0] for part in pool.task(tid).initial_state_summary.split(": ", 1)[1].split("; ")]
    assert "insufficient" in _error(ep.execute(ToolCall(move["name"], {src: ids[0], dst: ids[1], amount: 10**6})))
    assert "at least 1" in _error(ep.execute(ToolCall(move["name"], {src: ids[0], dst: ids[1], amount: 0})))
    assert "same" in _error(ep.execute(ToolCall(move["name"], {src: ids[0], dst: ids[0], amount: 1})))
    assert "moved" in json.loads(ep.execute(ToolCall(move["name"], {src: ids[0], dst: ids[1], amount: 1})))
    tid = _first(pool, lambda s: any(t["function"]["description"].startswith("Set ") for t in s.tools))
    ep = pool.start(tid)
    for tool in pool.task(tid).tools:
        f = tool["function"]
        props = f["parameters"]["properties"]
        enum = next((p["enum"] for p in props.values() if "enum" in p), None)
        if f["description"].startswith("Set ") and enum:
            args = {k: ("?" if "enum" in p else "ZZ1") for k, p in props.items()}
            assert "is not one of" in _error(ep.execute(ToolCall(f["name"], args)))
        elif f["description"].startswith("Set ") and enum is None:
            some_id = pool.task(tid).initial_state_summary.split(": ", 1)[1].split()[0]
            args = {k: (10**6 if p["type"] == "integer" else some_id) for k, p in props.items()}
            assert "between" in _error(ep.execute(ToolCall(f["name"], args)))


def test_fork_is_independent(pool):
    tid = _first(pool, lambda s: s.category == "multiturn")
    gold = pool.gold_actions(tid)
    ep = pool.start(tid)
    for call in gold[0]:
        ep.execute(call)
    snapshot = json.dumps(ep.state, sort_keys=True)
    twin = ep.fork()
    assert twin.state == ep.state and twin.state is not ep.state
    assert twin.end_turn("Done.") == pool.user_messages(tid)[1]
    for call in gold[1]:
        twin.execute(call)
    assert twin.end_turn(pool.gold_replies(tid)[1]) is None and twin.done
    assert twin.verify().reward == 1.0
    assert json.dumps(ep.state, sort_keys=True) == snapshot and ep.turn == 0 and not ep.done
    assert ep.verify().reward == 0.0
    clone = twin.fork()
    assert clone.done and clone.verify().reward == 1.0


def test_multiturn_hands_out_second_message(pool):
    tids = [t for t in pool.task_ids() if pool.task(t).category == "multiturn"]
    assert len(tids) > 100
    for tid in tids[:50]:
        ep = pool.start(tid)
        first, second = pool.user_messages(tid)
        assert ep.initial_messages() == [{"role": "user", "content": first}]
        assert ep.num_turns == 2 and ep.end_turn("ok") == second and not ep.done
        assert ep.end_turn("ok") is None and ep.done
        assert ep.end_turn("again") is None
        assert "over" in _error(ep.execute(pool.gold_actions(tid)[0][0]))
    single = _first(pool, lambda s: s.category == "act")
    ep = pool.start(single)
    assert ep.end_turn("") is None and ep.done


def test_partial_reward_override_at_start(pool):
    tid = _first(pool, lambda s: s.category == "lookup_query")
    ep = pool.start(tid, reward="partial")
    ep.end_turn("no idea")
    assert ep.verify().reward == 0.5
    with pytest.raises(ValueError):
        pool.start(tid, reward="dense")
    with pytest.raises(KeyError):
        pool.start("syn-bank-00/t99")


# --------------------------------------------------------------------------------------------------
# splits
# --------------------------------------------------------------------------------------------------


def test_splits_are_disjoint_and_stable(pool):
    train, test = pool.task_ids("train"), pool.task_ids("test")
    assert not set(train) & set(test) and sorted(train + test) == sorted(pool.task_ids())
    assert pool.task_ids("all") == pool.task_ids() == pool.task_ids(None)
    assert 0.15 < len(test) / len(pool.task_ids()) < 0.25
    assert all(pool.task(t).split == "test" for t in test) and all(pool.task(t).split == "train" for t in train)
    assert SyntheticPool(n_envs=5, test_fraction=0.0).task_ids("test") == []
    assert SyntheticPool(n_envs=5, test_fraction=1.0).task_ids("train") == []
    assert SyntheticPool(seed=3).task_ids("test") != test
    with pytest.raises(ValueError):
        pool.task_ids("validation")


# --------------------------------------------------------------------------------------------------
# prompt size with the real tokenizer
# --------------------------------------------------------------------------------------------------


def test_prompt_fits_512_tokens(pool, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from envace.models import load_tokenizer

    tok = load_tokenizer()
    ids = pool.task_ids()
    sample = ids[::25]  # 102 tasks, two per environment, all shapes
    assert len({pool.task(t).env_id for t in sample}) == 51
    longest = 0
    for tid in sample:
        spec = pool.task(tid)
        out = tok.apply_chat_template(
            spec.initial_messages(), tools=spec.tools, add_generation_prompt=True, tokenize=True, enable_thinking=False
        )
        n = len(out["input_ids"] if hasattr(out, "keys") else out)
        longest = max(longest, n)
        assert n <= 512, (tid, n)
    assert longest > 300  # the tools are really rendered


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def test_cli_lists_and_replays_synthetic():
    res = subprocess.run(
        [sys.executable, "-m", "envace.envs", "--pool-kwargs", '{"synthetic": {"n_envs": 9}}', "gold", "synthetic",
         "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert any(line.split() == ["all", "450", "450"] for line in res.stdout.splitlines()), res.stdout
    res = subprocess.run(
        [sys.executable, "-m", "envace.envs", "list", "synthetic"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("synthetic: 2550 tasks")
    rows = {line.split()[0] for line in res.stdout.splitlines()[2:]}
    assert rows == set(SHAPES)


# --------------------------------------------------------------------------------------------------
# shape filter (the easy learning configuration)
# --------------------------------------------------------------------------------------------------

EASY = ("act", "query", "lookup_act", "lookup_query")


def test_shapes_filter_keeps_only_those_shapes():
    easy = SyntheticPool(shapes=EASY)
    ids = easy.task_ids()
    assert len(ids) == 51 * 50 and easy.shapes == EASY
    cats = Counter(easy.task(t).category for t in ids)
    assert set(cats) == set(EASY) and min(cats.values()) > 400  # every kept shape in every environment's cycle
    assert all(easy.task(t).metadata["n_calls"] <= 2 and easy.task(t).metadata["n_turns"] == 1 for t in ids)
    # ids and splits do not depend on the filter; the default pool is unchanged by the option
    full = SyntheticPool()
    assert easy.task_ids("test") == full.task_ids("test") and easy.task_ids("train") == full.task_ids("train")
    assert full.shapes is None and len({full.task(t).category for t in full.task_ids()}) == len(SHAPES)
    assert _snapshot(SyntheticPool(n_envs=9, shapes=EASY)) == _snapshot(SyntheticPool(n_envs=9, shapes=list(EASY)))
    assert _snapshot(SyntheticPool(n_envs=9, shapes=EASY)) != _snapshot(SyntheticPool(n_envs=9))
    # order and repetition do not matter; a single shape may be given as a string
    assert SyntheticPool(n_envs=3, shapes=("query", "act", "act")).shapes == ("act", "query")
    acts = SyntheticPool(n_envs=3, shapes="act")
    assert {acts.task(t).category for t in acts.task_ids()} == {"act"}
    for bad in ((), ("nope",), ("act", "walk")):
        with pytest.raises(ValueError):
            SyntheticPool(shapes=bad)


def test_shapes_filter_gold_replays_to_one():
    for shapes in (EASY, ("transfer_chain", "create_verify"), ("multiturn",)):
        p = SyntheticPool(n_envs=18, shapes=shapes, reward="partial")
        for tid in p.task_ids():
            assert p.task(tid).category in shapes or p.task(tid).category == "query"
            assert p.replay(tid, p.gold_actions(tid)).reward == 1.0, tid
            assert p.replay(tid, p.gold_actions(tid), replies=p.gold_replies(tid)).reward == 1.0, tid


def test_shapes_filter_through_get_pool_is_deterministic():
    a, b = get_pool("synthetic", shapes=EASY), get_pool("synthetic", shapes=EASY)
    tids = a.task_ids("test")[::23]
    assert [a.user_messages(t) for t in tids] == [b.user_messages(t) for t in tids]
    assert [a.gold_actions(t) for t in tids] == [b.gold_actions(t) for t in tids]


def test_without_renamings_every_domain_uses_its_first_names():
    plain, renamed = SyntheticPool(n_envs=27, renamings=False), SyntheticPool(n_envs=27)
    names_plain: dict[str, set[str]] = {}
    names_renamed: dict[str, set[str]] = {}
    for env_id in plain.environments():
        domain = env_id.split("-")[1]
        names_plain.setdefault(domain, set()).update(t["function"]["name"] for t in plain.env_tools(env_id))
        names_renamed.setdefault(domain, set()).update(t["function"]["name"] for t in renamed.env_tools(env_id))
    for d in DOMAINS:
        firsts = {variants[0] for variants in d.tools.values()}
        assert names_plain[d.name] <= firsts, d.name  # one name per operation across the domain's environments
        assert not names_renamed[d.name] <= firsts  # the default pool renames
    # the same generator otherwise: deterministic, every gold sequence replays to 1.0
    assert _snapshot(SyntheticPool(n_envs=9, renamings=False)) == _snapshot(SyntheticPool(n_envs=9, renamings=False))
    for tid in plain.task_ids()[::5]:
        assert plain.replay(tid, plain.gold_actions(tid), replies=plain.gold_replies(tid)).reward == 1.0, tid
