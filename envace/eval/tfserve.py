"""``python -m envace.eval.tfserve serve CKPT ...``: ``transformers serve`` that answers a model's malformed
tool call with the model's text instead of HTTP 500.

transformers 5.10's chat-completions handler parses ``<tool_call>{json}</tool_call>`` blocks of the
generated text with ``parse_tool_calls`` and lets its exception escape when the JSON is invalid, so the
request fails with HTTP 500 and the evaluation client cannot tell the model's mistake from a server fault.
This entry point runs the same CLI with that one function made tolerant: a block that does not parse leaves
``tool_calls`` empty, the text (with the raw block) is returned, and envace's own parser reports the
malformed call to the model as an error observation, exactly as in training. Everything else is the stock
server. ``launch_server(kind="transformers")`` uses it.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("envace.eval.tfserve")


def tolerant(parse):  # type: ignore[no-untyped-def]
    """``parse`` that returns None (no structured calls) instead of raising on a malformed block."""

    def parse_tool_calls(*args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return parse(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the model's output, not a server fault
            logger.info("tool-call block does not parse (%s: %s); returning the text", type(exc).__name__, exc)
            return None

    return parse_tool_calls


def install() -> None:
    """Make the chat-completions and responses handlers' tool-call parsing tolerant (idempotent)."""
    from transformers.cli.serving import chat_completion, response

    for module in (chat_completion, response):
        parse = getattr(module, "parse_tool_calls", None)
        if parse is None:  # pragma: no cover - a transformers version without this hook: stock behaviour
            print(f"envace.eval.tfserve: {module.__name__}.parse_tool_calls not found; malformed tool calls "
                  "will fail requests with HTTP 500", file=sys.stderr)
        elif not getattr(parse, "_envace_tolerant", False):
            wrapped = tolerant(parse)
            wrapped._envace_tolerant = True  # type: ignore[attr-defined]
            module.parse_tool_calls = wrapped


def main(argv: list[str] | None = None) -> None:
    from transformers.cli import transformers as cli

    install()
    sys.argv = ["transformers", *(sys.argv[1:] if argv is None else argv)]
    cli.app()  # not cli.main(): it checks PyPI for a newer CLI (no network at run time)


if __name__ == "__main__":
    main()
