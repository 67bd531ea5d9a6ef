"""The services and the health probe parse their flags and environment variables into the
configs they did before the settings were declared once (tandem.settings)."""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.config import DraftConfig, EngineConfig
from tandem.spec.types import SpecConfig

TOKEN = "a-token-long-enough-to-pass"


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No TANDEM_* variable from the caller's shell; root logging as it was (the target's
    parse configures it)."""
    for name in [n for n in os.environ if n.startswith("TANDEM_")]:
        monkeypatch.delenv(name)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def argv(text: str) -> list[str]:
    return shlex.split(text)


def setenv(monkeypatch: pytest.MonkeyPatch, prefix: str, pairs: str) -> None:
    """``pairs``: NAME=VALUE ..., each NAME after ``prefix``."""
    for pair in pairs.split():
        name, value = pair.split("=", 1)
        monkeypatch.setenv(prefix + name, value)


def usage_error(capsys: pytest.CaptureFixture[str], parse: Any, argv: list[str], word: str) -> None:
    with pytest.raises(SystemExit) as done:
        parse(argv)
    assert done.value.code == 2
    assert word in capsys.readouterr().err


# ---- python -m target_service ----


def target(argv: list[str]) -> Any:
    from target_service.__main__ import _config, build_parser

    return _config(build_parser().parse_args(argv))


def test_target_service(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from target_service.__main__ import parse_args
    from target_service.config import TargetServiceConfig

    assert target(["--target", "m"]) == TargetServiceConfig(engine=EngineConfig(model=Path("m")))
    assert target(["--target", "m", "--draft-addr", ""]).draft_addr is None
    given = TargetServiceConfig(
        engine=EngineConfig(
            model=Path("m"),
            page_size=32,
            num_pages=100,
            max_num_seqs=8,
            dtype="bfloat16",
            cuda_graphs=False,
            prefill_graph_tokens=(16, 64),
            spec_policy="adaptive",
            overlap=False,
            device_chain=True,
            transposed_weights=True,
        ),
        host="0.0.0.0",
        port=7,
        draft_addr="h:1",
        draft_kind="mtp",
        spec=SpecConfig(num_steps=4, topk=2, num_draft_tokens=7),
        draft_deadline_s=0.25,
        draft_local_stream=False,
        admission_window_s=0.1,
        admission_gap_s=0.01,
        reflection=True,
        grace_s=3.0,
        metrics_port=9100,
        served_model_name="code-7b",
        vllm_metric_names=True,
    )
    flags = argv(
        "--target m --host 0.0.0.0 --port 7 --draft-addr h:1 --draft-kind mtp --spec-steps 4 "
        "--spec-topk 2 --spec-tokens 7 --draft-deadline 0.25 --no-draft-local-stream "
        "--admission-window 0.1 --admission-gap 0.01 --page-size 32 --num-pages 100 "
        "--max-num-seqs 8 --device cpu --dtype bfloat16 --no-cuda-graphs "
        "--prefill-graph-tokens 16,64 --spec-policy adaptive --no-overlap --device-chain "
        "--transposed-weights --no-batch-invariant --reflection --grace 3 --metrics-port 9100 "
        "--log-level INFO --served-model-name code-7b --vllm-metric-names"
    )
    assert target(flags) == given
    setenv(
        monkeypatch,
        "TANDEM_TARGET_",
        "TARGET=m HOST=0.0.0.0 PORT=7 DRAFT_ADDR=h:1 DRAFT_KIND=mtp SPEC_STEPS=4 "
        "SPEC_TOPK=2 SPEC_TOKENS=7 DRAFT_DEADLINE=0.25 DRAFT_LOCAL_STREAM=0 "
        "ADMISSION_WINDOW=0.1 ADMISSION_GAP=0.01 PAGE_SIZE=32 NUM_PAGES=100 "
        "MAX_NUM_SEQS=8 DEVICE=cpu DTYPE=bfloat16 CUDA_GRAPHS=off "
        "PREFILL_GRAPH_TOKENS=16,64 SPEC_POLICY=adaptive OVERLAP=no DEVICE_CHAIN=yes "
        "TRANSPOSED_WEIGHTS=1 BATCH_INVARIANT=false GRACE=3 METRICS_PORT=9100 "
        "SERVED_MODEL_NAME=code-7b VLLM_METRIC_NAMES=1",
    )
    assert target(["--reflection"]) == given
    assert target(["--port", "8", "--overlap"]).port == 8  # the flag wins
    assert target(["--overlap"]).engine.overlap
    assert target(["--cuda-graphs", "--device", "cuda"]).engine.cuda_graphs
    assert target(["--prefill-graph-tokens", "off"]).engine.prefill_graph_tokens == ()
    monkeypatch.setenv("TANDEM_TARGET_CUDA_GRAPHS", "on")
    monkeypatch.setenv("TANDEM_TARGET_DEVICE", "cuda")
    assert target([]).engine.cuda_graphs is True
    for name in [n for n in os.environ if n.startswith("TANDEM_TARGET_")]:
        monkeypatch.delenv(name)
    usage_error(capsys, parse_args, [], "--target")
    usage_error(capsys, parse_args, ["--target", "m", "--port", "x"], "--port")
    usage_error(capsys, parse_args, ["--target", "m", "--spec-policy", "x"], "--spec-policy")
    usage_error(capsys, parse_args, ["--target", "m", "--draft-kind", "x"], "--draft-kind")
    usage_error(capsys, parse_args, ["--target", "m", "--page-size", "0"], "page_size")
    usage_error(capsys, parse_args, ["--target", "m", "--served-model-name", " "], "served_model")
    spec = ["--draft-addr", "h:1", "--spec-topk", "1", "--spec-tokens", "9"]
    usage_error(capsys, parse_args, ["--target", "m", *spec], "num_draft_tokens")


def test_the_served_model_name_is_never_a_path(tmp_path: Path) -> None:
    from target_service.config import TargetServiceConfig

    def name(model: Path, served: str | None = None) -> str:
        return TargetServiceConfig(
            engine=EngineConfig(model=model), served_model_name=served
        ).model_name

    assert name(tmp_path / "llama-3-8b") == "llama-3-8b"
    assert name(Path("ckpt/llama-3-8b/")) == "llama-3-8b"
    assert name(tmp_path / "llama-3-8b", "llama3") == "llama3"
    family = tmp_path / "tandem-code-ref"  # a family's member is named after the family
    (family / "target").mkdir(parents=True)
    (family / "family.json").write_text("{}")
    assert name(family / "target") == "tandem-code-ref"


# ---- python -m draft_service ----


def test_draft_service(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from draft_service.__main__ import parse_config
    from draft_service.config import DraftServiceConfig

    plain = DraftServiceConfig(draft=DraftConfig(kind="ngram", target=Path("t")))
    assert parse_config(["--target", "t", "--draft-kind", "ngram"]) == plain
    given = DraftServiceConfig(
        draft=DraftConfig(
            kind="mtp",
            path=Path("d"),
            target=Path("t"),
            mtp_mode="target",
            dtype="bfloat16",
            page_size=32,
            num_pages=100,
            cuda_graphs=False,
            transposed_weights=True,
        ),
        host="0.0.0.0",
        port=7,
        max_message_bytes=1 << 20,
        reflection=True,
        grace_s=2.5,
        log_level="DEBUG",
        metrics_port=9100,
        local_socket="/tmp/tandem-test.sock",
        prompt_buffer_mb=0,
    )
    flags = argv(
        "--target t --draft d --draft-kind mtp --mtp-mode target --page-size 32 --num-pages 100 "
        "--device cpu --dtype bfloat16 --no-cuda-graphs --transposed-weights --host 0.0.0.0 "
        "--port 7 --max-message-bytes 1048576 --reflection --prompt-buffer-mb 0 "
        "--local-socket /tmp/tandem-test.sock --grace 2.5 --log-level DEBUG --metrics-port 9100"
    )
    assert parse_config(flags) == given
    setenv(
        monkeypatch,
        "TANDEM_DRAFT_",
        "TARGET=t PATH=d KIND=mtp MTP_MODE=target PAGE_SIZE=32 NUM_PAGES=100 DEVICE=cpu "
        "DTYPE=bfloat16 CUDA_GRAPHS=0 TRANSPOSED_WEIGHTS=1 HOST=0.0.0.0 PORT=7 "
        "MAX_MESSAGE_BYTES=1048576 REFLECTION=1 LOCAL_SOCKET=/tmp/tandem-test.sock "
        "PROMPT_BUFFER_MB=0 GRACE_S=2.5 LOG_LEVEL=DEBUG METRICS_PORT=9100",
    )
    assert parse_config([]) == given
    assert parse_config(["--grace", "4"]).grace_s == 4.0  # the flag wins
    for name in [n for n in os.environ if n.startswith("TANDEM_DRAFT_")]:
        monkeypatch.delenv(name)
    usage_error(capsys, parse_config, [], "--target")
    usage_error(capsys, parse_config, ["--target", "t"], "--draft-kind")
    usage_error(capsys, parse_config, ["--target", "t", "--draft-kind", "x"], "--draft-kind")
    ngram = ["--target", "t", "--draft-kind", "ngram"]
    usage_error(capsys, parse_config, [*ngram, "--dtype", "x"], "--dtype")
    usage_error(capsys, parse_config, [*ngram, "--grace", "-1"], "grace_s")


# ---- python -m gateway ----


def test_gateway(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    from gateway.__main__ import parse_args
    from gateway.config import GatewayConfig

    plain = GatewayConfig(target_addr="h:1", tokenizer=tmp_path)
    assert parse_args(["--target-addr", "h:1", "--tokenizer", str(tmp_path)]) == plain
    given = GatewayConfig(
        target_addr="h:1",
        tokenizer=tmp_path,
        host="127.0.0.1",
        port=0,
        max_running=8,
        max_queue=9,
        two_lane_batch=0,
        reflection=True,
        grace_s=1.5,
        log_level="DEBUG",
        metrics_port=9100,
        auth_tokens=(TOKEN,),
    )
    flags = ["--target-addr", "h:1", "--tokenizer", str(tmp_path), "--host", "127.0.0.1"]
    flags += argv(
        "--port 0 --max-running 8 --max-queue 9 --two-lane-batch 0 --reflection --grace 1.5 "
        "--log-level DEBUG --metrics-port 9100"
    )
    assert parse_args([*flags, "--auth-token", TOKEN]) == given
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# one token\n{TOKEN}\n")
    assert parse_args([*flags, "--auth-token-file", str(tokens)]) == given
    setenv(
        monkeypatch,
        "TANDEM_GATEWAY_",
        f"TARGET_ADDR=h:1 TOKENIZER={tmp_path} HOST=127.0.0.1 PORT=0 MAX_RUNNING=8 "
        f"MAX_QUEUE=9 TWO_LANE_BATCH=0 REFLECTION=on GRACE=1.5 LOG_LEVEL=DEBUG "
        f"METRICS_PORT=9100 AUTH_TOKEN={TOKEN}",
    )
    assert parse_args([]) == given
    assert parse_args(["--max-queue", "3"]).max_queue == 3  # the flag wins
    monkeypatch.delenv("TANDEM_GATEWAY_AUTH_TOKEN")
    monkeypatch.setenv("TANDEM_GATEWAY_AUTH_TOKEN_FILE", str(tokens))
    assert parse_args([]) == given
    for name in [n for n in os.environ if n.startswith("TANDEM_GATEWAY_")]:
        monkeypatch.delenv(name)
    usage_error(capsys, parse_args, [], "--target-addr")
    usage_error(capsys, parse_args, ["--target-addr", "h:1"], "--tokenizer")
    common = ["--target-addr", "h:1", "--tokenizer", str(tmp_path)]
    usage_error(capsys, parse_args, [*common, "--port", "x"], "--port")
    usage_error(capsys, parse_args, [*common, "--max-running", "0"], "max_running")


# ---- python -m tandem.serving.health_probe ----


def test_health_probe(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from tandem.serving.health_probe import build_parser, main

    parsed = vars(build_parser().parse_args(["--address", "h:1"]))
    tls = {"tls_ca": None, "tls_cert": None, "tls_key": None, "tls_server_name": None}
    assert parsed == {"address": "h:1", "service": "", "timeout": 2.0, **tls}
    flags = argv(
        "--address h:2 --service s --timeout 0.5 --tls-ca ca --tls-cert c --tls-key k "
        "--tls-server-name n"
    )
    given = {"address": "h:2", "service": "s", "timeout": 0.5, "tls_ca": Path("ca")}
    given |= {"tls_cert": Path("c"), "tls_key": Path("k"), "tls_server_name": "n"}
    assert vars(build_parser().parse_args(flags)) == given
    setenv(
        monkeypatch,
        "TANDEM_PROBE_",
        "ADDRESS=h:2 SERVICE=s TIMEOUT=0.5 TLS_CA=ca TLS_CERT=c TLS_KEY=k TLS_SERVER_NAME=n",
    )
    assert vars(build_parser().parse_args([])) == given
    assert build_parser().parse_args(["--service", "t"]).service == "t"  # the flag wins
    for name in [n for n in os.environ if n.startswith("TANDEM_PROBE_")]:
        monkeypatch.delenv(name)
    assert main([]) == 1  # no address: unhealthy, never Docker's 2
    assert "--address" in capsys.readouterr().err
    monkeypatch.setenv("TANDEM_PROBE_TIMEOUT", "soon")
    assert main(["--address", "h:1"]) == 1
    assert "TANDEM_PROBE_TIMEOUT" in capsys.readouterr().out
