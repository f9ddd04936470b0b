"""The benchmarks ``python -m envace.eval`` runs, each an object that owns what sets it apart from the others.

A :class:`Benchmark` is the table's column group (title, categories in column order, their labels) and what a run
of it needs beyond the flags every benchmark shares (:func:`envace.eval.args.add_common_arguments`):

* :meth:`~Benchmark.add_arguments`: the subcommand's own flags (its category selection, its own endpoints, limits);
* :meth:`~Benchmark.build_pool` and :meth:`~Benchmark.wanted`: the environment pool it builds from those flags and
  the categories asked for (task selection itself is :func:`envace.eval.driver.select_tasks`, the same for all);
* :meth:`~Benchmark.normalize`: a pool's category name as the table names it;
* :meth:`~Benchmark.clients`: the endpoints its episodes talk to besides the agent's, passed to ``pool.start``
  (τ²-bench: the simulated user and the NL-assertion judge), one client each, shared by every episode;
* :meth:`~Benchmark.identity`: its settings that change per-task results, recorded in ``run.json`` with the common
  ones (:func:`envace.eval.args.run_identity`), so a resume with other values is refused.

:data:`BENCHMARKS` is the registry: one subcommand each, the paper table's first, in its order (:data:`PAPER_TABLE`,
:func:`envace.eval.report.format_table`), then ``synthetic``, the procedurally generated pool (task shapes as its
categories). A new benchmark is a subclass overriding what differs and an entry here;
``run_benchmark`` (:mod:`envace.eval.cli`) has no branch per benchmark.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trace2env.cliargs import json_object, number

if typing.TYPE_CHECKING:
    from envace.agents.client import ChatClient, EndpointConfig
    from envace.envs.base import EnvironmentPool

__all__ = ["BENCHMARKS", "PAPER_TABLE", "Benchmark", "Bfcl", "Synthetic", "Tau2"]


@dataclass(frozen=True)
class Benchmark:
    """A benchmark whose pool needs no settings and whose episodes talk to the agent's endpoint alone (also the
    per-run column group of ``w2r``, over any pool)."""

    name: str  # CLI name
    pool: str  # environment pool registry name
    title: str  # column-group title
    categories: tuple[str, ...]  # column order
    labels: tuple[str, ...]  # column headers
    help: str = ""  # the subcommand's help line

    def label(self, category: str) -> str:
        return dict(zip(self.categories, self.labels, strict=True)).get(category, category)

    def normalize(self, category: str) -> str:
        """A pool's category as the table names it."""
        return category

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The subcommand's own flags."""

    def wanted(self, args: argparse.Namespace) -> Sequence[str] | None:
        """The categories the flags ask for (None: all)."""
        return None

    def build_pool(self, args: argparse.Namespace) -> EnvironmentPool:
        from envace.envs.base import get_pool

        return get_pool(self.pool)

    def clients(self, args: argparse.Namespace, agent: EndpointConfig) -> dict[str, ChatClient | None]:
        """Keyword arguments of ``pool.start``: the other endpoints an episode talks to (``agent``: the agent's)."""
        return {}

    def identity(self, args: argparse.Namespace) -> dict[str, Any]:
        """This benchmark's settings that change per-task results."""
        return {}


@dataclass(frozen=True)
class Bfcl(Benchmark):
    """BFCL multi-turn: the official checker; categories with or without the ``multi_turn_`` prefix."""

    def normalize(self, category: str) -> str:
        """``BFCL_v4_multi_turn_miss_func`` / ``multi_turn_miss_func`` / ``miss_func`` → ``miss_func``."""
        return category.removeprefix("BFCL_v4_").removeprefix("BFCL_v3_").removeprefix("multi_turn_")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--categories", nargs="+", default=None, metavar="CAT",
                            help="subset of: base miss_func miss_param long_context (multi_turn_ prefix optional)")

    def wanted(self, args: argparse.Namespace) -> Sequence[str] | None:
        return args.categories


