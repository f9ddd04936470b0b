"""Agent-loop overhead: envace's act–rehearse loop vs verl's own ``tool_agent`` loop, per generated token.

    .venv/bin/python benchmarks/act_rehearse_loop.py                   # free decoding, 8 tasks
    .venv/bin/python benchmarks/act_rehearse_loop.py --scripted-calls  # forced tool rounds, 8 tasks
    .venv/bin/python benchmarks/act_rehearse_loop.py --model DIR --tasks 16

Three loops roll out the same tasks (the ``synthetic`` pool's test split) on the same model, through the
same in-process generation server, with the same sampling (temperature 1.0), token budget and turn caps:

* ``tool_agent``        verl's :class:`ToolAgentLoop`; tools are a ``BaseTool`` adapter that executes each
                        call in a synthetic-pool episode, registered through a tool-config yaml (the path
                        ``actor_rollout_ref.rollout.multi_turn.tool_config_path`` would name);
* ``envace[real]``      :class:`EnvaceAgentLoop` with ``observation_source="real"``: the same work as
                        ``tool_agent`` (the environment answers every call), plus envace's verifier at the end;
* ``envace[rehearse]``  :class:`EnvaceAgentLoop` with ``observation_source="rehearse"``: the policy writes
                        every tool response itself (one extra ``generate`` per call, counted as generated
                        tokens) while the real environment runs the call in the shadow.

The server (:class:`LocalServer`, one class for all loops) decodes for real with
``envace.platform.rollout.sample_tokens`` (float32, eager attention, KV cache) in ``asyncio.to_thread``;
each ``generate`` draws from a generator seeded by (seed, task, call index within the rollout), so the
loops' first generation on a task is the same sequence when their prompts agree.

Modes
    default           free decoding. A random tiny model almost never emits ``<tool_call>`` or EOS: each
                      rollout is typically ONE generate call that spends the whole ``--response-length``
                      budget, so this measures per-rollout overhead (prompt building, tokenisation, episode
                      start, scoring) amortised over a long generation; ``rehearse`` behaves as ``real``.
    --scripted-calls  the first ``--scripted-n`` acting generations of each rollout (default: max turns - 1)
                      are forced to the task's gold tool calls (cycled): the server decodes exactly as many
                      tokens as the call text has (EOS ignored, so the decode time charged is that of the
                      returned length) and returns the call's token ids + ``<|im_end|>``. Every loop then does
                      multi-turn tool rounds (tool execution, context merge, re-tokenisation; for
                      ``rehearse`` a rehearsal generation per call, free decoding) and a final free turn.
                      This measures per-turn overhead. With a random model rehearsals are malformed; the
                      benchmark sets ``on_malformed_rehearsal=feedback`` so the rollout goes on (the error
                      observation is fed back) instead of ending at the first call.
    --model DIR       any Qwen3-family checkpoint dir (e.g. a warm-started model) in place of the tiny one;
                      with a trained model the default mode already contains real tool rounds.

Figures: wall = the whole rollout (loop construction + ``run``), summed over the measured tasks, run one at a
time (tasks interleaved across loops, so background load hits all loops alike) after one warm-up rollout per
loop on a task outside the measured set; generated tokens = all token ids ``generate`` returned (acting and
rehearsal); generate share = time inside the server's ``generate`` / wall (the rest is the loop's own
overhead). ``max_tokens``: envace passes what is left of the budget; ``tool_agent`` passes none, so the server
uses vLLM's default (``min(response_length, prompt_length + response_length - len(prompt))``, as verl's vLLM
server and hfcpu do) and a late turn may decode past the budget (verl truncates the output afterwards): those
tokens count as generated, as they cost decode time. Target (issue): envace's loop within 1.3x of ``tool_agent`` per generated token. Prints tables;
always exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, ClassVar
from uuid import uuid4

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse
from verl.tools.tool_registry import load_all_tools
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

from envace.agents.verl_loop import EnvaceAgentLoop, shared_pool
from envace.envs.base import Episode, ToolCall
from envace.platform.rollout import SamplingSpec, sample_tokens
from envace.toolcall import render_tool_call

POOL = "synthetic"
REHEARSAL_MARK = "You are the environment behind a set of tools"
#: the module name the verl tool registry imports the tool adapter from (this file, whatever runs it)
TOOL_MODULE = "envace_bench_act_rehearse_loop"
sys.modules.setdefault(TOOL_MODULE, sys.modules[__name__])


# -- the generation backend (one class for every loop) ----------------------------------------------------
class LocalServer:
    """In-process stand-in for a rollout server: ``generate`` decodes with the real model, token in / out."""

    def __init__(
        self,
        model,
        tokenizer,
        eos_ids: set[int],
        response_length: int,
        prompt_length: int,
        seed: int,
        scripted_n: int = 0,
    ) -> None:
        self.model, self.tokenizer, self.eos_ids = model, tokenizer, eos_ids
        self.response_length, self.prompt_length = response_length, prompt_length
        self.seed, self.scripted_n = seed, scripted_n
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.begin(0, [])

    def begin(self, task_index: int, script: list[str]) -> None:
        """Start one rollout (rollouts run one at a time): reset the counters, set the task's scripted calls."""
        self.task_index, self.script = task_index, list(script)
        self.calls = self.tokens = self.act_calls = self.rehearse_calls = 0
        self.gen_s = 0.0
        self.first_prompt_len: int | None = None
        self.first_prompt_hash: int | None = None

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any
    ) -> TokenOutput:
        t0 = time.perf_counter()
        out = await asyncio.to_thread(self._generate_sync, list(prompt_ids), dict(sampling_params))
        self.gen_s += time.perf_counter() - t0
        self.calls += 1
        self.tokens += len(out.token_ids)
        return out

    def _generate_sync(self, prompt_ids: list[int], params: dict[str, Any]) -> TokenOutput:
        if self.first_prompt_len is None:
            self.first_prompt_len, self.first_prompt_hash = len(prompt_ids), hash(tuple(prompt_ids))
        room = self.prompt_length + self.response_length - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room to generate")
        spec = SamplingSpec(params, min(self.response_length, room))  # hfcpu's default max_tokens
        spec.max_tokens = max(1, min(spec.max_tokens, room))
        gen = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + self.task_index * 10_007 + self.calls) & 0x7FFFFFFF
        )
        forced: list[int] | None = None
        if self.scripted_n:
            rehearse = REHEARSAL_MARK in self.tokenizer.decode(prompt_ids[:64])
            if rehearse:
                self.rehearse_calls += 1
            else:
                if self.act_calls < self.scripted_n and self.script:
                    text = self.script[self.act_calls % len(self.script)]
                    forced = (self.tokenizer.encode(text, add_special_tokens=False) + [self.im_end])[: spec.max_tokens]
                    # decode exactly as many tokens as are returned: the time charged is a real decode's
                    spec.max_tokens, spec.ignore_eos, spec.stop_token_ids = len(forced), True, []
                self.act_calls += 1
        ids, lps, finish = sample_tokens(self.model, prompt_ids, spec, self.eos_ids, gen)
        if forced is not None:
            ids, finish = forced, "stop"
        return TokenOutput(
            token_ids=ids,
            log_probs=lps if spec.logprobs else None,
            stop_reason="completed",
            extra_fields={"finish_reason": finish},
        )


