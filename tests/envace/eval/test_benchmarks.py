"""Benchmarks are objects that own their differences (envace/eval/benchmarks.py): the CLI builds each subcommand
from the registry and ``run_benchmark`` runs any of them the same way, so a new benchmark is a subclass and a
registry entry; τ²'s pool settings, simulated user and judge belong to its object."""

from __future__ import annotations

import argparse
import json

import pytest

from envace.agents.client import EndpointConfig
from envace.envs.base import get_pool
from envace.eval import benchmarks
from envace.eval.benchmarks import BENCHMARKS, PAPER_TABLE, Bfcl, Synthetic, Tau2
from envace.eval.cli import build_parser, main
from envace.eval.driver import select_tasks
from envace.toolcall import render_tool_call

TASK = "multi_turn_base_0"
ENDPOINT = ["--base-url", "http://127.0.0.1:9/v1", "--model", "m"]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_the_registry_is_the_tables_column_groups_in_order():
    assert list(BENCHMARKS) == ["tau2", "bfcl", "synthetic"] and PAPER_TABLE == ("tau2", "bfcl")
    assert [b.name for b in BENCHMARKS.values()] == list(BENCHMARKS)
    assert isinstance(BENCHMARKS["tau2"], Tau2) and isinstance(BENCHMARKS["bfcl"], Bfcl)
    assert isinstance(BENCHMARKS["synthetic"], Synthetic)
    for bench in BENCHMARKS.values():
        assert len(bench.categories) == len(bench.labels) and bench.help


def test_synthetic_builds_its_pool_from_pool_kwargs_and_selects_held_out_tasks_by_shape():
    from envace.envs.synthetic.domains import SHAPES

    syn = BENCHMARKS["synthetic"]
    assert syn.categories == SHAPES
    args = parse("synthetic", *ENDPOINT, "--pool-kwargs", '{"tasks_per_env": 12, "renamings": false}',
                 "--categories", "query", "lookup_query", "--split", "test")
    pool = syn.build_pool(args)
    assert pool.tasks_per_env == 12 and syn.identity(args) == {"pool_kwargs": {"tasks_per_env": 12, "renamings": False}}
    selected = select_tasks(pool, syn, split=args.split, categories=syn.wanted(args), limit=2)
    assert sorted(set(selected.values())) == ["lookup_query", "query"] and list(selected.values()).count("query") == 2
    assert all(pool.task(t).category == c and pool.split_of(t) == "test" for t, c in selected.items())
    with pytest.raises(ValueError, match="^--pool-kwargs: .*nope"):
        syn.build_pool(parse("synthetic", *ENDPOINT, "--pool-kwargs", '{"nope": 1}'))


def test_a_table_of_synthetic_runs_has_their_group_and_the_papers_overall_stays_the_papers():
    from envace.eval.report import format_table

    syn = {"categories": {"query": {"score": 50.0}}, "average": 50.0}
    alone = format_table([("m", {"synthetic": syn})], markdown=True).splitlines()
    assert alone[0].startswith("| Model | Synthetic (%) |") and "Overall" not in alone[0] and "Multi-Turn" not in alone[0]
    assert "| 50.0 |" in alone[3]
    bfcl = {"categories": {c: {"score": 10.0} for c in BENCHMARKS["bfcl"].categories}, "average": 10.0}
    tau2 = {"categories": {c: {"score": 30.0} for c in BENCHMARKS["tau2"].categories}, "average": 30.0}
    mixed = format_table([("m", {"tau2": tau2, "bfcl": bfcl, "synthetic": syn})], markdown=True).splitlines()
    assert mixed[0].index("Multi-Turn") < mixed[0].index("Synthetic") < mixed[0].index("Overall")
    assert mixed[3].endswith("| 20.0 |")  # Overall: the mean of τ² and BFCL, the synthetic group outside it


def test_bfcl_names_its_categories_without_prefixes_and_selects_by_them():
    bfcl = BENCHMARKS["bfcl"]
    assert [bfcl.normalize(c) for c in ("BFCL_v4_multi_turn_miss_func", "multi_turn_base", "long_context")] == [
        "miss_func", "base", "long_context"]
    args = parse("bfcl", *ENDPOINT, "--categories", "multi_turn_base", "--limit", "2")
    assert bfcl.wanted(args) == ["multi_turn_base"]
    selected = select_tasks(get_pool("bfcl_multi_turn"), bfcl, categories=bfcl.wanted(args), limit=args.limit)
    assert list(selected.values()) == ["base", "base"]
    assert bfcl.clients(args, EndpointConfig(base_urls="http://a/v1", model="m")) == {}
    assert bfcl.identity(args) == {}


