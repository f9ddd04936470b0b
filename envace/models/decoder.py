"""An in-process token-in / token-out decoder: the ``generate`` the warm start's evaluation plugs into the
turn engine's token-level policy (:class:`envace.agents.token_policy.TokenPolicy`) in place of verl's rollout
server.

It decodes with the ``hfcpu`` rollout's own machinery (:class:`~envace.platform.rollout.DecodeBatch`,
:class:`~envace.platform.rollout.SamplingSpec`): the rollouts awaiting a generation decode together, each row with
its own sampling parameters and seeded generator, so a rollout's tokens do not depend on which others run beside
it. Like the ``hfcpu`` server it stops at the model's end-of-sequence ids (its generation config's and its
config's) and caps ``max_tokens`` at what ``max_model_len`` leaves after the prompt.

The decoding runs on the caller's event loop (one decode step at a time, between which the rollouts' own work,
environment calls in worker threads included, moves on).
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["LocalDecoder"]


class LocalDecoder:
    """Serves ``generate`` calls from coroutines of one event loop with one model (see module docstring)."""

    def __init__(self, model: Any, *, max_model_len: int, max_rows: int = 32, eos_ids: set[int] | None = None) -> None:
        from envace.platform.rollout import DecodeBatch, model_eos_ids

        self.max_model_len = int(max_model_len)
        self.max_rows = max(1, int(max_rows))
        self.batch = DecodeBatch(model, model_eos_ids(model) if eos_ids is None else set(eos_ids))
        self._pending: list[tuple[list[int], Any, Any, asyncio.Future]] = []
        self._driver: asyncio.Task | None = None

    def generate_with(self, generator: Any):
        """A ``generate(prompt_ids, sampling_params, role)`` for :class:`~envace.agents.token_policy.TokenPolicy`
        that samples from ``generator`` (a seeded ``torch.Generator``; None: torch's default)."""

        async def generate(prompt_ids: list[int], params: dict[str, Any], role: Any = None):
            return await self.generate(prompt_ids, params, generator)

        return generate

    async def generate(self, prompt_ids: list[int], params: dict[str, Any],
                       generator: Any = None) -> tuple[list[int], list[float] | None]:
        """The tokens generated for ``prompt_ids`` under ``params`` (vLLM names) and their log-probs (None unless
        ``params["logprobs"]``)."""
        from envace.platform.rollout import SamplingSpec

        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room to generate within "
                             f"max_model_len={self.max_model_len}")
        spec = SamplingSpec(params, room)
        spec.max_tokens = max(1, min(spec.max_tokens, room))
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending.append((list(prompt_ids), spec, generator, done))
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())
        tokens, log_probs = await done
        return tokens, (log_probs if spec.logprobs else None)

    async def _drive(self) -> None:
        batch, waiting = self.batch, {}
        while True:
            await asyncio.sleep(0)  # the rollouts that can run queue their next request first
            if self._pending and len(batch) < self.max_rows:
                new = self._pending[: self.max_rows - len(batch)]
                del self._pending[: len(new)]
                try:
                    batch.add([id(f) for *_, f in new], [p for p, *_ in new], [s for _, s, _, _ in new],
                              [g for _, _, g, _ in new])
                    waiting.update((id(f), f) for *_, f in new)
                except Exception as exc:  # noqa: BLE001 - raised in the new requests' callers
                    for *_, f in new:
                        f.set_exception(exc)
            if not batch:
                if not self._pending:
                    return
                continue
            try:
                finished = batch.step()
            except Exception as exc:  # noqa: BLE001 - raised in every caller of the batch
                for f in waiting.values():
                    if not f.done():
                        f.set_exception(exc)
                waiting.clear()
                batch.clear()
                continue
            for key, (tokens, log_probs, _finish) in finished.items():
                f = waiting.pop(key)
                if not f.done():
                    f.set_result((list(tokens), list(log_probs)))
