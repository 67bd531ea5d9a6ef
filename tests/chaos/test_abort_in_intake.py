"""A request aborted while its prompt waits to go to a draft service (its admit deferred for
the intake lane, tandem/target/exchange.py) is never sent: the next steps go on, the other
requests' output is target-only's, and both pools end empty. The public fuzz
(test_fuzz_public.py) first found it as a failed target step (a KeyError: INTERNAL for every
running request); this pins it down deterministically."""

from __future__ import annotations

import pytest

from tandem.config import EngineConfig
from tandem.sampling import SamplingParams
from tandem.target import exchange
from tandem.target.engine import Engine
from tandem.target.policy import SpecPolicy
from tests.helpers.draft_service import (  # noqa: F401 (the ckpts fixture)
    SPEC,
    Ckpts,
    Feed,
    assert_draft_released_all,
    ckpts,
    remote_drafter,
    serve,
)

pytestmark = pytest.mark.slow


class Always(SpecPolicy):
    def speculate(self, batch_size: int) -> bool:
        return True


def test_an_abort_while_the_admit_waits_for_the_intake_lane(
    ckpts: Ckpts,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(exchange, "INTAKE_BYTES", 1)  # one prompt per intake message
    feed = Feed(31)
    prompts = [feed.ids(n) for n in (9, 14, 5)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    config = EngineConfig(model=ckpts.target, page_size=4)
    kept = [prompts[0], prompts[2]]
    reference = [r.token_ids for r in Engine(config).generate(kept, params)]
    server = serve(ckpts)
    remote = remote_drafter(server, deadline_s=10.0)
    try:
        engine = Engine(config, drafter=remote, spec=SPEC)
        engine.policy = Always()
        assert engine.exchange is not None and engine.exchange.separate_intake
        ids = [engine.add_request(p, params) for p in prompts]
        engine.step()  # the prompts' prefill: one admit goes out, two wait for the lane
        assert len(engine.exchange._deferred_admits) == 2
        # The next to go out, aborted as the target service aborts: gone from the engine.
        engine.abort(ids[1])
        engine.pop_finished(ids[1])
        while engine.has_unfinished():
            engine.step()
        engine.flush_draft()
        assert [engine.pop_finished(i).token_ids for i in (ids[0], ids[2])] == reference
        assert engine.kv.allocator.num_free_pages == engine.kv.allocator.num_pages
        assert_draft_released_all(server)
    finally:
        remote.close()
        server.stop()
