"""The official Open Responses compliance suite (tests/vendor/openresponses) against
`ocxproxy serve` on the embedded llama.cpp with SmolLM2-135M, decoding greedily
(scripts/openresponses passes --local-temperature 0): the suite sets no temperature and no
output limit, and sampled at llama.cpp's default this model runs on to the end of its
context (8,192 tokens, minutes on a 2-core machine) about one answer in forty. Greedy, each
answer is the same every run, and some of the suite's prompts ("Count from 1 to 3", a
compaction's summary) run on every time, so it is restricted (--filter) to the tests that
end quickly: the output-phase schema, both refusals (a compact without a model, a
WebSocket continuation of an unknown response), two short answers (JSON), and image input,
which fails: the model has no vision projector, and llama.cpp answers 500; and in a run of
their own, the multi-turn and system-prompt tests."""

from __future__ import annotations

import pytest

from tests.conftest import unavailable
from tests.e2e.conftest import HAVE_LLAMA, MISSING
from tests.http.test_openresponses_suite import outcome, run_suite

pytestmark = [pytest.mark.llama, pytest.mark.timeout(300)]

if not HAVE_LLAMA:
    unavailable(MISSING)

PASSING = (
    "response-output-phase-schema",
    "compact-missing-model",
    "websocket-previous-response-not-found",
    "basic-response",
    "assistant-phase",
)
# These pass on their own (greedy, each answer ends) but can take tens of seconds on a busy
# machine: queued behind them on the backend's single slot, a WebSocket turn of the run
# above could wait past the suite's 30 s. HTTP only, so no such deadline: a run of their own.
ALONE = ("multi-turn", "system-prompt")
NO_VISION = "HTTP 500: [object Object]"  # the suite prints the error object so


def test_the_suite_on_smollm2_passes_all_but_image_input() -> None:
    results = run_suite("--embedded", "--filter", ",".join((*PASSING, "image-input")))
    expected = {name: "passed" for name in PASSING} | {"image-input": [NO_VISION]}
    assert outcome(results) == dict(sorted(expected.items()))


def test_the_suite_on_smollm2_passes_multi_turn_and_system_prompts() -> None:
    results = run_suite("--embedded", "--filter", ",".join(ALONE))
    assert outcome(results) == {name: "passed" for name in sorted(ALONE)}
