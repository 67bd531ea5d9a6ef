"""The SGLang Model Gateway router (``smg``, a real process) in front of ``tandem serve
--smg-port`` on the embedded reference model, driven by the ``openai`` client (issue 34, item
2): ``/v1/completions`` and ``/v1/chat/completions`` (the checkpoint's chat template), streamed
and not, greedy text equal to transformers' on the same checkpoint, usage counted right, and a
client that goes away mid-stream freeing both KV pools (the gateway's GetServerInfo says)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator

import pytest

from tandem.apps.demo import free_port
from tests.checkpoints import hf_greedy
from tests.helpers.serve import Serve, server_info, start_serve
from tests.helpers.smg import TARGET, Router, client, start_router

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Serve, Router, int]]:
    root = tmp_path_factory.mktemp("smg")
    smg_port = free_port()
    serve = start_serve(root, "--smg-port", str(smg_port))
    try:
        router = start_router(root, [smg_port])
        try:
            yield serve, router, smg_port
        finally:
            router.stop()
    finally:
        assert serve.stop() == 0


def prompts() -> list[str]:
    lines = (TARGET.parent / "prompts" / "heldout.jsonl").read_text().splitlines()[:2]
    return [json.loads(line)["text"][-200:] for line in lines]


GREEDY = {"temperature": 0.0, "max_tokens": NEW_TOKENS, "extra_body": {"ignore_eos": True}}


def test_completions_equal_transformers(served: tuple[Serve, Router, int]) -> None:
    from transformers import AutoTokenizer

    _, router, _ = served
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    api = client(router)
    model = api.models.list().data[0].id
    for prompt in prompts():
        # The router tokenizes a completion's prompt without special tokens (no <s>).
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        (expected,) = hf_greedy(TARGET, [ids], NEW_TOKENS)
        text = tokenizer.decode(expected, skip_special_tokens=True)

        whole = api.completions.create(model=model, prompt=prompt, **GREEDY)
        assert whole.choices[0].text == text
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage is not None
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), NEW_TOKENS)
        # n completions of one prompt (greedy: all the same), each a request at the worker.
        several = api.completions.create(model=model, prompt=prompt, n=2, **GREEDY)
        assert sorted(c.index for c in several.choices) == [0, 1]
        assert [c.text for c in several.choices] == [text, text]

        stream = api.completions.create(
            model=model,
            prompt=prompt,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        pieces, usage = [], None
        for chunk in stream:
            pieces += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        assert "".join(pieces) == text
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), NEW_TOKENS)

        # A stop string: the text ends before it (smg 1.13 matches it at the router).
        stop = text[len(text) // 2 :][:3]
        stopped = api.completions.create(model=model, prompt=prompt, stop=[stop], **GREEDY)
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].text == text[: text.index(stop)]


def test_chat_completions_use_the_template(served: tuple[Serve, Router, int]) -> None:
    from transformers import AutoTokenizer

    _, router, _ = served
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    api = client(router)
    model = api.models.list().data[0].id
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    (expected,) = hf_greedy(TARGET, [ids], NEW_TOKENS)
    text = tokenizer.decode(expected, skip_special_tokens=True)

    whole = api.chat.completions.create(model=model, messages=messages, **GREEDY)  # type: ignore[arg-type]
    assert whole.choices[0].message.content == text
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), NEW_TOKENS)

    stream = api.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    pieces, usage = [], None
    for chunk in stream:
        pieces += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == text
    assert usage is not None and usage.completion_tokens == NEW_TOKENS

    # Logprobs of the chosen tokens when asked for, and the top-N alternatives.
    scored = api.chat.completions.create(
        model=model,
        messages=messages,
        logprobs=True,
        **GREEDY,  # type: ignore[arg-type]
    )
    assert scored.choices[0].logprobs is not None
    content = scored.choices[0].logprobs.content or []
    assert len(content) == NEW_TOKENS and all(t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == text
    top = api.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=2,
        **GREEDY,  # type: ignore[arg-type]
    )
    assert top.choices[0].message.content == text
    alternatives = (top.choices[0].logprobs and top.choices[0].logprobs.content) or []
    assert len(alternatives) == NEW_TOKENS
    for token, chosen in zip(alternatives, content, strict=True):
        assert len(token.top_logprobs) == 2
        first, second = token.top_logprobs  # greedy: the chosen token is the most likely
        assert first.token == chosen.token == token.token
        assert first.logprob == pytest.approx(token.logprob, abs=1e-6)
        assert second.logprob <= first.logprob


def test_a_client_that_goes_away_frees_both_kv_pools(served: tuple[Serve, Router, int]) -> None:
    serve, router, _ = served
    api = client(router)
    model = api.models.list().data[0].id
    stream = api.completions.create(
        model=model,
        prompt="def main():\n",
        stream=True,
        temperature=0.0,
        max_tokens=1500,
        extra_body={"ignore_eos": True},
    )
    received, request_id = 0, ""
    for chunk in stream:
        request_id = chunk.id  # the router's request id, the worker request's too
        received += sum(1 for c in chunk.choices if c.text)
        if received >= 3:
            break
    deadline = time.monotonic() + 30
    while True:  # the target's status and the draft's usage are as last reported: wait
        during = asyncio.run(server_info(serve.port))
        pages = (during.target_kv_usage.pages_used, during.draft_kv_usage.pages_used)
        if during.num_running == 1 and min(pages) > 0:
            break
        assert time.monotonic() < deadline, f"no pages in use: {during}"
        time.sleep(0.1)
    stream.close()  # the client goes away mid-generation
    deadline = time.monotonic() + 60
    while True:
        info = asyncio.run(server_info(serve.port))
        freed = info.target_kv_usage.pages_used == 0 and info.draft_kv_usage.pages_used == 0
        if info.num_running == 0 and freed:
            break
        assert time.monotonic() < deadline, f"not freed: {info}"
        time.sleep(0.2)
    # Aborted, long before 1500 tokens: the router passed the disconnect on.
    log = (serve.log_dir / "gateway.log").read_text()
    assert re.search(rf"request {re.escape(request_id)}: FINISH_REASON_ABORT, \d+ tokens", log)
    again = api.completions.create(model=model, prompt="x = 1\n", max_tokens=4, temperature=0.0)
    assert again.usage is not None and again.usage.completion_tokens <= 4
