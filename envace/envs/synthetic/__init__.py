"""Procedurally generated multi-environment tool-use pool (``"synthetic"``).

A deterministic generator (stdlib + ``jsonschema``; no data files) of many small, fully executable
tool-use environments whose tasks are regular enough for a tiny model to learn from gold trajectories,
yet share structure across environments so that cross-environment relations are real.

Domains
    Nine domain templates (:data:`DOMAINS`): ``bank`` (accounts: owner, balance, open/frozen),
    ``shop`` (items: product, stock), ``calendar`` (events: title, hour), ``files`` (path, size),
    ``kv`` (entries: key, value), ``tickets`` (subject, priority), ``library`` (books: title, copies),
    ``loyalty`` (members: name, points, tier) and ``warehouse`` (bins: label, qty, state). Every domain
    state is a small dict ``{entity_id: {"name", "num", "status"}}``; a domain names the three fields
    (``owner``/``balance``/``status``, ``label``/``qty``/``state``, ...), the entity noun, its statuses
    (the first one is the status of newly created entities), the value range and the pool of entity
    names. Environment ``i`` (``env_id`` ``"syn-<domain>-<i>"``) instantiates domain ``i mod 9`` with
    its own entities (6-9, distinct values), id prefix (``A17``, ``K42``, ...), tool subset and
    renamings (tool names, id/amount/value/name/status parameter names, source/target parameter
    names), all drawn from ``random.Random(f"{seed}:{i}")``. The tool subset aims at 3-8 of the
    domain's operations but stops at a budget on the rendered schemas
    (:data:`~envace.envs.synthetic.world._TOOLS_BUDGET_CHARS`), so that the prompt (the chat template's tool
    block + the instruction; there is no system prompt) stays within 512 Qwen3 tokens: environments end up with
    3-6 tools.

Operations
    Tools implement nine abstract operations shared by all domains (the cross-environment structure):
    ``find`` (name -> ``{"id"}``), ``get`` (id -> the record), ``list`` (status -> ``{"ids"}``),
    ``set`` (status), ``add`` (increase the number), ``setnum`` (set the number), ``move`` (move an
    amount of the number between two entities; fails on insufficient funds), ``create`` (name + number
    -> ``{"id"}``, ids are ``prefix + (max number + 1)``) and ``delete``. Every environment has
    ``find``, ``get`` and at least one of ``set``/``add``/``setnum``. Tool schemas are OpenAI function
    schemas (``{"type": "function", "function": {"name", "description", "parameters"}}``) with terse
    descriptions; ``parameters`` is JSON Schema with types, status enums and ``required`` (kept lean
    for the prompt budget). Observations are ``json.dumps`` of a small dict; every failure is an
    observation ``{"error": "..."}``, never an exception: unknown tool, an argument name the tool does
    not have, arguments rejected by ``jsonschema``, an amount below 1 or a set/created number outside
    the domain's range, unknown id or name, insufficient amount, a taken name, calls after the
    episode ended.

Task shapes (``TaskSpec.category``)
    ``act``            one write call with ids and values given in the instruction
    ``query``          ``get`` then answer a field (number or status)
    ``lookup_act``     ``find`` by name, then a write on the returned id (id dependency)
    ``lookup_query``   ``find`` then ``get`` then answer (id dependency)
    ``copy_value``     ``get`` a number, then ``setnum``/``move`` with it (value dependency)
    ``transfer_chain`` two ``find`` calls, then ``move`` between the two ids (3 calls)
    ``create_verify``  ``create``, ``get`` the new id, answer its id and status
    ``filter_update``  ``list`` by status, then one write per returned id (2-4 calls)
    ``multiturn``      two user turns: a ``lookup_act``/``lookup_query`` then a follow-up on the same
                       entity ("Now set its status to frozen."); ``end_turn`` hands out the second message
    Environment tasks cycle through the shapes its tools allow (every environment allows at least
    ``act``, ``query``, ``lookup_act``, ``lookup_query`` and ``multiturn``); instructions are unique per
    environment (unless ``tasks_per_env`` exceeds what the shapes can vary; then queries repeat). Gold actions come from executing the generated calls, so every gold sequence is valid.

Verifier
    The expected final state is the gold replay's. Checks (``TaskSpec.verifier_text`` lists them):
    one per touched entity (its final fields, or that it is deleted, or that a new entity with the
    given fields exists), one that nothing else changed (no other entity modified, no extra entity
    created), and, for each user turn that asks a question, one that the agent's reply for that turn
    (the text passed to ``end_turn``) contains the expected value (number, status or id; whole word,
    case-insensitive). ``reward="binary"``: 1.0 iff all checks pass; ``reward="partial"``: the fraction
    of checks passed.

Replay and answers
    :meth:`SyntheticPool.replay` has no reply text to go on, so by default each turn's reply is the
    concatenation of that turn's observations ("the agent reports what its calls returned"). Gold
    replay thus scores 1.0, while a replay that skips or misdirects the lookup loses the answer check.
    Pass ``replies=pool.gold_replies(task_id)`` (or any texts) to score real replies;
    :meth:`SyntheticPool.gold_trajectory` gives the full gold chat (tool calls, observations, replies)
    for supervised fine-tuning.

Splits
    Per task: ``sha256(f"{seed}:{task_id}")`` mapped to [0, 1) below ``test_fraction`` is ``"test"``,
    otherwise ``"train"``. Construction is lazy: an environment (tools, state, tasks, gold) is built on
    first use of one of its tasks.

Modules: ``domains`` (the domain templates, operations and task shapes), ``world`` (one environment: tools,
state, execution), ``tasks`` (task drafting and records), ``episode`` and ``pool``. The EnvSched JSONL export of any
pool's tasks is :func:`envace.data.records.export_envsched_jsonl`.
"""

from __future__ import annotations

from envace.envs.synthetic.domains import DOMAINS, OPS, SHAPES, Domain
from envace.envs.synthetic.episode import SyntheticEpisode
from envace.envs.synthetic.pool import POOL_NAME, SyntheticPool

__all__ = [
    "DOMAINS",
    "OPS",
    "POOL_NAME",
    "SHAPES",
    "Domain",
    "SyntheticEpisode",
    "SyntheticPool",
]
