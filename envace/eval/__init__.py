"""Benchmark evaluation: BFCL multi-turn, τ²-bench and the synthetic pool against OpenAI-compatible endpoints.

Entry point: ``python -m envace.eval {bfcl,tau2,synthetic,table,tts-table,sweep} ...`` (see :mod:`envace.eval.cli`),
wrapped by ``scripts/eval_bfcl.sh`` and ``scripts/eval_tau2.sh``. Building blocks:

* :mod:`envace.eval.benchmarks`: the benchmarks, objects owning their flags, pool, endpoints and identity;
* :mod:`envace.eval.runner`: the agent loop and the per-task runner hook (:func:`register_runner`);
* :mod:`envace.eval.driver`: task selection and the resumable, concurrent driver (:func:`evaluate`);
* :mod:`envace.eval.store`: the append-only result files;
* :mod:`envace.eval.report`: summaries and the paper-layout table;
* :mod:`envace.eval.tts`: test-time rehearsal (``--tts parallel|sequential --rehearsals N``, runner ``tts``; its
  settings are :class:`envace.loop_config.TTSConfig`, ``envace.tts`` in Hydra);
* :mod:`envace.eval.sweep`: the Table-3 layout of TTS runs (``tts-table``) and the rehearsal-budget ``sweep``;
* :mod:`envace.eval.server`: serving a checkpoint with vLLM or ``transformers serve``.
"""

from envace.eval.runner import AgentLoopRunner, LoopLimits, TaskRecord, register_runner

__all__ = [
    "AgentLoopRunner",
    "LoopLimits",
    "TaskRecord",
    "register_runner",
]