# -- verl tools over a synthetic-pool episode ---------------------------------------------------------------
class SyntheticPoolTool(BaseTool):
    """One tool of a synthetic environment; all tools of one rollout share one episode (keyed by the
    rollout's request id), started on the first call from ``tools_kwargs[name].create_kwargs.task_id``."""

    episodes: ClassVar[dict[str, Episode]] = {}
    executed: ClassVar[int] = 0

    def __init__(self, config: dict, tool_schema) -> None:
        super().__init__(config, tool_schema)
        self.pool_name = str(config.get("pool", POOL))
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        iid = instance_id or uuid4().hex
        self._instances[iid] = dict(kwargs.get("create_kwargs") or {})
        return iid, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        key = kwargs["agent_data"].request_id
        episode = SyntheticPoolTool.episodes.get(key)
        if episode is None:
            task_id = self._instances[instance_id]["task_id"]
            episode = await asyncio.to_thread(shared_pool(self.pool_name).start, task_id)
            SyntheticPoolTool.episodes[key] = episode
        text = await asyncio.to_thread(episode.execute, ToolCall(name=self.name, arguments=dict(parameters)))
        SyntheticPoolTool.executed += 1
        return ToolResponse(text=str(text)), 0.0, {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)


def load_env_tools(env_tools: list[dict[str, Any]], tmp: Path, env_id: str) -> list[BaseTool]:
    """Write the environment's tool-config yaml (verl's format) and load it with verl's registry."""
    cfg = {
        "tools": [
            {
                "class_name": f"{TOOL_MODULE}.SyntheticPoolTool",
                "config": {"type": "native", "pool": POOL},
                "tool_schema": schema,
            }
            for schema in env_tools
        ]
    }
    path = tmp / f"tools_{env_id}.yaml"
    OmegaConf.save(OmegaConf.create(cfg), path)
    with contextlib.redirect_stdout(io.StringIO()):  # BaseTool.__init__ prints every schema
        return load_all_tools(tool_config_path=str(path), function_tool_path=None)


