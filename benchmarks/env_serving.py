#!/usr/bin/env python
"""Episodes per second of an environment in process vs served over OpenEnv (issue 45, deliverable 5).

    .venv/bin/python benchmarks/env_serving.py                                   # the full grid
    .venv/bin/python benchmarks/env_serving.py --replicas 1 2 4 --delay-ms 0 50 200 --episodes 512 \\
        --concurrency 64 --out env_serving.json
    .venv/bin/python benchmarks/env_serving.py --smoke                           # 1 replica, 0 ms, 8 episodes

The workload is the ``synthetic`` pool's test split (the first ``--episodes`` tasks). An episode plays the task's
gold calls, ends each user turn with the turn's observations joined (as ``SyntheticPool.replay`` does) and runs the
verifier; every fourth episode drops its last call, so that some verdicts fail. ``--concurrency`` episodes are in
flight at once on one event loop, each driven as the agent loop drives a remote episode (``await pool.astart``,
``await episode.aexecute`` per call, ``asyncio.to_thread(episode.end_turn)`` as ``TurnEngine`` does,
``await episode.averify()``, ``await episode.aclose()``), so the figures show whether the loop overlaps the calls.

Two ways of running the same episodes:

* ``in-process``: the pool in this process. The injected per-call latency is an ``await asyncio.sleep(delay)`` on
  the event loop before the call, and the call itself then runs inline: the ideal (the agent loop proper would run
  an in-process call in a worker thread after a forked dry run).
* ``served``: ``python -m envace.envs serve --pool synthetic --protocol openenv`` started ``max(--replicas)`` times
  (each on a free port), consumed through the ``openenv`` pool with ``urls:`` the first R of them (episodes go to
  the replica with the fewest in flight). The serve CLI has no latency option, so the latency is injected on the
  client: the same ``asyncio.sleep(delay)`` before the remote ``aexecute``. It therefore costs the servers nothing
  (a slow tool inside the server would also hold one of its worker threads).

Each served replica count first runs one untimed batch of ``--concurrency`` episodes (connections, first
sessions). Every episode's verdict (reward, passed) is compared with the in-process ``pool.replay`` of the same
actions: the ``agree`` column. ``ideal/s`` is the latency bound: episodes of ``calls x delay`` each, scheduled on
``--concurrency`` slots in order (:func:`ideal_wall`). CPU ms per episode: this process (``time.process_time``:
the event loop, the remote-I/O loop and the worker threads) and the replicas together (``/proc/PID/stat``);
``CPUs busy`` is both together per wall second: on a shared machine, how much CPU the row actually got.
Memory: each replica's resident set (VmRSS) after start and its peak (VmHWM) after the runs. Prints markdown
tables; ``--out`` writes them as JSON with every episode's verdict. Exits 1 when a verdict disagrees.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from envace.envs.base import EnvironmentPool, Episode, ToolCall, Verdict, get_pool

POOL = "synthetic"
#: every PERTURB_EVERY-th episode drops its last call (a failing verdict, so that agreement means something)
PERTURB_EVERY = 4


# -- episodes -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One episode of the workload: a task and the turns of calls it plays."""

    task_id: str
    variant: str  # "gold" | "dropped" (the last call left out)
    turns: list[list[ToolCall]]

    @property
    def calls(self) -> int:
        return sum(len(t) for t in self.turns)


def jobs_for(pool: EnvironmentPool, n: int) -> list[Job]:
    """The first ``n`` test tasks of ``pool`` (cycled when there are fewer), every PERTURB_EVERY-th one perturbed."""
    ids = pool.task_ids("test")
    out = []
    for i in range(n):
        tid = ids[i % len(ids)]
        turns = [list(t) for t in pool.gold_actions(tid)]
        if i % PERTURB_EVERY == PERTURB_EVERY - 1 and any(turns):
            last = max(t for t, turn in enumerate(turns) if turn)
            turns[last] = turns[last][:-1]
            out.append(Job(tid, "dropped", turns))
        else:
            out.append(Job(tid, "gold", turns))
    return out


class Delayed:
    """An episode whose every call first waits ``delay_s`` on the event loop (the injected latency). ``inline``: the
    call then runs in this thread (an in-process episode: the ideal); otherwise the episode's own ``aexecute``."""

    def __init__(self, inner: Episode, delay_s: float, inline: bool) -> None:
        self.inner, self.delay_s, self.inline = inner, delay_s, inline

    async def aexecute(self, call: ToolCall) -> str:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return self.inner.execute(call) if self.inline else await self.inner.aexecute(call)

    def end_turn(self, text: str) -> str | None:
        return self.inner.end_turn(text)

    async def averify(self) -> Verdict:
        return await self.inner.averify()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def play(pool: EnvironmentPool, job: Job, delay_s: float, inline: bool) -> Verdict:
    """One episode, driven as the agent loop drives it (see the module docstring)."""
    ep = Delayed(await pool.astart(job.task_id), delay_s, inline)
    try:
        for turn in job.turns:
            observations = [await ep.aexecute(call) for call in turn]
            if await asyncio.to_thread(ep.end_turn, "\n".join(observations)) is None:
                break
        return await ep.averify()
    finally:
        await ep.aclose()


