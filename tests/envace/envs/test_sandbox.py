"""Hard bounds on environment code (envace/envs/sandbox.py) and their use by the real observation source."""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import pytest

from envace.agents.engine import LoopLimits, TurnEngine
from envace.agents.sources import RealSource
from envace.envs.base import Episode, TaskSpec, ToolCall, Verdict
from envace.envs.sandbox import AVAILABLE, BoundExceeded, Bounds, run_bounded
from envace.toolcall import render_tool_call

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="hard bounds need os.fork")


def test_a_function_that_finishes_reports_how_it_ended():
    assert run_bounded(lambda: 2**10, Bounds(timeout_s=5, memory_mb=64)) == "ok"
    assert run_bounded(lambda: 1 / 0, Bounds(timeout_s=5, memory_mb=64)) == "raised"


def test_compute_past_the_deadline_is_stopped_at_the_deadline():
    started = time.monotonic()
    with pytest.raises(BoundExceeded, match="time limit"):
        run_bounded(lambda: 10 ** (10**8), Bounds(timeout_s=0.5, memory_mb=0))  # minutes of GIL-holding C
    assert time.monotonic() - started < 5


def test_a_call_that_blocks_without_computing_is_stopped_at_the_wall_clock_deadline():
    from envace.envs.sandbox import WALL_CLOCK_FACTOR

    started = time.monotonic()
    with pytest.raises(BoundExceeded, match="time limit"):
        run_bounded(lambda: time.sleep(60), Bounds(timeout_s=0.5, memory_mb=0))
    assert time.monotonic() - started < 0.5 * WALL_CLOCK_FACTOR + 3


@pytest.mark.parametrize("catch", [False, True])
def test_allocating_past_the_memory_bound_is_a_bound_hit_even_when_caught(catch):
    def grab():
        try:
            return bytearray(512 * 2**20)
        except MemoryError:
            if not catch:
                raise
            return "Error during execution: "  # how BFCL formats it: the bound must still be seen

    with pytest.raises(BoundExceeded, match="memory limit"):
        run_bounded(grab, Bounds(timeout_s=10, memory_mb=64))


def test_the_child_changes_nothing_in_the_caller():
    state = {"n": 0}

    def bump():
        state["n"] += 1

    run_bounded(bump, Bounds(timeout_s=5, memory_mb=64))
    assert state == {"n": 0}


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


class HeavyEpisode(Episode):
    """``f(n)`` computes 10**n and appends n to the state; ``grab(mb)`` allocates."""

    def __init__(self) -> None:
        self.spec = TaskSpec(pool="t", task_id="t", env_id="t", category="c", split="test", system_prompt=None,
                             first_user_message="go", tools=TOOLS)
        self.state: list[int] = []

    def tools(self):
        return TOOLS

    def execute(self, call: ToolCall) -> str:
        if call.name == "grab":
            return str(len(bytearray(int(call.arguments["mb"]) * 2**20)))
        self.state.append(int(call.arguments["n"]))
        return str(len(str(10 ** int(call.arguments["n"]))))

    def end_turn(self, assistant_text):
        return None

    def verify(self):
        return Verdict(reward=float(self.state == [3]), passed=self.state == [3])

    def fork(self):
        raise NotImplementedError


class Script:
    def __init__(self, texts):
        self.texts = list(texts)

    async def respond(self, messages, tools, role):
        from envace.agents.engine import Reply
        from envace.toolcall import parse_tool_calls

        text = self.texts.pop(0) if self.texts else "Done."
        p = parse_tool_calls(text)
        return Reply(text=text, content=p.content, calls=p.calls, errors=p.errors)


def test_real_source_stops_heavy_calls_without_stalling_the_event_loop():
    """Old behaviour: RealSource waited on a thread; a GIL-holding computation blocked the event loop (every
    other rollout) until it ended, and its time-out fired only afterwards."""
    ep = HeavyEpisode()
    script = Script([
        "\n".join([render_tool_call({"name": "f", "arguments": {"n": 10**8}}),
                   render_tool_call({"name": "grab", "arguments": {"mb": 4096}}),
                   render_tool_call({"name": "f", "arguments": {"n": 3}})]),
        "Done.",
    ])
    ticks: list[float] = []

    async def main():
        async def heartbeat():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.05)

        beat = asyncio.create_task(heartbeat())
        limits = LoopLimits(tool_timeout_s=1.0, tool_memory_mb=256)
        t = await TurnEngine(limits).run(ep, script, RealSource(timeout_s=60))
        beat.cancel()
        return t

    started = time.monotonic()
    t = asyncio.run(main())
    assert time.monotonic() - started < 10
    assert max(b - a for a, b in itertools.pairwise(ticks)) < 1.0  # the loop kept running
    tool = [m["content"] for m in t.messages if m["role"] == "tool"]
    assert "exceeded the time limit (1s)" in tool[0] and "exceeded the memory limit (256 MiB)" in tool[1]
    assert tool[2] == "4"
    assert ep.state == [3]  # the stopped calls had no effect
    assert t.bound_hits == 2 and t.tool_calls == 3 and [a["name"] for a in t.actions] == ["f"]
    assert json.loads(json.dumps(t.actions))[0]["arguments"] == {"n": 3}
