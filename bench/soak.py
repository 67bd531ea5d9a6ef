"""A soak run against a gateway: N concurrent clients for a duration, mixed greedy and sampled
requests, some cancelled mid-stream; reports requests, errors by status code, TTFT and total
latency percentiles, each service process's RSS and both KV pools at start and end
(GetServerInfo), as a table and as JSON.

    python bench/soak.py --duration 60 --clients 8            # starts `tandem serve` itself
    python bench/soak.py --address 127.0.0.1:50051 --pid gateway=1234 --duration 300

Without ``--address`` it starts ``tandem serve`` (the embedded model unless ``--target`` is
given) on free ports and stops it afterwards; the services' PIDs are then known. docs/
operations.md ("Soak runs") says what to look for.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tandem.serving.rpc import channel_options
from tandem.v1 import gateway_pb2, gateway_pb2_grpc

CANCEL_SHARE = 0.15  # requests cancelled after their first chunk


@dataclass
class Results:
    codes: Counter[str] = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)
    total_s: list[float] = field(default_factory=list)
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        out += [int(p) for p in task.read_text().split()]
    return out


def _service_pids(root: int) -> dict[str, int]:
    """The gateway, target and draft processes under ``tandem serve`` (by their modules)."""
    pids: dict[str, int] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += _children(pid)
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for name, module in (("gateway", b"gateway"), ("target", b"target_service")):
            if module in cmd:
                pids[name] = pid
        if b"draft_service" in cmd:
            pids["draft"] = pid
    return pids


def _snapshot(stub: Any, pids: dict[str, int]) -> dict[str, Any]:
    info = stub.GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=10)
    return {
        "rss_mib": {name: _rss_mib(pid) for name, pid in pids.items()},
        "target_pages_used": info.target_kv_usage.pages_used,
        "target_pages_total": info.target_kv_usage.pages_total,
        "draft_pages_used": info.draft_kv_usage.pages_used,
        "draft_pages_total": info.draft_kv_usage.pages_total,
        "running": info.num_running,
        "waiting": info.num_waiting,
    }


def _client(stub: Any, seed: int, until: float, max_new: int, results: Results) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=[rng.randrange(10, 500) for _ in range(16)])
        )
        request.sampling.max_new_tokens = rng.randint(max_new // 2, max_new)
        if rng.random() < 0.5:
            request.sampling.temperature = 0.0
        else:
            request.sampling.temperature, request.sampling.top_p = 0.8, 0.95
        cancel = rng.random() < CANCEL_SHARE
        started = time.monotonic()
        ttft = None
        tokens = 0
        call = stub.Generate(request, timeout=120)
        try:
            for response in call:
                if response.HasField("chunk"):
                    tokens += len(response.chunk.token_ids)
                    ttft = ttft if ttft is not None else time.monotonic() - started
                    if cancel:
                        call.cancel()
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name  # type: ignore[attr-defined]
        with results.lock:
            results.codes[code] += 1
            results.tokens += tokens
            if code == "OK":
                results.total_s.append(time.monotonic() - started)
                if ttft is not None:
                    results.ttft_s.append(ttft)


def _percentiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {}
    q = statistics.quantiles(values, n=100)
    return {"p50": q[49] * 1e3, "p90": q[89] * 1e3, "p99": q[98] * 1e3, "max": max(values) * 1e3}


def _start_serve(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cli = "from tandem.apps.cli import app; app()"  # the `tandem` command
    cmd = [sys.executable, "-c", cli, "serve", "--gateway-port", str(port)]
    cmd += ["--target-port", str(_free_port()), "--draft-port", str(_free_port())]
    if args.target:
        cmd += ["--target", args.target]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {proc.returncode}")
            try:
                info = stub.GetServerInfo(gateway_pb2.GetServerInfoRequest(), timeout=2)
                if info.target_connected and info.draft_state == 3:  # HEALTHY
                    return proc, address
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("tandem serve did not come up in 300 s")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", help="a running gateway; without it, start `tandem serve`")
    p.add_argument("--target", help="checkpoint for the started `tandem serve`")
    p.add_argument("--pid", action="append", default=[], help="NAME=PID of a service, for RSS")
    p.add_argument("--duration", type=float, default=60.0, help="seconds")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    proc = None
    address = args.address
    if address is None:
        proc, address = _start_serve(args)
    pids = dict(item.split("=", 1) for item in args.pid)
    service_pids = {k: int(v) for k, v in pids.items()}
    if proc is not None:
        service_pids = _service_pids(proc.pid)
    try:
        with grpc.insecure_channel(address, options=channel_options()) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            start = _snapshot(stub, service_pids)
            results = Results()
            until = time.monotonic() + args.duration
            threads = [
                threading.Thread(
                    target=_client, args=(stub, n, until, args.max_new_tokens, results)
                )
                for n in range(args.clients)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            time.sleep(1.0)  # the last aborts reach the pools
            end = _snapshot(stub, service_pids)
    finally:
        if proc is not None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(60)
    report = {
        "address": address,
        "duration_s": args.duration,
        "clients": args.clients,
        "requests": sum(results.codes.values()),
        "codes": dict(results.codes),
        "tokens": results.tokens,
        "ttft_ms": _percentiles(results.ttft_s),
        "total_ms": _percentiles(results.total_s),
        "start": start,
        "end": end,
    }
    _print_table(report)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return report


def _print_table(r: dict[str, Any]) -> None:
    print(f"{r['requests']} requests in {r['duration_s']:.0f} s, {r['clients']} clients")
    print("codes: " + ", ".join(f"{k} {v}" for k, v in sorted(r["codes"].items())))
    for name in ("ttft_ms", "total_ms"):
        row = "  ".join(f"{k} {v:8.1f}" for k, v in r[name].items())
        print(f"{name:9} {row}")
    print(f"{'':22}{'start':>10}{'end':>10}")
    keys = ["target_pages_used", "draft_pages_used", "running", "waiting"]
    for key in keys:
        print(f"{key:22}{r['start'][key]:>10}{r['end'][key]:>10}")
    for name, rss in r["start"]["rss_mib"].items():
        after = r["end"]["rss_mib"].get(name)
        print(f"{'rss ' + name + ' MiB':22}{rss or 0:>10.0f}{after or 0:>10.0f}")


if __name__ == "__main__":
    main()
