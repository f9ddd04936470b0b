"""score_episode: the one scoring path of training and evaluation, and its masking rule (model: scored;
infrastructure: masked, never 0; configuration: raised)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from envace.agents.engine import Transcript
from envace.envs.base import Verdict
from envace.rewards.llm import ConfigurationError
from envace.rewards.score import score_episode


class Episode:
    executable = True
    spec = SimpleNamespace(pool="p", task_id="t0")

    def __init__(self, verify):
        self.verify = verify


def _score(episode, transcript=None, **kw):
    return asyncio.run(score_episode(episode, transcript or Transcript(messages=[]), **kw))


@pytest.mark.parametrize("stop", ["completed", "max_steps_per_turn", "token_budget", "malformed_call", "model_error"])
def test_the_verifier_scores_whatever_the_stop_reason(stop):
    """What the model caused is the model's: an unfinished episode is judged on the state it left (the old
    warm-start loop forced 0 unless the episode completed)."""
    score = _score(Episode(lambda: Verdict(1.0, True, {"reason": "ok"})), Transcript(messages=[], stop_reason=stop))
    assert (score.reward, score.masked, score.verdict.passed) == (1.0, False, True)
    assert score.details["verifier"] == {"reason": "ok"} and score.details["mix"]["reward"] == 1.0


def test_a_failed_verifier_masks_the_score_instead_of_scoring_zero():
    def boom():
        raise RuntimeError("checker exploded")

    score = _score(Episode(boom))
    assert score.masked and "checker exploded" in score.reason and score.verdict is None


def test_a_stuck_verifier_is_masked_at_its_time_out_and_does_not_hold_the_caller():
    release = threading.Event()
    started = time.monotonic()
    score = _score(Episode(lambda: release.wait(30) and Verdict(1.0, True)), timeout_s=0.2)
    release.set()
    assert score.masked and "did not finish within 0.2s" in score.reason
    assert time.monotonic() - started < 5  # asyncio.run returned although the verifier's thread was still running


def test_an_environment_time_out_in_the_rollout_masks_it_without_verifying():
    ran = []
    t = Transcript(messages=[], masked=True, mask_reason="environment timed out")
    score = _score(Episode(lambda: ran.append(1)), t)
    assert score.masked and score.reason == "environment timed out" and not ran


def test_configuration_errors_abort():
    def misconfigured():
        raise ConfigurationError("unknown judge model 'x'")

    with pytest.raises(ConfigurationError, match="unknown judge model"):
        _score(Episode(misconfigured))
    with pytest.raises(ValueError, match="no reward component"):
        _score(Episode(lambda: Verdict(1.0, True)), verifiable_weight=0.0)


def test_a_masked_checklist_masks_the_mix():
    async def judge(messages, checklists):
        return SimpleNamespace(reward=None, masked=True, reason="judge down", per_turn=[], n_calls=2, n_failures=2)

    score = _score(Episode(lambda: Verdict(1.0, True)), checklist_weight=1.0, checklists=[[]], judge=judge)
    assert score.masked and "judge down" in score.reason
