"""What the hand-offs of a speculative cycle between two processes on one GPU cost, and what
they would cost if they stayed on the device (docs/architecture.md, "Not built yet").

Two processes on one GPU play target and draft. Each cycle the target runs a "verify" CUDA
graph of about ``--verify-ms`` and the draft a "draft" graph of about ``--draft-ms``:
matrix-vector products over a 1 GiB bf16 weight, memory-bound as bs-1 decoding is. The target's
graph writes the message the draft reads (``--features-bytes``, the accepted path's features)
and the draft's graph writes the tree the target reads next (``--tree-tokens`` ids).

- ``single``: both graphs in one process, one stream, back to back: the floor.
- ``host``: hand-offs as the services make them: a side waits for its graph (synchronize),
  copies its message to pinned host memory and writes it to a Unix socket; the other side
  copies it to the device and replays. (The services add protobuf and Python bookkeeping.)
- ``ipc``: the messages stay on the device, in buffers the target allocates and the draft maps
  (CUDA IPC); each side records an interprocess event after its replay and, as soon as that is
  *enqueued*, sends one byte; the other side enqueues a wait on that event, then its replay.
  No host waits for the GPU inside a cycle; each side runs at most ``--ahead`` cycles ahead of
  its GPU (as a real one must, to read what leaves the process).

Prints cycle ms, idle (1 - (verify + draft) / cycle, with each graph timed alone), and the
cycle over the floor. CUDA only; no pickle crosses the socket, only raw bytes: IPC handles
(``tandem/link/ipc.py``), the messages, one-byte notices.

    python bench/ipc_handoff.py [--cycles 300] [--verify-ms 6.2] [--draft-ms 1.1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.link import ipc

_send, _recv = ipc.send_frame, ipc.recv_frame
ROWS, COLS = 32768, 16384  # a 1 GiB bf16 weight: every pass streams it from HBM (L2 is 50 MiB)
HEADER = struct.Struct("<Q")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--role", choices=["target", "draft"], default="target", help=argparse.SUPPRESS)
    p.add_argument("--socket", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["host", "ipc"], help=argparse.SUPPRESS)
    p.add_argument("--passes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--cycles", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--verify-ms", type=float, default=6.2)
    p.add_argument("--draft-ms", type=float, default=1.1)
    p.add_argument("--features-bytes", type=int, default=3 * 3 * 4096 * 2)  # 3 tokens, EAGLE-3
    p.add_argument("--tree-tokens", type=int, default=4)
    p.add_argument("--ahead", type=int, default=2)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.features_bytes > ipc.MAX_FRAME:
        p.error(f"--features-bytes: at most {ipc.MAX_FRAME} (one frame on the socket)")
    if not torch.cuda.is_available():
        sys.exit("ipc_handoff: needs a CUDA device")
    torch.cuda.set_device(0)
    if a.role == "draft":
        _draft(a)
        return
    one = _time_alone(_Probe())  # ms of one 1 GiB pass
    passes = {
        side: max(1, round(ms / one))
        for side, ms in (("verify", a.verify_ms), ("draft", a.draft_ms))
    }
    alone = {side: _time_alone(Side(n, *_messages(a))) for side, n in passes.items()}
    results: dict[str, float] = {"single": _single(a, passes["verify"], passes["draft"])}
    for mode in ("host", "ipc"):
        results[mode] = _two_processes(a, mode, passes)
    work = alone["verify"] + alone["draft"]
    report = {
        "device": torch.cuda.get_device_name(0),
        "verify_ms": alone["verify"],
        "draft_ms": alone["draft"],
        "cycle_ms": results,
        "idle": {mode: 1 - work / ms for mode, ms in results.items()},
    }
    if a.json:
        print(json.dumps(report, indent=1))
        return
    print(
        f"{report['device']}: verify {alone['verify']:.3f} ms ({passes['verify']} passes), "
        f"draft {alone['draft']:.3f} ms ({passes['draft']}) alone; {a.cycles} cycles a mode"
    )
    print(f"{'mode':>8} {'cycle ms':>9} {'idle':>6} {'vs single':>9}")
    for mode, ms in results.items():
        print(f"{mode:>8} {ms:9.3f} {1 - work / ms:6.1%} {ms / results['single']:9.3f}")


class Side:
    """One side's graph: ``passes`` matrix-vector products over its own 1 GiB weight, reading
    ``inbox`` (what the other side wrote) and writing ``outbox`` (what it will read)."""

    def __init__(self, passes: int, inbox: torch.Tensor, outbox: torch.Tensor) -> None:
        gen = torch.Generator(device="cuda").manual_seed(passes)
        self.weight = torch.randn(ROWS, COLS, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.weight.mul_(COLS**-0.5)
        self.x = torch.zeros(COLS, device="cuda", dtype=torch.bfloat16)
        self.inbox, self.outbox = inbox, outbox
        self.passes = passes
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._body()  # warm-up outside the capture (cuBLAS picks its kernel)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph):
            self._body()
        torch.cuda.synchronize()

    def _body(self) -> None:
        n = min(self.inbox.numel(), COLS)
        self.x[:n] += self.inbox[:n].to(torch.bfloat16)  # depends on the other side's message
        y = self.x
        for _ in range(self.passes):
            y = torch.mv(self.weight, y[:COLS])
        self.x.copy_(y[:COLS] * 1e-3)
        flat = y.view(torch.uint8)
        m = min(self.outbox.numel(), flat.numel())
        self.outbox[:m].copy_(flat[:m])

    def replay(self) -> None:
        self.graph.replay()


class _Probe:
    def __init__(self) -> None:
        self.weight = torch.randn(ROWS, COLS, device="cuda", dtype=torch.bfloat16)
        self.x = torch.randn(COLS, device="cuda", dtype=torch.bfloat16)

    def replay(self) -> None:
        torch.mv(self.weight, self.x)


def _time_alone(side: Side | _Probe, reps: int = 50) -> float:
    """Median ms of one replay, the GPU doing nothing else."""
    for _ in range(5):
        side.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        side.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _messages(a: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The two messages of a cycle on the device: the tree (target's inbox) and the accepted
    path's features (the draft's)."""
    tree = torch.zeros(a.tree_tokens * 8, device="cuda", dtype=torch.uint8)
    features = torch.zeros(a.features_bytes, device="cuda", dtype=torch.uint8)
    return tree, features


