"""Test-time rehearsal (envace/eval/tts.py) with scripted replies from a real local OpenAI-compatible HTTP
server (tests/envace/conftest.py) and the real BFCL pool and official checker.

The scripted model tells its roles apart by the request: the acting role gets the task's tools, the
rehearsal role gets the rehearsal prompt (sources.py), evaluation and summary get their template's text.
It acts with BFCL's gold calls, so the committed execution scores 1.0 through the official checker.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envace.agents.client import ChatClient, EndpointConfig
from envace.agents.engine import Transcript
from envace.envs.base import EnvironmentPool, Episode, ToolCall, Verdict, get_pool
from envace.eval.args import tts_from_args
from envace.eval.cli import build_parser, main
from envace.eval.runner import LoopLimits
from envace.eval.tts import (
    OMITTED,
    Attempt,
    RehearsalEpisode,
    RehearsalRunner,
    RehearsalTouchedEnvironment,
    TTSConfig,
    cost_summary,
    cut_oldest,
    format_cost_table,
    load_prompt,
)
from envace.toolcall import render_tool_call

TASK = "multi_turn_base_0"
# no forked pre-run of each real tool call under the tool bounds (sandbox.py): that costs time, not coverage here
FAST = LoopLimits(max_steps_per_turn=8, tool_timeout_s=0, tool_memory_mb=0)
FAST_ARGS = ["--max-steps-per-turn", "8", "--tool-timeout-s", "0", "--tool-memory-mb", "0", "--no-progress"]
MEMORY = {"facts": ["FACT-cd-works"], "pitfalls": ["PITFALL-no-guessing"], "plan": ["PLAN-step-one"]}


class Model:
    """The scripted model: decides the role from the request and logs (kind, attempt tag) in order."""

    def __init__(self, replies: Any, gold: list[list[ToolCall]], *, evaluate: str | None = None,
                 summarize: str | None = None, act_delay: float = 0.0) -> None:
        self.replies = replies
        self.gold = gold
        self.evaluate = evaluate  # raw text to answer evaluations with (None: valid feedback)
        self.summarize = summarize  # raw text to answer the summary with (None: MEMORY)
        self.act_delay = act_delay
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def log(self, kind: str, tag: str = "") -> None:
        with self.lock:
            self.events.append((kind, tag))

    def __call__(self, body: dict[str, Any], n: int) -> Any:
        msgs = body["messages"]
        first = msgs[0]["content"] if msgs else ""
        last = msgs[-1]["content"] or ""
        if body.get("tools"):
            system = first if msgs[0]["role"] == "system" else ""
            kind = "commit" if "# Rehearsal memory" in system else "act"
            self.log(kind, "history" if "# Earlier private rehearsals" in system else "")
            turn = sum(m["role"] == "user" for m in msgs) - 1
            if msgs[-1]["role"] == "user":
                text = "\n".join(render_tool_call(c) for c in self.gold[turn])
            else:
                text = "Done."
            reply = self.replies.chat(text)
            if kind == "act" and self.act_delay:
                reply.delay = self.act_delay
            return reply
        if msgs[-1]["role"] == "user" and last.startswith("Your previous reply could not be used"):  # a repair
            self.log("repair")
            return self.replies.chat("still not json")
        if first.startswith("You are the environment behind a set of tools"):
            self.log("rehearse")
            return self.replies.chat('<execution_result>\n{"ok": true}\n</execution_result>')
        if "You are reviewing one private rehearsal" in first:
            index = re.search(r"# Rehearsal (\d+) of", first).group(1)
            self.log("evaluate", index)
            if self.evaluate is not None:
                return self.replies.chat(self.evaluate)
            return self.replies.chat(json.dumps({"assessment": f"ASSESS-{index}", "success": index == "2",
                                                 "revision": f"REVISE-{index}"}))
        if "You privately rehearsed a tool-use task" in first:
            self.log("summarize")
            return self.replies.chat(self.summarize if self.summarize is not None else json.dumps(MEMORY))
        raise AssertionError(f"unexpected request: {first[:200]!r}")


class SpyEpisode(Episode):
    """The real episode, recording every call the runner makes on it (forks are plain copies)."""

    def __init__(self, inner: Episode, model: Model) -> None:
        self.inner, self.model, self.spec = inner, model, inner.spec
        self.initial_state = copy.deepcopy(inner.state())
        self.state_at_first_call: dict[str, Any] | None = None

    def _touch(self, what: str) -> None:
        if self.state_at_first_call is None:
            self.state_at_first_call = copy.deepcopy(self.inner.state())
        self.model.log("env", what)

    def tools(self) -> list[dict[str, Any]]:
        return self.inner.tools()

    def initial_messages(self) -> list[dict[str, Any]]:
        return self.inner.initial_messages()

    def execute(self, call: ToolCall) -> str:
        self._touch("execute")
        return self.inner.execute(call)

    def end_turn(self, assistant_text: str) -> str | None:
        self._touch("end_turn")
        return self.inner.end_turn(assistant_text)

    def verify(self) -> Verdict:
        self._touch("verify")
        return self.inner.verify()

    def fork(self) -> Episode:
        return self.inner.fork()

    @property
    def done(self) -> bool:
        return self.inner.done


class SpyPool(EnvironmentPool):
    name = "spy"

    def __init__(self, model: Model) -> None:
        self.inner = get_pool("bfcl_multi_turn", categories=("multi_turn_base",))
        self.model = model
        self.episodes: list[SpyEpisode] = []

    def task_ids(self, split: str | None = None) -> list[str]:
        return self.inner.task_ids(split)

    def task(self, task_id: str) -> Any:
        return self.inner.task(task_id)

    def start(self, task_id: str, **kwargs: Any) -> Episode:
        ep = SpyEpisode(self.inner.start(task_id, **kwargs), self.model)
        self.episodes.append(ep)
        return ep

    def gold_actions(self, task_id: str) -> list[list[ToolCall]]:
        return self.inner.gold_actions(task_id)


def run(fake_openai: Any, replies: Any, mode: str, n: int = 2, seed: int | None = None, memory: str = "summary",
        **model_kw: Any):
    gold = get_pool("bfcl_multi_turn", categories=("multi_turn_base",)).gold_actions(TASK)
    model = Model(replies, gold, **model_kw)
    server = fake_openai(model)
    client = ChatClient(EndpointConfig(base_urls=server.base_url, model="m", seed=seed, max_retries=0))
    runner = RehearsalRunner(client, TTSConfig(mode=mode, rehearsals=n, memory=memory), FAST)
    pool = SpyPool(model)
    rec = runner(pool, TASK)
    return rec, model, server, pool.episodes[0]


def requests_of(server: Any, kind: str) -> list[dict[str, Any]]:
    def kind_of(b: dict[str, Any]) -> str:
        first = b["messages"][0]["content"]
        if b.get("tools"):
            return "commit" if "# Rehearsal memory" in first else "act"
        if "You are reviewing one private rehearsal" in first:
            return "evaluate"
        if "You privately rehearsed a tool-use task" in first:
            return "summarize"
        return "rehearse"

    return [b for b in server.bodies if kind_of(b) == kind]


@pytest.mark.parametrize("memory", ["summary", "verbatim"])
@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_rehearsals_never_touch_the_real_environment(fake_openai, replies, mode, memory):
    rec, model, _, real = run(fake_openai, replies, mode, memory=memory)
    kinds = [k for k, _ in model.events]
    first_env = kinds.index("env")
    # every rehearsal, evaluation and the summary (verbatim memory: none of the last two) happened before the real
    # episode saw any call ...
    private = {"act", "rehearse"} | ({"evaluate", "summarize"} if memory == "summary" else set())
    assert set(kinds[:first_env]) == private | {"commit"}
    assert not {"act", "rehearse", "evaluate", "summarize"} & set(kinds[first_env:])
    # ... and the committed execution's first request came before it; its first real call was a tool call
    assert kinds[first_env - 1] == "commit" and model.events[first_env] == ("env", "execute")
    # the real state was the initial one when the committed execution started
    assert real.state_at_first_call == real.initial_state
    assert real.inner.state() != real.initial_state  # (the gold calls did change it afterwards)
    # only the committed execution is scored, by the official checker
    assert rec.reward == 1.0 and rec.passed, rec.reason
    assert rec.tool_calls == sum(map(len, get_pool("bfcl_multi_turn").gold_actions(TASK)))


def test_parallel_attempts_do_not_see_each_other(fake_openai, replies):
    rec, _, server, _ = run(fake_openai, replies, "parallel", n=3, act_delay=0.15)
    acts = requests_of(server, "act")
    assert acts and all("# Earlier private rehearsals" not in b["messages"][0]["content"] for b in acts)
    assert all("ASSESS-" not in json.dumps(b) for b in acts)
    assert server.max_in_flight >= 2  # the attempts of the task ran concurrently
    assert [a["index"] for a in rec.extra["tts"]["attempts"]] == [1, 2, 3]
    # the feedback is kept for the summary: all three assessments and revisions reach it
    (summ,) = requests_of(server, "summarize")
    text = summ["messages"][0]["content"]
    for i in (1, 2, 3):
        assert f"ASSESS-{i}" in text and f"REVISE-{i}" in text


def test_sequential_attempts_see_earlier_attempts_and_their_feedback(fake_openai, replies):
    rec, model, server, _ = run(fake_openai, replies, "sequential", n=3)
    # attempt k's acting requests carry exactly the assessments and revisions of attempts < k
    tags = [t for k, t in model.events if k == "act"]
    assert tags[0] == "" and "history" in tags
    seen_by_attempt: dict[int, set[str]] = {}
    for b in requests_of(server, "act"):
        system = b["messages"][0]["content"]
        earlier = set(re.findall(r"ASSESS-(\d)", system))
        assert earlier == set(re.findall(r"REVISE-(\d)", system))
        seen_by_attempt.setdefault(len(earlier), earlier)
    assert seen_by_attempt == {0: set(), 1: {"1"}, 2: {"1", "2"}}
    # the earlier imagined trajectory itself is in the history (its imagined tool response too)
    last = requests_of(server, "act")[-1]["messages"][0]["content"]
    assert "## Rehearsal 1" in last and '"ok": true' in last
    # evaluations follow the attempts in order (attempt 2 is evaluated before attempt 3 acts)
    evals = [t for k, t in model.events if k == "evaluate"]
    assert evals == ["1", "2", "3"]
    assert rec.extra["tts"]["attempts"][1]["feedback"] == {"assessment": "ASSESS-2", "success": True,
                                                           "revision": "REVISE-2"}


def test_memory_reaches_the_committed_execution_and_costs_are_per_role(fake_openai, replies):
    rec, _, server, _ = run(fake_openai, replies, "parallel", n=2, seed=7)
    tts = rec.extra["tts"]
    assert tts["memory"] == MEMORY and tts["memory_error"] is None
    commits = requests_of(server, "commit")
    assert commits and all(b["messages"][0]["content"].endswith(tts["memory_text"]) for b in commits)
    for item in ("FACT-cd-works", "PITFALL-no-guessing", "PLAN-step-one"):
        assert item in tts["memory_text"]
    # per-role sampling: act / rehearse at 1.0 / 1.0, evaluation and summary at 0.01; distinct seeds per attempt
    for b in requests_of(server, "act") + commits:
        assert (b["temperature"], b["top_p"]) == (1.0, 1.0)
    for b in requests_of(server, "evaluate") + requests_of(server, "summarize"):
        assert b["temperature"] == 0.01
    assert {b["seed"] for b in requests_of(server, "act")} == {8, 9} and {b["seed"] for b in commits} == {7}
    cost = tts["cost"]
    assert list(cost) == ["act", "rehearse", "evaluate", "summarize", "commit"]
    assert cost["evaluate"]["calls"] == 2 and cost["summarize"]["calls"] == 1
    assert cost["commit"]["calls"] == len(commits) and cost["act"]["calls"] == len(requests_of(server, "act"))
    assert sum(r["calls"] for r in cost.values()) == server.n_requests
    assert cost["commit"]["prompt_tokens"] == 10 * len(commits) == rec.prompt_tokens
    table = format_cost_table(cost_summary([rec]))
    assert "rehearse" in table and "1 task(s), 2 rehearsal(s) (0 not assessed), 0 memory failure(s)" in table


def test_failed_evaluation_and_summary_are_masked_and_reported(fake_openai, replies):
    rec, model, server, _ = run(fake_openai, replies, "sequential", n=2, evaluate="no json here",
                                summarize='{"facts": [], "pitfalls": [], "plan": []}')
    tts = rec.extra["tts"]
    # each evaluation: first try + one repair round, then masked with the reason
    assert [k for k, _ in model.events].count("repair") == 2 + 1
    for a in tts["attempts"]:
        assert a["feedback"] is None and "JudgeFormatError" in a["evaluation_error"]
    # the summary is told that the attempts were not assessed; an empty plan fails validation → no memory
    summ, repair = requests_of(server, "summarize")  # the first try and its repair round
    assert repair["messages"][-1]["content"].startswith("Your previous reply could not be used: plan: List should")
    assert summ["messages"][0]["content"].count("(not assessed: the review failed") == 2
    assert tts["memory"] is None and "RehearsalMemory" in tts["memory_error"] and tts["memory_text"] == ""
    # the committed execution still runs without memory and is scored by the official checker
    assert all("# Rehearsal memory" not in json.dumps(b) for b in server.bodies if b.get("tools"))
    assert rec.reward == 1.0
    cost = cost_summary([rec])
    assert (cost["unassessed_attempts"], cost["memory_failures"]) == (2, 1)


@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_verbatim_memory_is_the_rehearsed_transcripts_and_nothing_reviews_them(fake_openai, replies, mode):
    """``memory: verbatim``: no self-evaluation and no summary is asked for; the committed execution's system prompt
    ends with the attempts' transcripts (their imagined tool responses included); sequential attempts see the
    earlier transcripts, without reviews; the record says which memory ran and how long it was."""
    rec, model, server, _ = run(fake_openai, replies, mode, n=2, memory="verbatim")
    assert not {"evaluate", "summarize", "repair"} & {k for k, _ in model.events}
    tts = rec.extra["tts"]
    assert (tts["memory_kind"], tts["memory"], tts["memory_error"]) == ("verbatim", None, None)
    text = tts["memory_text"]
    assert text.startswith("# Rehearsal memory") and tts["memory_chars"] == len(text) and tts["memory_cut_chars"] == 0
    gold = get_pool("bfcl_multi_turn").gold_actions(TASK)
    first_call = render_tool_call(gold[0][0])
    for i in (1, 2):
        block = text.split(f"## Rehearsal {i} (it ended:")[1]
        assert first_call in block and '"ok": true' in block  # the attempt's call and its imagined response
    assert "Review:" not in text and "ASSESS-" not in text
    commits = requests_of(server, "commit")
    assert commits and all(b["messages"][0]["content"].endswith(text) for b in commits)
    history = [b for b in requests_of(server, "act") if "# Earlier private rehearsals" in b["messages"][0]["content"]]
    if mode == "sequential":  # attempt 2 saw attempt 1's transcript, no review
        assert history and all("## Rehearsal 1 (it ended:" in b["messages"][0]["content"]
                               and "## Rehearsal 2" not in b["messages"][0]["content"]
                               and "Review:" not in b["messages"][0]["content"] for b in history)
    else:
        assert not history
    assert set(tts["cost"]) == {"act", "rehearse", "commit"}
    assert rec.reward == 1.0, rec.reason
    cost = cost_summary([rec])
    assert cost["memory_chars"] == len(text) and f"memory {len(text)} chars a task" in format_cost_table(cost)


def _attempt(index: int, sizes: list[int]) -> Attempt:
    """An attempt whose transcript (after a one-message opening) is assistant messages of these many characters."""
    msgs = [{"role": "user", "content": "the task"}]
    msgs += [{"role": "assistant", "content": chr(ord("a") + k % 26) * size} for k, size in enumerate(sizes)]
    return Attempt(index=index, transcript=Transcript(messages=msgs), opening=1)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.lists(st.integers(1, 3000), min_size=1, max_size=4), min_size=1, max_size=5),
       cap=st.integers(1, 9000), per_trajectory=st.integers(1, 6000))
def test_a_verbatim_memory_fits_its_cap_and_cuts_each_transcript_from_its_oldest_end(sizes, cap, per_trajectory):
    """Whatever the transcripts' lengths: the memory is at most ``max_memory_chars`` long unless its headers alone are
    longer (then every transcript is cut to nothing), each transcript keeps its end, and the characters reported cut
    are exactly those left out."""
    client = ChatClient(EndpointConfig(base_urls="http://127.0.0.1:9/v1", model="m"))
    config = TTSConfig(mode="parallel", rehearsals=len(sizes), memory="verbatim", max_memory_chars=cap,
                       max_trajectory_chars=per_trajectory)
    runner = RehearsalRunner(client, config, FAST)
    text, cut = runner.verbatim_text("verbatim_memory", [_attempt(i + 1, s) for i, s in enumerate(sizes)],
                                     total=len(sizes))
    body = text.split("as they happened:\n\n", 1)[1].rsplit("\n\nThis conversation is the real one", 1)[0]
    parts = [(block.split("\n", 1) + [""])[1] for block in body.split("\n\n")]
    assert len(parts) == len(sizes)
    assert len(text) <= cap or not any(parts)
    left_out = 0
    for part, s in zip(parts, sizes, strict=True):
        full = "\n".join(f"Assistant: {chr(ord('a') + k % 26) * n}" for k, n in enumerate(s))
        kept = part.removeprefix(OMITTED)
        assert full.endswith(kept) and len(part) <= per_trajectory
        left_out += len(full) - len(kept)
    assert cut == left_out


def test_cut_oldest_keeps_the_end_and_marks_the_cut():
    assert cut_oldest("abcdef", 10) == ("abcdef", 0)
    text, n = cut_oldest("x" * 100 + "END", 50)
    assert text.startswith(OMITTED) and text.endswith("END") and len(text) == 50 and n == 103 - (50 - len(OMITTED))
    assert cut_oldest("abcdef", 2) == ("ef", 4) and cut_oldest("abcdef", 0) == ("", 6)


def test_rehearsal_episode_refuses_environment_access():
    pool = get_pool("bfcl_multi_turn", categories=("multi_turn_base",))
    ep = RehearsalEpisode(pool.start(TASK).fork(), note="NOTE")
    assert ep.initial_messages()[0] == {"role": "system", "content": "NOTE"} or ep.initial_messages()[0][
        "content"].endswith("NOTE")
    with pytest.raises(RehearsalTouchedEnvironment):
        ep.execute(ToolCall("ls", {}))
    with pytest.raises(RehearsalTouchedEnvironment):
        ep.verify()


def test_config_is_typed_and_fails_loudly():
    """The typed config checks its values (naming the field; the CLI names the flag: tests/envace/test_loop_config.py)
    and its prompt files; the flags build it."""
    for bad, msg in [({"mode": "beam"}, "envace.tts.mode must be one of"), ({"rehearsals": 0}, ">= 1"),
                     ({"act_top_p": 0}, "envace.tts.act_top_p"), ({"prompt_version": "v9"}, "'v9' has no file")]:
        with pytest.raises(ValueError, match=re.escape(msg)):
            TTSConfig(**bad)
    for name in ("evaluate", "summarize", "attempt", "history", "memory", "transcript", "verbatim_history",
                 "verbatim_memory"):
        assert load_prompt(name).template.strip()
    args = build_parser().parse_args(["bfcl", "--base-url", "u", "--model", "m", "--tts", "parallel",
                                      "--rehearsals", "4", "--evaluate-temperature", "0.2"])
    assert tts_from_args(args) == TTSConfig(mode="parallel", rehearsals=4, evaluate_temperature=0.2)


def test_runs_record_the_memory_settings_only_with_verbatim_memory(tmp_path):
    """``run.json`` has recorded every rehearsal setting since test-time rehearsal existed; the memory variant came
    later, so it is recorded only when it is not the paper's summary: a run recorded before it resumes, and a verbatim
    run never resumes into a summary run's directory."""
    from envace.eval.args import run_identity
    from envace.eval.benchmarks import BENCHMARKS

    def options(*flags: str) -> dict[str, str]:
        args = build_parser().parse_args(["bfcl", "--base-url", "u", "--model", "m", "--tts", "parallel", *flags])
        return run_identity(args, BENCHMARKS["bfcl"], "m")["runner_options"]

    fields = {f.name for f in dataclasses.fields(TTSConfig)}
    assert set(options()) == fields - {"memory", "max_memory_chars"}
    assert set(options("--tts-max-memory-chars", "99")) == set(options())  # no effect with the summary memory
    verbatim = options("--tts-memory", "verbatim", "--tts-max-memory-chars", "99")
    assert set(verbatim) == fields and (verbatim["memory"], verbatim["max_memory_chars"]) == ('"verbatim"', "99")


