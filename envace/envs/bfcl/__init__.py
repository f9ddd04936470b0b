"""BFCL v4 multi-turn as an :class:`~envace.envs.base.EnvironmentPool` (``"bfcl_multi_turn"``).

Source: the ``bfcl-eval`` wheel (data, executable backends and the official checker all ship in it;
everything runs offline). The pool covers the 800 tasks of ``multi_turn_base``, ``multi_turn_miss_func``,
``multi_turn_miss_param`` and ``multi_turn_long_context`` (200 each).

Environment
    Each episode owns fresh instances of the task's ``involved_classes`` (``GorillaFileSystem``,
    ``TradingBot``, ...), loaded with the task's ``initial_config`` (``long_context=True`` for the
    long-context category), exactly as BFCL's own executor builds them. A :class:`ToolCall` runs by
    calling the bound method with keyword arguments — model text is never ``eval``-ed. Unknown tools,
    argument names that do not fit the method's signature, non-JSON values and
    exceptions raised by the method all come back as an error observation that states the reason.

Tools
    BFCL's function docs use non-JSON-schema types (``dict``, ``float``, ``tuple``, ``any``); they are
    converted to OpenAI function schemas whose ``parameters`` are valid JSON Schema (Draft 2020-12),
    see :func:`convert_bfcl_function_doc`. Tool names are BFCL's plain method names (``cd``, ``mv``),
    the names the multi-turn checker resolves; :attr:`BFCLMultiTurnPool.tool_owner` maps each name to
    its class. In ``miss_func`` the held-out functions join the tool list at the turn the benchmark
    names (``missed_function``); that turn's user message is BFCL's own
    ``DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC``, as in ``bfcl_eval``'s inference loop. A held-out
    function is *listed* only from that turn but, as in BFCL's executor, it executes if called earlier.

Verifier
    :meth:`BFCLEpisode.verify` renders the episode's accepted calls as ``name(arg=<literal>, ...)``
    and runs the official ``multi_turn_checker`` (per-turn state and response checks against the
    ground truth). Turns whose ground truth is empty (``miss_func``/``miss_param``, and three tasks of
    ``base``/``long_context``) expect *no* call; they are checked with the benchmark's
    ``multi_turn_irrelevance_checker`` (``check_irrelevance=True``, the default). Note that
    ``bfcl_eval`` 2026.3.23's ``eval_runner`` imports but never calls that checker, so with
    ``check_irrelevance=False`` the verdict equals the leaderboard's.

    The checker caches backend instances in ``multi_turn_utils``' module globals keyed by model name
    and never evicts them. Every verification therefore uses a fresh ``model_name`` (a uuid) and
    deletes its cached ``*_instance`` globals afterwards, under a lock: verifications are independent
    and may run concurrently from threads.

Splits
    The four categories are variants of the same 200 scenarios (``multi_turn_base_17`` and
    ``multi_turn_miss_func_17`` share initial state and most questions). The train/test split is
    therefore made per *scenario*: ``sha256(f"{split_seed}:bfcl_mt_scenario_{n}")`` mapped to [0, 1)
    is compared with ``test_fraction`` (default 0.2, seed 0), so all variants of a scenario land in
    the same split and no scenario leaks from train to test.

``BFCL_PROJECT_ROOT`` is pointed at a scratch directory (``$ENVACE_CACHE/bfcl``, default
``~/.cache/envace/bfcl``) before ``bfcl_eval`` is imported; otherwise it creates ``result/``,
``score/`` and ``.file_locks/`` inside site-packages.
"""

from __future__ import annotations

from envace.envs.bfcl.calls import parse_call_string, render_call, render_literal
from envace.envs.bfcl.episode import BFCLEpisode
from envace.envs.bfcl.pool import MULTI_TURN_CATEGORIES, POOL_NAME, BFCLMultiTurnPool, scenario_key
from envace.envs.bfcl.schema import SchemaConversionError, convert_bfcl_function_doc, convert_bfcl_schema

__all__ = [
    "MULTI_TURN_CATEGORIES",
    "POOL_NAME",
    "BFCLEpisode",
    "BFCLMultiTurnPool",
    "SchemaConversionError",
    "convert_bfcl_function_doc",
    "convert_bfcl_schema",
    "parse_call_string",
    "render_call",
    "render_literal",
    "scenario_key",
]
