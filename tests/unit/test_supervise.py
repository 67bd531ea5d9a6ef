"""`tandem serve`'s supervision (tandem/apps/supervise.py) over a process that dies at once: it
is started again after a backoff that doubles, and left down after ``max_restarts`` restarts in
a row, each step reported with its log; a start-up failure names the reason the log gives."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tandem.apps.demo import free_port
from tandem.apps.launch import Service, Stack, failure_reason, wait_serving
from tandem.apps.supervise import Phase, RestartPolicy, Supervisor

pytestmark = pytest.mark.e2e  # child processes


def test_a_service_that_keeps_dying_is_restarted_with_backoff_then_left_down(
    tmp_path: Path,
) -> None:
    dying = Service("draft", "json.tool", [str(tmp_path / "missing.json")], free_port())
    stack = Stack([dying])
    stack.launch(dying, tmp_path)
    assert dying.proc is not None and dying.proc.wait(30) != 0
    said: list[str] = []
    policy = RestartPolicy(max_restarts=3, backoff_s=0.1, backoff_max_s=0.2)
    supervisor = Supervisor(stack, policy, log_dir=tmp_path, report=said.append)
    deadline = time.monotonic() + 60
    while supervisor.phase("draft") is not Phase.GIVEN_UP:
        assert time.monotonic() < deadline, said
        supervisor.tick()
        time.sleep(0.02)
    waits = [float(m[1]) for line in said if (m := re.search(r"restarting in ([0-9.]+) s", line))]
    assert waits == [0.1, 0.2, 0.2], said  # doubling, capped
    assert said[-1].startswith("draft exited with 2 on restart; given up after 3 restarts")
    assert f"(log: {tmp_path / 'draft.log'})" in said[-1]
    assert supervisor.serving  # a draft given up on leaves the gateway serving
    # Every run appended to the one log, and the reason is found in it.
    assert (tmp_path / "draft.log").read_text().count("No such file or directory") == 4
    assert failure_reason(tmp_path / "draft.log") is not None


def test_a_start_up_failure_names_the_reason(tmp_path: Path) -> None:
    bad = Service("target", "json.tool", [str(tmp_path / "missing.json")], free_port())
    Stack([bad]).launch(bad, tmp_path)
    with pytest.raises(RuntimeError) as failed:
        wait_serving(bad, 30)
    message = str(failed.value)
    assert message.startswith("target exited with 2 before it was ready: argument infile: ")
    assert "No such file or directory" in message
    assert message.endswith(f"(log: {tmp_path / 'target.log'})")