@dataclass(frozen=True)
class Tau2(Benchmark):
    """τ²-bench: the pool is built for the chosen domains and the orchestrator's limits; every episode talks to a
    simulated user (default: the agent's endpoint) and, for tasks with NL assertions, a judge."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--domains", nargs="+", default=None, metavar="DOMAIN",
                            help="subset of: airline retail telecom")
        us = parser.add_argument_group("simulated user (default: the agent's endpoint)")
        us.add_argument("--user-base-url", default=None)
        us.add_argument("--user-model", default=None)
        us.add_argument("--user-api-key", default=None)
        us.add_argument("--user-temperature", type=number(float, min=0), default=0.0, help="τ²'s default is 0.0")
        us.add_argument("--user-max-tokens", type=number(int, min=1), default=None)
        jg = parser.add_argument_group("NL-assertion judge (only tasks whose reward basis has NL_ASSERTION need one)")
        jg.add_argument("--judge-base-url", default=None)
        jg.add_argument("--judge-model", default=None)
        jg.add_argument("--judge-api-key", default=None)
        tl = parser.add_argument_group("τ² orchestrator limits")
        tl.add_argument("--tau2-max-steps", type=number(int, min=1), default=200, help="τ²'s max_steps (messages)")
        tl.add_argument("--tau2-max-errors", type=number(int, min=1), default=10,
                        help="τ²'s max_errors (failed tool calls)")

    def wanted(self, args: argparse.Namespace) -> Sequence[str] | None:
        return args.domains

    def build_pool(self, args: argparse.Namespace) -> EnvironmentPool:
        from envace.envs.base import get_pool

        return get_pool(self.pool, domains=tuple(args.domains or self.categories), max_steps=args.tau2_max_steps,
                        max_errors=args.tau2_max_errors)

    def clients(self, args: argparse.Namespace, agent: EndpointConfig) -> dict[str, ChatClient | None]:
        """``user``: the simulated user (the agent's endpoint, key and seed unless ``--user-*`` says otherwise);
        ``judge``: the NL-assertion judge, only with ``--judge-model`` (else None: such checks stay unjudged)."""
        from envace.agents.client import ChatClient, EndpointConfig

        user = EndpointConfig(base_urls=args.user_base_url or agent.base_urls, model=args.user_model or agent.model,
                              api_key=args.user_api_key or agent.api_key, temperature=args.user_temperature,
                              max_tokens=args.user_max_tokens, seed=agent.seed, timeout_s=agent.timeout_s,
                              extra_body=dict(agent.extra_body))
        judge = None
        if args.judge_model:
            judge = ChatClient(EndpointConfig(base_urls=args.judge_base_url or agent.base_urls, model=args.judge_model,
                                              api_key=args.judge_api_key or agent.api_key, temperature=0.0,
                                              max_tokens=None, timeout_s=agent.timeout_s))
        return {"user": ChatClient(user), "judge": judge}

    def identity(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"user_model": args.user_model or "<agent model>", "user_temperature": args.user_temperature,
                "user_max_tokens": args.user_max_tokens, "judge_model": args.judge_model,
                "tau2_max_steps": args.tau2_max_steps, "tau2_max_errors": args.tau2_max_errors}


@dataclass(frozen=True)
class Synthetic(Benchmark):
    """The procedurally generated pool (``envace/envs/synthetic/``), built with ``--pool-kwargs`` as a training recipe
    builds it (``envace.agent.pool_kwargs.synthetic``: the same tasks and splits); its categories are task shapes."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--categories", nargs="+", default=None, metavar="SHAPE",
                            help=f"subset of the task shapes: {' '.join(self.categories)}")
        parser.add_argument("--pool-kwargs", type=json_object, default={}, metavar="JSON",
                            help="pool constructor arguments, e.g. a recipe's envace.agent.pool_kwargs.synthetic "
                            "('{\"tasks_per_env\": 65, \"renamings\": false}')")

    def wanted(self, args: argparse.Namespace) -> Sequence[str] | None:
        return args.categories

    def build_pool(self, args: argparse.Namespace) -> EnvironmentPool:
        from envace.envs.base import get_pool

        try:
            return get_pool(self.pool, **args.pool_kwargs)
        except TypeError as exc:  # an argument the pool does not take
            raise ValueError(f"--pool-kwargs: {exc}") from None

    def identity(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"pool_kwargs": args.pool_kwargs}


#: the paper table's column groups (:func:`envace.eval.report.format_table`), in its order
PAPER_TABLE = ("tau2", "bfcl")

#: the benchmark subcommands: the paper table's (τ²-bench, then BFCL multi-turn), then the others
BENCHMARKS: dict[str, Benchmark] = {
    "tau2": Tau2(name="tau2", pool="tau2", title="τ²-bench (%)", categories=("airline", "retail", "telecom"),
                 labels=("Airline", "Retail", "Telecom"), help="τ²-bench (airline, retail, telecom)"),
    "bfcl": Bfcl(name="bfcl", pool="bfcl_multi_turn", title="Multi-Turn (%)",
                 categories=("base", "miss_func", "miss_param", "long_context"),
                 labels=("Base", "Miss Func.", "Miss Param.", "Long Ctx."),
                 help="BFCL multi-turn (base, miss_func, miss_param, long_context)"),
    "synthetic": Synthetic(name="synthetic", pool="synthetic", title="Synthetic (%)",
                           categories=("act", "query", "lookup_act", "lookup_query", "copy_value", "transfer_chain",
                                       "create_verify", "filter_update", "multiturn"),
                           labels=("Act", "Query", "Lookup act", "Lookup query", "Copy value", "Transfer chain",
                                   "Create verify", "Filter update", "Multi-turn"),
                           help="the procedurally generated synthetic pool, one column per task shape"),
}