def test_tau2_builds_its_pool_from_its_own_flags(monkeypatch):
    seen = {}
    monkeypatch.setattr("envace.envs.base.get_pool", lambda name, **kw: seen.update(name=name, **kw) or "pool")
    tau2 = BENCHMARKS["tau2"]
    assert tau2.build_pool(parse("tau2", *ENDPOINT)) == "pool"
    assert seen == {"name": "tau2", "domains": ("airline", "retail", "telecom"), "max_steps": 200, "max_errors": 10}
    tau2.build_pool(parse("tau2", *ENDPOINT, "--domains", "retail", "--tau2-max-steps", "7", "--tau2-max-errors", "3"))
    assert seen == {"name": "tau2", "domains": ("retail",), "max_steps": 7, "max_errors": 3}


def test_tau2_user_and_judge_default_to_the_agents_endpoint():
    tau2 = BENCHMARKS["tau2"]
    agent = EndpointConfig(base_urls="http://agent:8000/v1", model="policy", api_key="k", seed=5, timeout_s=9.0,
                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    args = parse("tau2", *ENDPOINT)
    clients = tau2.clients(args, agent)
    user = clients["user"].config
    assert (user.base_urls, user.model, user.api_key, user.seed, user.timeout_s) == (
        ["http://agent:8000/v1"], "policy", "k", 5, 9.0)
    assert (user.temperature, user.max_tokens, user.extra_body) == (0.0, None, agent.extra_body)
    assert clients["judge"] is None  # no --judge-model: NL assertions stay unjudged
    args = parse("tau2", *ENDPOINT, "--user-base-url", "http://user:1/v1", "--user-model", "u", "--user-api-key", "uk",
                 "--user-temperature", "0.3", "--judge-model", "j")
    clients = tau2.clients(args, agent)
    user, judge = clients["user"].config, clients["judge"].config
    assert (user.base_urls, user.model, user.api_key, user.temperature) == (["http://user:1/v1"], "u", "uk", 0.3)
    assert (judge.base_urls, judge.model, judge.api_key, judge.temperature) == (["http://agent:8000/v1"], "j", "k", 0.0)
    assert tau2.identity(args) == {"user_model": "u", "user_temperature": 0.3, "user_max_tokens": None,
                                   "judge_model": "j", "tau2_max_steps": 200, "tau2_max_errors": 10}


def test_tau2_flags_belong_to_tau2_only(capsys):
    with pytest.raises(SystemExit):
        parse("bfcl", *ENDPOINT, "--user-model", "u")
    assert "unrecognized arguments: --user-model" in capsys.readouterr().err


class Probe(Bfcl):
    """A benchmark the CLI has never heard of: BFCL's pool under another name, with a flag, an identity and an extra
    endpoint of its own."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--probe-level", type=int, default=1)

    def clients(self, args, agent):
        self.seen_agent.append(agent.model)
        return {}

    def identity(self, args):
        return {"probe_level": args.probe_level}


def test_a_new_benchmark_is_a_registry_entry_and_the_cli_runs_it(fake_openai, replies, tmp_path, monkeypatch, capsys):
    texts = []
    for turn in get_pool("bfcl_multi_turn").gold_actions(TASK):
        texts += [render_tool_call(c) for c in turn] + ["Done."]
    server = fake_openai(replies.script(*[replies.chat(t) for t in texts]))
    probe = Probe(name="probe", pool="bfcl_multi_turn", title="Probe (%)", categories=("base",), labels=("Base",),
                  help="a probe")
    object.__setattr__(probe, "seen_agent", [])
    monkeypatch.setitem(benchmarks.BENCHMARKS, "probe", probe)
    out = tmp_path / "run"
    argv = ["probe", "--base-url", server.base_url, "--model", "gold", "--categories", "base", "--limit", "1",
            "--no-progress", "--max-steps-per-turn", "8", "--probe-level", "4", "--out", str(out)]
    assert main(argv) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["benchmark"] == "probe" and run["probe_level"] == 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmark"] == "probe" and summary["summary"]["categories"]["base"]["score"] == 100.0
    assert probe.seen_agent == ["gold"]
    capsys.readouterr()
    assert main([*argv[:-4], "--probe-level", "5", "--out", str(out)]) == 2  # its identity guards the resume
    assert "probe_level: 4 -> 5" in capsys.readouterr().err