def _single(a: argparse.Namespace, verify_passes: int, draft_passes: int) -> float:
    """Both graphs in this process, back to back on one stream: ms per cycle."""
    tree, features = _messages(a)
    verify = Side(verify_passes, inbox=tree, outbox=features)
    draft = Side(draft_passes, inbox=features, outbox=tree)

    def cycle() -> None:
        verify.replay()
        draft.replay()

    return _timed(a, cycle)


def _timed(a: argparse.Namespace, cycle: Callable[[], None]) -> float:
    """ms per cycle over ``a.cycles`` after ``a.warmup``. In the ipc mode this process's
    stream ends waiting on the draft's last event, so its synchronize covers both."""
    for _ in range(a.warmup):
        cycle()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(a.cycles):
        cycle()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / a.cycles


# -- two processes ---------------------------------------------------------------------------


def _two_processes(a: argparse.Namespace, mode: str, passes: dict[str, int]) -> float:
    """The target here, the draft in a child process: ms per cycle."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "handoff.sock"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        server.listen(1)
        child = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                *("--role", "draft", "--socket", str(path), "--mode", mode),
                *("--cycles", str(a.cycles), "--warmup", str(a.warmup)),
                *("--passes", str(passes["draft"]), "--features-bytes", str(a.features_bytes)),
                *("--tree-tokens", str(a.tree_tokens), "--ahead", str(a.ahead)),
            ]
        )
        try:
            server.settimeout(120)
            conn, _ = server.accept()
            conn.settimeout(None)
            with conn:
                _buffers(conn)
                return _target(a, mode, conn, passes["verify"])
        finally:
            child.wait(timeout=120)
            server.close()


def _target(a: argparse.Namespace, mode: str, conn: socket.socket, passes: int) -> float:
    tree, features = _messages(a)
    if mode == "ipc":
        # The draft maps both buffers and records its own event; one notice each way a cycle.
        mine = torch.cuda.Event(interprocess=True)
        mine.record()
        for item in (ipc.describe(features), ipc.describe(tree), mine.ipc_handle()):
            _send(conn, item)
        theirs = ipc.open_event(_recv(conn))
    verify = Side(passes, inbox=tree, outbox=features)
    _send(conn, b"ready")
    assert _recv(conn) == b"ready"
    if mode == "host":
        out_host = torch.empty(a.features_bytes, dtype=torch.uint8).pin_memory()
        in_host = torch.empty(tree.numel(), dtype=torch.uint8).pin_memory()

        def cycle() -> None:
            verify.replay()
            out_host.copy_(features, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            _send(conn, out_host.numpy().tobytes())
            _recv_into(conn, in_host)
            tree.copy_(in_host, non_blocking=True)

        return _timed(a, cycle)
    pacer = _Pacer(a.ahead)

    def cycle_ipc() -> None:
        pacer.wait()
        verify.replay()
        mine.record()
        conn.sendall(b"v")
        ipc.recv_exactly(conn, 1)
        torch.cuda.current_stream().wait_event(theirs)
        pacer.mark()

    return _timed(a, cycle_ipc)


def _draft(a: argparse.Namespace) -> None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(a.socket))
    _buffers(conn)
    passes = a.passes
    total = a.warmup + a.cycles  # as the target's _timed runs them
    if a.mode == "ipc":
        features = ipc.open_buffer(_recv(conn), (a.features_bytes,), torch.uint8)
        tree = ipc.open_buffer(_recv(conn), (a.tree_tokens * 8,), torch.uint8)
        theirs = ipc.open_event(_recv(conn))
        mine = torch.cuda.Event(interprocess=True)
        mine.record()
        _send(conn, mine.ipc_handle())
        draft = Side(passes, inbox=features, outbox=tree)
        _send(conn, b"ready")
        assert _recv(conn) == b"ready"
        pacer = _Pacer(a.ahead)
        for _ in range(total):
            ipc.recv_exactly(conn, 1)
            pacer.wait()
            torch.cuda.current_stream().wait_event(theirs)
            draft.replay()
            mine.record()
            conn.sendall(b"d")
            pacer.mark()
    else:
        tree, features = _messages(a)
        draft = Side(passes, inbox=features, outbox=tree)
        in_host = torch.empty(a.features_bytes, dtype=torch.uint8).pin_memory()
        out_host = torch.empty(tree.numel(), dtype=torch.uint8).pin_memory()
        _send(conn, b"ready")
        assert _recv(conn) == b"ready"
        for _ in range(total):
            _recv_into(conn, in_host)
            features.copy_(in_host, non_blocking=True)
            draft.replay()
            out_host.copy_(tree, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            _send(conn, out_host.numpy().tobytes())
    torch.cuda.synchronize()
    conn.close()


class _Pacer:
    """Keeps the host at most ``ahead`` cycles ahead of its GPU (an event per cycle)."""

    def __init__(self, ahead: int) -> None:
        self.ahead = ahead
        self.events: list[torch.cuda.Event] = []

    def wait(self) -> None:
        if len(self.events) >= self.ahead:
            self.events.pop(0).synchronize()

    def mark(self) -> None:
        event = torch.cuda.Event()
        event.record()
        self.events.append(event)


# -- the socket ------------------------------------------------------------------------------


def _buffers(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)


def _recv_into(conn: socket.socket, host: torch.Tensor) -> None:
    (n,) = HEADER.unpack(ipc.recv_exactly(conn, HEADER.size))
    if n != host.numel():
        raise ValueError(f"expected {host.numel()} bytes, got {n}")
    view = host.numpy().data.cast("B")
    got = 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("peer closed")
        got += k


if __name__ == "__main__":
    main()