# -- the benchmark ------------------------------------------------------------------------------------------
def trainer_config(args) -> Any:
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "response_length": args.response_length,
                    "prompt_length": args.prompt_length,
                    "full_determinism": False,
                    "multi_turn": {
                        "enable": True,
                        "format": "hermes",
                        "max_assistant_turns": args.max_turns,
                        "max_user_turns": args.max_turns,
                        "max_parallel_calls": args.max_calls,
                        "max_tool_response_length": 8000,
                        "tool_response_truncate_side": "middle",
                        "tool_config_path": None,
                    },
                    "agent": {},
                }
            },
            "envace": {
                "agent": {
                    "act_layout": "message",
                    "rehearse_max_tokens": args.rehearse_max_tokens,
                    "limits": {
                        "max_user_turns": 1,
                        "max_steps_per_turn": args.max_turns,
                        "max_calls_per_message": args.max_calls,
                        "max_observation_chars": 8000,
                        "on_malformed_call": "feedback",
                        "on_malformed_rehearsal": "feedback",
                    },
                }
            },
        }
    )


class Stats:
    def __init__(self) -> None:
        self.tasks = self.calls = self.tokens = self.tool_calls = self.rehearsals = 0
        self.wall = self.gen = 0.0
        self.stops: dict[str, int] = defaultdict(int)
        self.first_prompt: list[int] = []


async def rollout(name: str, task_index: int, task_id: str, ctx: dict[str, Any]) -> dict[str, Any]:
    """One timed rollout of ``task_id`` with loop ``name``; returns its figures."""
    server: LocalServer = ctx["server"]
    pool = shared_pool(POOL)
    spec = pool.task(task_id)
    script = [render_tool_call(c) for turn in pool.gold_actions(task_id) for c in turn]
    common = {
        "trainer_config": DictConfigWrap(ctx["cfg"]),
        "server_manager": server,
        "tokenizer": ctx["tokenizer"],
        "processor": None,
        "dataset_cls": RLHFDataset,
        "data_config": DictConfigWrap(ctx["data_cfg"]),
        "hf_model_type": ctx["model_type"],
    }
    sampling = {"temperature": 1.0, "logprobs": True}
    row = {"extra_info": {"pool": POOL, "task_id": task_id}, "uid": f"u{task_index}", "session_id": 0}
    server.begin(task_index, script)
    executed0 = SyntheticPoolTool.executed
    t0 = time.perf_counter()
    if name == "tool_agent":
        tools = ctx["env_tools"][spec.env_id]
        loop = ToolAgentLoop(**common, tools=ToolListWrap(tools))
        out = await loop.run(
            sampling,
            raw_prompt=spec.initial_messages(),
            tools_kwargs={t.name: {"create_kwargs": {"task_id": task_id}} for t in tools},
            **row,
        )
        wall = time.perf_counter() - t0
        SyntheticPoolTool.episodes.clear()
        turns = out.num_turns
        tool_calls, rehearsals = SyntheticPoolTool.executed - executed0, 0
        rollout_cfg = ctx["cfg"].actor_rollout_ref.rollout
        # ToolAgentLoop records no stop reason: rebuilt from what it did (a tool response that overflows the
        # budget ends the rollout before it is appended, hence "every generation called a tool")
        if len(out.response_mask) >= rollout_cfg.response_length:
            stop = "budget"
        elif server.calls >= rollout_cfg.multi_turn.max_assistant_turns:
            stop = "max_turns"
        elif tool_calls >= server.calls:
            stop = "budget"
        else:
            stop = "no_call"
    else:
        source = name.split("[")[1].rstrip("]")
        loop = EnvaceAgentLoop(**common, observation_source=source)
        outs = await loop.run(sampling, **row)
        wall = time.perf_counter() - t0
        info = outs[-1].extra_fields["reward_extra_info"]
        stop, turns = outs[-1].extra_fields["stop_reason"], None
        tool_calls, rehearsals = int(info["tool_calls"]), int(info["rehearse_outputs"])
    return {
        "wall": wall,
        "gen": server.gen_s,
        "calls": server.calls,
        "tokens": server.tokens,
        "stop": stop,
        "tool_calls": tool_calls,
        "rehearsals": rehearsals,
        "first_prompt": server.first_prompt_len,
        "first_hash": server.first_prompt_hash,
        "turns": turns,
    }


