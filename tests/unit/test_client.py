"""The batch client's retries where no gateway answers: UNAVAILABLE is retried with backoff
until the attempts run out, then the prompt fails naming itself; bad settings are refused."""

from __future__ import annotations

import grpc
import pytest

from tandem.apps.client import GenerateFailed, RetryPolicy, generate_remote
from tandem.apps.demo import free_port


def test_unavailable_is_retried_with_backoff_then_fails_naming_the_prompt() -> None:
    waits: list[tuple[grpc.StatusCode, float]] = []
    with pytest.raises(GenerateFailed) as failed:
        generate_remote(
            f"127.0.0.1:{free_port()}",  # nothing listens
            ["a", "b"],
            temperature=0.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            repetition_penalty=1.0,
            seed=None,
            max_new_tokens=4,
            ignore_eos=False,
            max_in_flight=1,
            retry=RetryPolicy(attempts=3, initial_backoff_s=0.05, max_backoff_s=0.2),
            on_retry=lambda code, delay: waits.append((code, delay)),
        )
    assert failed.value.index == 0 and failed.value.code == grpc.StatusCode.UNAVAILABLE
    assert str(failed.value).startswith("prompt 0: UNAVAILABLE")
    assert [code for code, _ in waits] == [grpc.StatusCode.UNAVAILABLE] * 2
    assert all(0.05 <= delay <= 0.25 for _, delay in waits)


@pytest.mark.parametrize(
    ("options", "field"),
    [({"attempts": 0}, "attempts"), ({"initial_backoff_s": 0.0}, "initial_backoff_s")],
)
def test_a_bad_retry_policy_is_refused(options: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RetryPolicy(**options)  # type: ignore[arg-type]