def test_the_tts_runner_takes_its_settings_typed_not_as_runner_options():
    """``--tts`` reaches the runner as the typed config (RunContext.tts); ``--runner tts`` without it, or with
    ``--runner-arg`` strings, is refused with one line."""
    from envace.eval.runner import RunContext, build_runner

    agent = ChatClient(EndpointConfig(base_urls=["http://agent:8000/v1"], model="agent"))
    ctx: dict[str, Any] = {"client": agent, "limits": LoopLimits(), "start_kwargs": {}, "keep_transcript": False}
    runner = build_runner("tts", RunContext(**ctx, options={}, tts=TTSConfig(mode="sequential", rehearsals=3)))
    assert runner.config == TTSConfig(mode="sequential", rehearsals=3)
    with pytest.raises(ValueError, match="needs --tts parallel or --tts sequential"):
        build_runner("tts", RunContext(**ctx, options={}))
    with pytest.raises(ValueError, match="takes no --runner-arg options"):
        build_runner("tts", RunContext(**ctx, options={"mode": "parallel"}, tts=TTSConfig(mode="parallel")))


def test_cli_tts_run_resumes_and_reports_cost(fake_openai, replies, tmp_path, capsys):
    gold = get_pool("bfcl_multi_turn", categories=("multi_turn_base",)).gold_actions(TASK)
    server = fake_openai(Model(replies, gold))
    out = tmp_path / "run"
    argv = ["bfcl", "--base-url", server.base_url, "--model", "m", "--categories", "base", "--limit", "1",
            *FAST_ARGS, "--out", str(out), "--tts", "sequential",
            "--rehearsals", "2", "--rehearsal-api-key", "secret"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "test-time rehearsal cost per role" in printed and "summarize" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["summary"]["categories"]["base"]["score"] == 100.0
    assert summary["identity"]["runner"] == "tts" and summary["identity"]["runner_options"]["mode"] == '"sequential"'
    assert "secret" not in (out / "run.json").read_text()
    # the prompt files' versions: in the run's header (run.json, summary.json) and in each record
    versions = {"rehearsal": "v1", "tts": "v1"}
    assert json.loads((out / "run.json").read_text())["prompts"] == summary["identity"]["prompts"] == versions
    (rec,) = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert rec["extra"]["tts"]["prompts"] == versions
    assert summary["tts_cost"]["tasks"] == 1 and summary["tts_cost"]["roles"]["evaluate"]["calls"] == 2
    assert (out / "cost.md").read_text().startswith("| role |")
    n = server.n_requests
    assert main(argv) == 0 and server.n_requests == n  # resumed: nothing rerun
    with pytest.raises(SystemExit):
        main([*argv, "--runner", "x"])
    # a run.json written before prompt versions were recorded (v1 was the only one) resumes
    run = json.loads((out / "run.json").read_text())
    del run["prompts"]
    (out / "run.json").write_text(json.dumps(run))
    assert main(argv) == 0 and server.n_requests == n
    capsys.readouterr()
    # one recorded with other versions is refused, in one line naming them
    (out / "run.json").write_text(json.dumps({**run, "prompts": {"rehearsal": "v0", "tts": "v1"}}))
    assert main(argv) == 2 and server.n_requests == n
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prompts: {'rehearsal': 'v0', 'tts': 'v1'} -> {'rehearsal': 'v1', 'tts': 'v1'}" in err[0]


def test_budget_sweep_writes_runs_table_and_plot(fake_openai, replies, tmp_path, capsys):
    gold = get_pool("bfcl_multi_turn", categories=("multi_turn_base",)).gold_actions(TASK)
    server = fake_openai(Model(replies, gold))
    out = tmp_path / "sweep"
    argv = ["sweep", "bfcl", "--out", str(out), "--modes", "parallel", "--budgets", "1", "2", "--baseline", "--",
            "--base-url", server.base_url, "--model", "m", "--categories", "base", "--limit", "1", *FAST_ARGS]
    assert main(argv) == 0
    result = json.loads((out / "sweep.json").read_text())
    assert [(p["mode"], p["rehearsals"], p["average"]) for p in result["points"]] == [
        ("none", 0, 100.0), ("parallel", 1, 100.0), ("parallel", 2, 100.0)]
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert result["points"][2]["cost"]["calls"] > result["points"][1]["cost"]["calls"]  # N=2 costs more than N=1
    md = (out / "sweep.md").read_text()
    assert "| Non-TTS |" in md and "| Par. (rehearsal: policy, N=1) |" in md and "Multi-Turn" in md
    capsys.readouterr()
    assert main(["tts-table", str(out / "non-tts"), str(out / "parallel-n2")]) == 0
    rows = [ln.split()[0] for ln in capsys.readouterr().out.splitlines()[3:]]
    assert rows == ["Non-TTS", "Par."]


def test_a_separate_rehearsal_endpoint_gets_its_own_client_on_the_agents_other_settings():
    """--rehearsal-base-url / --rehearsal-model: the rehearsals go to that server and model, with the agent
    endpoint's other settings (timeout, retries)."""
    from envace.eval.runner import RunContext, build_runner

    agent = ChatClient(EndpointConfig(base_urls=["http://agent:8000/v1"], model="agent", timeout_s=7.0))
    tts = TTSConfig(mode="parallel", rehearsals=2, rehearsal_base_url="http://rehearse:8001/v1",
                    rehearsal_model="rehearser")
    runner = build_runner("tts", RunContext(client=agent, limits=LoopLimits(), start_kwargs={},
                                            keep_transcript=False, options={}, tts=tts))
    cfg = runner.rehearsal_client.config
    assert (cfg.base_urls, cfg.model, cfg.timeout_s) == (["http://rehearse:8001/v1"], "rehearser", 7.0)
    assert runner.client is agent