async def run_all(pool: EnvironmentPool, jobs: Sequence[Job], delay_s: float, inline: bool, concurrency: int
                  ) -> tuple[float, list[Verdict]]:
    """Every job, ``concurrency`` at a time on this event loop; (wall seconds, verdicts in job order)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(job: Job) -> Verdict:
        async with gate:
            return await play(pool, job, delay_s, inline)

    t0 = time.perf_counter()
    verdicts = await asyncio.gather(*(one(j) for j in jobs))
    return time.perf_counter() - t0, list(verdicts)


# -- served replicas ------------------------------------------------------------------------------------------------


class Replica:
    """``python -m envace.envs serve --pool synthetic --protocol openenv --port 0``: ``url`` from its ready line."""

    def __init__(self) -> None:
        cmd = [sys.executable, "-m", "envace.envs", "serve", "--pool", POOL, "--protocol", "openenv", "--port", "0"]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.url = ""
        self.start_rss_mb = 0.0

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        match = re.search(r"(http://\S+)", line)
        if match is None:
            self.stop()
            raise RuntimeError(f"serve printed no URL: {line!r}; stderr: {self.proc.stderr.read()[-2000:]}")
        self.url = match.group(1)
        self.start_rss_mb = self.memory()["rss_mb"]

    def cpu_s(self) -> float:
        """User + system CPU seconds of the server process so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def memory(self) -> dict[str, float]:
        """VmRSS and VmHWM (peak) of the server process, MB."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        kb = {k: int(v) for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", status, re.MULTILINE)}
        return {"rss_mb": kb["VmRSS"] / 1024, "peak_mb": kb["VmHWM"] / 1024}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()


def start_replicas(n: int) -> list[Replica]:
    """``n`` servers, started together (each takes seconds to import openenv and build the pool)."""
    replicas = [Replica() for _ in range(n)]
    try:
        for r in replicas:
            r.wait_ready()
    except BaseException:
        for r in replicas:
            r.stop()
        raise
    return replicas


# -- the grid -------------------------------------------------------------------------------------------------------


@dataclass
class Cell:
    mode: str  # "in-process" | "served"
    replicas: int  # 0 for in-process
    delay_ms: float
    episodes: int
    concurrency: int
    calls: int
    wall_s: float
    agree: int
    passed: int
    ideal_wall_s: float  # the latency-only bound (ideal_wall)
    client_cpu_s: float  # this process (event loop, I/O loop and worker threads)
    server_cpu_s: float  # the replicas together
    verdicts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.wall_s

    @property
    def ideal_per_s(self) -> float | None:
        return self.episodes / self.ideal_wall_s if self.ideal_wall_s else None


def ideal_wall(jobs: Sequence[Job], delay_s: float, concurrency: int) -> float:
    """The wall time if calls cost nothing but the latency: each job takes ``calls x delay`` and starts when one of
    ``concurrency`` slots frees up, in job order (the semaphore's order)."""
    slots = [0.0] * min(concurrency, len(jobs))
    for job in jobs:
        heapq.heappush(slots, heapq.heappop(slots) + job.calls * delay_s)
    return max(slots)


def measure(mode: str, replicas: int, pool: EnvironmentPool, jobs: Sequence[Job], expected: Sequence[Verdict],
            delay_ms: float, concurrency: int, servers: Sequence[Replica] = ()) -> Cell:
    cpu0, server0 = time.process_time(), sum(s.cpu_s() for s in servers)
    wall, verdicts = asyncio.run(run_all(pool, jobs, delay_ms / 1000, mode == "in-process", concurrency))
    cpu, server_cpu = time.process_time() - cpu0, sum(s.cpu_s() for s in servers) - server0
    agree = sum(got.reward == want.reward and got.passed == want.passed
                for got, want in zip(verdicts, expected, strict=True))
    cell = Cell(mode, replicas, delay_ms, len(jobs), concurrency, sum(j.calls for j in jobs), wall, agree,
                sum(v.passed for v in verdicts), ideal_wall(jobs, delay_ms / 1000, concurrency), cpu, server_cpu,
                [{"task_id": j.task_id, "variant": j.variant, "reward": v.reward, "passed": v.passed}
                 for j, v in zip(jobs, verdicts, strict=True)])
    print(f"  {mode:<10} replicas={replicas} delay={delay_ms:g} ms: {cell.episodes_per_s:.1f} episodes/s "
          f"({wall:.2f} s), {agree}/{len(jobs)} verdicts agree", file=sys.stderr, flush=True)
    return cell


def run_grid(replica_counts: Sequence[int], delays_ms: Sequence[float], episodes: int, concurrency: int
             ) -> dict[str, Any]:
    local = get_pool(POOL)
    jobs = jobs_for(local, episodes)
    expected = [local.replay(j.task_id, j.turns) for j in jobs]
    load0 = os.getloadavg()
    cells = [measure("in-process", 0, local, jobs, expected, d, concurrency) for d in delays_ms]
    servers = start_replicas(max(replica_counts))
    try:
        for n in replica_counts:
            remote = get_pool("openenv", urls=[s.url for s in servers[:n]])
            try:
                asyncio.run(run_all(remote, jobs[:concurrency], 0.0, False, concurrency))  # warm-up, untimed
                cells += [measure("served", n, remote, jobs, expected, d, concurrency, servers) for d in delays_ms]
            finally:
                remote.close()
        memory = [{"replica": i + 1, "start_rss_mb": s.start_rss_mb, **s.memory()} for i, s in enumerate(servers)]
    finally:
        for s in servers:
            s.stop()
    return {"pool": POOL, "episodes": episodes, "concurrency": concurrency, "cpus": os.cpu_count(),
            "loadavg_start": load0, "loadavg_end": os.getloadavg(), "cells": cells, "memory": memory}


# -- output ---------------------------------------------------------------------------------------------------------


def throughput_table(result: dict[str, Any]) -> str:
    cells: list[Cell] = result["cells"]
    base = {c.delay_ms: c.episodes_per_s for c in cells if c.mode == "in-process"}
    rows = [("| mode | replicas | delay ms | episodes/s | calls/s | vs in-process | ideal/s | wall s "
             "| CPU ms/episode: client | servers | CPUs busy | agree |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        ideal = f"{c.ideal_per_s:.1f}" if c.ideal_per_s else "-"
        server = f"{1000 * c.server_cpu_s / c.episodes:.1f}" if c.mode == "served" else "-"
        rows.append(f"| {c.mode} | {c.replicas or '-'} | {c.delay_ms:g} | {c.episodes_per_s:.1f} | "
                    f"{c.calls / c.wall_s:.1f} | {c.episodes_per_s / base[c.delay_ms]:.2f} | {ideal} | "
                    f"{c.wall_s:.2f} | {1000 * c.client_cpu_s / c.episodes:.1f} | {server} | "
                    f"{(c.client_cpu_s + c.server_cpu_s) / c.wall_s:.2f} | {c.agree}/{c.episodes} |")
    return "\n".join(rows)


def memory_table(result: dict[str, Any]) -> str:
    rows = ["| replica | RSS after start MB | RSS after the runs MB | peak RSS MB |", "|---|---|---|---|"]
    rows += [f"| {m['replica']} | {m['start_rss_mb']:.0f} | {m['rss_mb']:.0f} | {m['peak_mb']:.0f} |"
             for m in result["memory"]]
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--delay-ms", type=float, nargs="+", default=[0, 50, 200])
    parser.add_argument("--episodes", type=int, default=512, help="episodes per row (default 512)")
    parser.add_argument("--concurrency", type=int, default=64, help="episodes in flight at once (default 64)")
    parser.add_argument("--smoke", action="store_true", help="1 replica, 0 ms, 8 episodes, 4 in flight")
    parser.add_argument("--out", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.smoke:
        args.replicas, args.delay_ms, args.episodes, args.concurrency = [1], [0.0], 8, 4
    if min(args.replicas) < 1 or args.episodes < 1 or args.concurrency < 1 or min(args.delay_ms) < 0:
        parser.error("--replicas, --episodes and --concurrency must be positive, --delay-ms not negative")
    result = run_grid(sorted(set(args.replicas)), list(dict.fromkeys(args.delay_ms)), args.episodes,
                      args.concurrency)
    cells: list[Cell] = result["cells"]
    print(f"pool {POOL}, {args.episodes} episodes per row ({cells[0].calls} calls), {args.concurrency} in flight; "
          f"{result['cpus']} CPUs, load average {result['loadavg_start'][0]:.1f} at start, "
          f"{result['loadavg_end'][0]:.1f} at end\n")
    print(throughput_table(result) + "\n")
    print(memory_table(result))
    if args.out:
        data = {**result, "cells": [{**asdict(c), "episodes_per_s": c.episodes_per_s, "ideal_per_s": c.ideal_per_s}
                                    for c in cells]}
        Path(args.out).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return 0 if all(c.agree == c.episodes for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