async def bench(args, ctx: dict[str, Any], task_ids: list[str], warmup_id: str, loops: list[str]) -> dict[str, Stats]:
    for name in loops:  # warm-up: imports, tokenizer caches, allocator, first forward passes
        await rollout(name, 10_000, warmup_id, ctx)
    stats = {name: Stats() for name in loops}
    ctx["same_first_prompt"] = 0
    for i, task_id in enumerate(task_ids):
        hashes = set()
        for name in loops:  # interleaved: background load falls on every loop alike
            r = await rollout(name, i, task_id, ctx)
            hashes.add(r["first_hash"])
            s = stats[name]
            s.tasks += 1
            s.calls += r["calls"]
            s.tokens += r["tokens"]
            s.wall += r["wall"]
            s.gen += r["gen"]
            s.tool_calls += r["tool_calls"]
            s.rehearsals += r["rehearsals"]
            s.stops[r["stop"]] += 1
            s.first_prompt.append(r["first_prompt"])
            if args.verbose:
                print(
                    f"  {name:<18} {task_id:<22} calls={r['calls']:>2} tokens={r['tokens']:>4} "
                    f"wall={r['wall']:.3f}s gen={r['gen']:.3f}s tools={r['tool_calls']} stop={r['stop']}",
                    flush=True,
                )
        ctx["same_first_prompt"] += len(hashes) == 1
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="checkpoint dir (default: envace.models.ensure_tiny_model())")
    ap.add_argument("--tasks", type=int, default=8, help="measured tasks (synthetic pool, test split)")
    ap.add_argument("--response-length", type=int, default=256, help="token budget of one rollout (both loops)")
    ap.add_argument("--prompt-length", type=int, default=2048)
    ap.add_argument(
        "--max-turns",
        type=int,
        default=4,
        help="assistant messages per rollout: tool_agent max_assistant_turns (and max_user_turns, its "
        "tool rounds); envace limits.max_steps_per_turn with limits.max_user_turns=1",
    )
    ap.add_argument("--max-calls", type=int, default=4, help="tool calls answered per message (both loops)")
    ap.add_argument("--rehearse-max-tokens", type=int, default=64, help="envace.agent.rehearse_max_tokens")
    ap.add_argument("--scripted-calls", action="store_true", help="force the first acting turns to gold tool calls")
    ap.add_argument(
        "--scripted-n", type=int, default=None, help="forced acting turns per rollout (default max-turns - 1)"
    )
    ap.add_argument("--loops", default="tool_agent,envace[real],envace[rehearse]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (hfcpu's ENVACE_ROLLOUT_THREADS default: 1)")
    ap.add_argument("--verbose", action="store_true", help="one line per rollout")
    args = ap.parse_args()
    t_start = time.perf_counter()

    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, args.threads))
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from envace.models.tiny import ensure_tiny_model

    model_path = Path(args.model) if args.model else ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    eos: set[int] = set()  # as HFCPUServer builds them
    try:
        ids = GenerationConfig.from_pretrained(str(model_path)).eos_token_id
        eos.update([ids] if isinstance(ids, int) else (ids or []))
    except OSError:
        pass
    if isinstance(model.config.eos_token_id, int):
        eos.add(model.config.eos_token_id)
    model_type = AutoConfig.from_pretrained(str(model_path)).model_type

    loops = [x.strip() for x in args.loops.split(",") if x.strip()]
    for name in loops:
        if name not in ("tool_agent", "envace[real]", "envace[rehearse]"):
            ap.error(f"unknown loop {name!r}")
    scripted_n = (
        (args.scripted_n if args.scripted_n is not None else max(1, args.max_turns - 1)) if args.scripted_calls else 0
    )

    pool = shared_pool(POOL)
    test_ids = pool.task_ids("test")
    if len(test_ids) < args.tasks + 1:
        ap.error(f"the test split has {len(test_ids)} tasks; --tasks must be < that")
    task_ids, warmup_id = test_ids[: args.tasks], test_ids[args.tasks]

    cfg = trainer_config(args)
    server = LocalServer(model, tokenizer, eos, args.response_length, args.prompt_length, args.seed, scripted_n)
    with tempfile.TemporaryDirectory(prefix="act_rehearse_bench_") as tmp:
        env_tools = {}
        for tid in task_ids + [warmup_id]:
            env_id = pool.task(tid).env_id
            if env_id not in env_tools:
                env_tools[env_id] = load_env_tools(pool.env_tools(env_id), Path(tmp), env_id)
        ctx = {
            "server": server,
            "cfg": cfg,
            "tokenizer": tokenizer,
            "model_type": model_type,
            "env_tools": env_tools,
            "data_cfg": OmegaConf.create({"apply_chat_template_kwargs": {"enable_thinking": False}}),
        }
        stats = asyncio.run(bench(args, ctx, task_ids, warmup_id, loops))

    mode = (
        f"scripted-calls (first {scripted_n} acting turns forced to gold tool calls)"
        if scripted_n
        else "free decoding (no forced calls)"
    )
    print()
    print("command:      " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(
        f"model:        {model_path} ({model_type}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
        f"float32, eager)"
    )
    print(f"torch:        {torch.__version__}, threads={torch.get_num_threads()}")
    print(f"mode:         {mode}")
    print(
        f"setup:        pool={POOL} test split, tasks={args.tasks} (+1 warm-up each loop), response_length="
        f"{args.response_length}, max_turns={args.max_turns}, max_calls={args.max_calls}, rehearse_max_tokens="
        f"{args.rehearse_max_tokens}, temperature=1.0, seed={args.seed}"
    )
    print()
    base = stats.get("tool_agent")
    base_spt = base.wall / base.tokens if base and base.tokens else None
    head = (
        f"{'loop':<18} {'tasks':>5} {'generate calls':>14} {'generated tokens':>16} {'wall s':>8} "
        f"{'s/token':>9} {'generate share':>14} {'ratio vs tool_agent':>19}"
    )
    print(head)
    print("-" * len(head))
    for name, s in stats.items():
        spt = s.wall / s.tokens if s.tokens else float("nan")
        ratio = f"{spt / base_spt:.3f}x" if base_spt else "n/a"
        share = f"{100 * s.gen / s.wall:.1f}%" if s.wall else "n/a"
        print(
            f"{name:<18} {s.tasks:>5} {s.calls:>14} {s.tokens:>16} {s.wall:>8.2f} {spt:>9.5f} {share:>14} {ratio:>19}"
        )
    print()
    head2 = (
        f"{'loop':<18} {'tool calls':>10} {'rehearsals':>10} {'overhead s':>10} {'overhead ms/call':>16} "
        f"{'1st prompt tok':>14}  stop reasons"
    )
    print(head2)
    print("-" * len(head2))
    for name, s in stats.items():
        over = s.wall - s.gen
        fp = sorted(set(s.first_prompt))
        fp_txt = f"{fp[0]}" if len(fp) == 1 else f"{min(fp)}-{max(fp)}"
        print(
            f"{name:<18} {s.tool_calls:>10} {s.rehearsals:>10} {over:>10.3f} {1000 * over / max(1, s.calls):>16.2f} "
            f"{fp_txt:>14}  {json.dumps(dict(s.stops), sort_keys=True)}"
        )
    print(f"first prompt token-identical across loops: {ctx['same_first_prompt']}/{args.tasks} tasks")
    if base_spt:
        for name, s in stats.items():
            if name != "tool_agent" and s.tokens:
                r = (s.wall / s.tokens) / base_spt
                print(
                    f"target {name}: <= 1.3x tool_agent per generated token -> {r:.3f}x "
                    f"({'met' if r <= 1.3 else 'NOT met'})"
                )
    print(f"total run time: {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
