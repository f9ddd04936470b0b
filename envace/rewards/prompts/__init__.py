"""Versioned prompt templates of the reward judges.

Templates are :class:`string.Template` strings (``$name`` placeholders, so JSON braces need no escaping).
Never edit a released version in place: judged rewards must stay reproducible, so a wording change is a
new key in :data:`CHECKLIST_JUDGE_PROMPTS` and a new default in the judge config.
"""

from __future__ import annotations

from string import Template

__all__ = ["CHECKLIST_JUDGE_PROMPTS", "DEFAULT_CHECKLIST_PROMPT_VERSION", "checklist_judge_template"]

CHECKLIST_JUDGE_V1 = Template(
    """\
You are grading one step of a conversation between a user, an AI assistant and the tools the assistant \
can call. Decide whether the assistant's behaviour satisfies ONE checklist criterion.

## Criterion
Question: $question
What to look at: $focus_on
It passes when: $pass_condition
It fails, for example, when:
$failure_examples
Reference snippets (from a correct reference conversation; they illustrate the expectation, the \
assistant does not have to copy them word for word):
$evidence

## Earlier turns (context only, not graded)
$history

## Current turn, up to the step under evaluation
$current

## How to decide
- Judge only what the assistant did in the current turn up to and including step $step, together with \
the tool results it received. Earlier turns are context.
- Look at the part named in "What to look at". If that part does not exist yet (for example no tool \
call was made when the criterion is about a tool call), the answer is false.
- The answer is true only if the pass condition is fully met and none of the failure examples applies.
- A tool call whose tool result is an error did not succeed.
- Do not reward intentions: text that only announces an action, or a tool call written into the reply \
text instead of being made as a tool call, does not count as the action.

## Output
Reply with one JSON object and nothing else:
{"reasoning": "<two to five sentences explaining the decision>", "answer": true or false}
"""
)

#: prompt version -> template; placeholders: question, focus_on, pass_condition, failure_examples,
#: evidence, history, current, step
CHECKLIST_JUDGE_PROMPTS: dict[str, Template] = {"v1": CHECKLIST_JUDGE_V1}
DEFAULT_CHECKLIST_PROMPT_VERSION = "v1"


def checklist_judge_template(version: str = DEFAULT_CHECKLIST_PROMPT_VERSION) -> Template:
    try:
        return CHECKLIST_JUDGE_PROMPTS[version]
    except KeyError:
        raise ValueError(
            f"unknown checklist judge prompt version {version!r}; known: {sorted(CHECKLIST_JUDGE_PROMPTS)}"
        ) from None
