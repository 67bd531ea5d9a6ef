"""Device-chain steps across two processes on one GPU, with the benchmark's model shapes:
docs/device-cycle.md's stage 3 without the services' control plane.

This process is the target: the preset's 8B-shaped target with its verify bucket, one request
prefilled, and the target half of device-chain steps (``tandem/target/chain_verify.py``). A child
process is the draft: the preset's EAGLE-3 head with its draft graphs, the same request
admitted (random prompt features: acceptance is simulated), and the draft half
(``tandem/draft/chain_draft.py``). They hand off through the halves' own buffers shared with
CUDA IPC (``tandem/link/ipc.py``: ``Outcome`` allocated by the draft, ``Chains`` by the
target) and one interprocess event a side: a side records its event after its half and sends
one byte; the other enqueues a wait on that event, then its half. No host waits for the GPU
inside a cycle; the target reads each verdict a step late, as the engine does.

Prints the cycle, each half's GPU time (timing events around each half, on its own stream),
the GPU's idle share of the cycle, tokens per second at the simulated accept length, and that
over ``accept / t_verify`` (the verify bucket replayed alone). CUDA only; raw bytes on the
socket, never pickle.

    python bench/chain_ipc.py [--models-dir DIR] [--cycles 300] [--simulate-accept-length 3.0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.bench.models import write_preset
from tandem.bench.presets import PRESETS
from tandem.config import DraftConfig, EngineConfig
from tandem.draft.build import build_drafter
from tandem.draft.drafter import ModelDrafter
from tandem.link import ipc
from tandem.sampling import SamplingParams
from tandem.spec.chain import Chains, Outcome
from tandem.spec.simulate import AcceptSimulator
from tandem.spec.types import DraftAdmit, SpecConfig, Tree
from tandem.target.chain_verify import TargetChain
from tandem.target.engine import Engine

PAGES = 512  # each pool, 16-token pages: far more than one request's cycles need


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--role", choices=["target", "draft"], default="target", help=argparse.SUPPRESS)
    p.add_argument("--socket", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/tandem-bench-models"))
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    p.add_argument("--cycles", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--spec-steps", type=int, default=3)
    p.add_argument("--simulate-accept-length", type=float, default=3.0)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("chain_ipc: needs a CUDA device")
    torch.cuda.set_device(0)
    preset = PRESETS[a.preset]
    root = a.models_dir / f"{preset.name}-{preset.dtype}"
    if a.role == "draft":
        _draft(a, root)
        return
    write_preset(preset, root, device="cuda")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chain.sock"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        server.listen(1)
        args = argv if argv is not None else sys.argv[1:]
        script = os.path.abspath(__file__)
        child = subprocess.Popen(
            [sys.executable, script, "--role", "draft", "--socket", str(path), *args]
        )
        try:
            server.settimeout(600)
            conn, _ = server.accept()
            conn.settimeout(None)
            with conn:
                report = _target(a, root, conn)
        finally:
            child.wait(timeout=120)
            server.close()
    if a.json:
        print(json.dumps(report, indent=1))
        return
    print(
        f"{report['device']}: {a.cycles} cycles, S={a.spec_steps}, simulated accept length "
        f"{a.simulate_accept_length} (measured {report['accept_length']:.2f})"
    )
    for key in ("cycle_ms", "target_half_ms", "draft_half_ms", "verify_alone_ms"):
        print(f"  {key:<18} {report[key]:8.3f}")
    print(f"  {'gpu idle':<18} {report['idle']:8.1%}")
    print(f"  {'tok/s':<18} {report['tokens_per_s']:8.1f}")
    print(f"  {'of accept/t_verify':<18} {report['of_light']:8.1%}")


def _target(a: argparse.Namespace, root: Path, conn: socket.socket) -> dict[str, object]:
    s, w = a.spec_steps, a.spec_steps + 1
    frame = ipc.recv_frame(conn)
    layers = struct.unpack(f"<{len(frame) // 8}q", frame)
    config = EngineConfig(
        model=root / "target",
        dtype=PRESETS[a.preset].dtype,
        device="cuda",
        max_num_seqs=1,
        max_model_len=a.max_model_len,
        num_pages=PAGES,
        cuda_graph_batch_sizes=(1,),
    )
    engine = Engine(config)
    graphs = engine.runner.enable_graphs(
        batch_sizes=(1,), widths=(1, w), max_model_len=engine.max_model_len, capture_layers=layers
    )
    rng = random.Random(0)
    prompt = [rng.randrange(3, engine.model.config.vocab_size) for _ in range(a.prompt_len)]
    params = SamplingParams(max_new_tokens=a.max_model_len - a.prompt_len - 1, ignore_eos=True)
    engine.add_request(prompt, params)
    engine.step()  # the prompt, and the first token
    req = engine.scheduler.running[0]
    ipc.send_frame(conn, struct.pack(f"<{req.num_tokens}q", *req.tokens))
    req.tree = Tree(tokens=(req.tokens[-1],), parents=(-1,))
    half = TargetChain(graphs, engine.kv, s, AcceptSimulator(a.simulate_accept_length, s))
    bucket = graphs.bucket_for(1, w)
    assert bucket is not None and half.reserve([(req.request_id, req.num_tokens)], 0)
    chains = half.begin([req], bucket)
    for tensor in (chains.tokens, chains.valid):
        ipc.send_frame(conn, ipc.describe(tensor))
    described = [ipc.recv_frame(conn) for _ in range(5)]
    width = len(layers) * engine.model.config.hidden_size
    dtype = graphs.features.dtype if graphs.features is not None else torch.bfloat16
    half.outcome = Outcome(
        base=ipc.open_buffer(described[0], (1,), torch.int64),
        accepted=ipc.open_buffer(described[1], (1,), torch.int64),
        new=ipc.open_buffer(described[2], (1, w), torch.int64),
        alive=ipc.open_buffer(described[3], (1,), torch.bool),
        features=ipc.open_buffer(described[4], (w, width), dtype),
    )
    mine = torch.cuda.Event(interprocess=True)
    mine.record()
    ipc.send_frame(conn, mine.ipc_handle())
    theirs = ipc.open_event(ipc.recv_frame(conn))
    verify_ms = _alone(lambda: graphs.replay(bucket))
    stream = torch.cuda.current_stream()
    timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    tokens = steps = 0
    started = 0.0
    for cycle in range(a.warmup + a.cycles):
        if cycle == a.warmup:
            torch.cuda.synchronize()
            started, tokens, steps = time.perf_counter(), 0, 0
        row = (req.request_id, req.num_tokens)
        assert half.reserve([row], len(half.unread)), "target pool full"
        begin, end = _timing_pair()
        begin.record()
        half.launch()
        end.record()
        mine.record()
        conn.sendall(b"v")
        ipc.recv_exactly(conn, 1)
        stream.wait_event(theirs)
        if cycle >= a.warmup:
            timings.append((begin, end))
        if len(half.unread) >= 2:
            tokens, steps = _read(half, req, tokens, steps)
    while half.unread:
        tokens, steps = _read(half, req, tokens, steps)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    draft_ms = struct.unpack("<d", ipc.recv_frame(conn))[0]
    half.outcome = None  # the draft's memory: unmapped before the draft exits
    torch.cuda.synchronize()
    ipc.send_frame(conn, b"bye")
    cycle_ms = elapsed * 1e3 / a.cycles
    target_ms = _median([b.elapsed_time(e) for b, e in timings])
    accept = tokens / steps
    return {
        "device": torch.cuda.get_device_name(0),
        "cycles": a.cycles,
        "cycle_ms": cycle_ms,
        "target_half_ms": target_ms,
        "draft_half_ms": draft_ms,
        "verify_alone_ms": verify_ms,
        "idle": 1 - (target_ms + draft_ms) / cycle_ms,
        "accept_length": accept,
        "tokens_per_s": tokens / elapsed,
        "of_light": (tokens / elapsed) / (accept / verify_ms * 1e3),
    }


def _read(half: TargetChain, req: object, tokens: int, steps: int) -> tuple[int, int]:
    """Reads the oldest unread step; its tokens join the request (its KV length grows)."""
    (verdict,) = half.read(1)
    req.output_ids.extend(verdict.new_tokens)  # type: ignore[attr-defined]
    return tokens + len(verdict.new_tokens), steps + 1


def _draft(a: argparse.Namespace, root: Path) -> None:
    s, w = a.spec_steps, a.spec_steps + 1
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(a.socket))
    config = DraftConfig(
        kind="eagle3",
        path=root / "eagle3",
        target=root / "target",
        dtype=PRESETS[a.preset].dtype,
        device="cuda",
        num_pages=PAGES,
    )
    num_layers = int(PRESETS[a.preset].target["num_hidden_layers"])
    drafter = build_drafter(config, num_layers)
    assert isinstance(drafter, ModelDrafter)
    drafter.enable_graphs(batch_sizes=(1,), max_model_len=a.max_model_len, num_steps=(s,))
    layers = drafter.target_layer_ids
    ipc.send_frame(conn, struct.pack(f"<{len(layers)}q", *layers))
    frame = ipc.recv_frame(conn)
    tokens = list(struct.unpack(f"<{len(frame) // 8}q", frame))
    graphs = drafter.graphs
    assert graphs is not None
    width = graphs.extends[next(iter(graphs.extends))].features.shape[-1]  # type: ignore[union-attr]
    features = torch.randn(len(tokens) - 1, width, device="cuda", dtype=graphs.hidden_dtype)
    spec = SpecConfig(num_steps=s, topk=1)
    admit = DraftAdmit(request_id="r", token_ids=tokens, features=features, spec=spec)
    drafter.step([admit], [], [])
    half = drafter.chain_half(s, torch.device("cuda"))
    half.request_ids = ["r"]
    assert half.reserve([len(tokens)], 0)
    bucket = next(b for b in graphs.extends if b.batch_size == 1 and b.width == w)
    outcome = half.begin(["r"], bucket)
    assert outcome.features is not None
    for tensor in (outcome.base, outcome.accepted, outcome.new, outcome.alive, outcome.features):
        ipc.send_frame(conn, ipc.describe(tensor))
    half.chains = Chains(
        tokens=ipc.open_buffer(ipc.recv_frame(conn), (1, w), torch.int64),
        valid=ipc.open_buffer(ipc.recv_frame(conn), (1, s), torch.bool),
    )
    theirs = ipc.open_event(ipc.recv_frame(conn))
    mine = torch.cuda.Event(interprocess=True)
    mine.record()
    ipc.send_frame(conn, mine.ipc_handle())
    stream = torch.cuda.current_stream()
    timings = []
    for cycle in range(a.warmup + a.cycles):
        ipc.recv_exactly(conn, 1)
        # An upper bound of the committed length: S+1 tokens a step (capacity only).
        assert half.reserve([len(tokens) + (cycle + 1) * w], 0), "draft pool full"
        stream.wait_event(theirs)
        begin, end = _timing_pair()
        begin.record()
        half.launch()
        end.record()
        mine.record()
        conn.sendall(b"d")
        if cycle >= a.warmup:
            timings.append((begin, end))
    torch.cuda.synchronize()
    draft_ms = _median([b.elapsed_time(e) for b, e in timings])
    ipc.send_frame(conn, struct.pack("<d", draft_ms))
    half.chains = None
    torch.cuda.synchronize()
    assert ipc.recv_frame(conn) == b"bye"
    conn.close()


def _timing_pair() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _alone(replay: object, reps: int = 30) -> float:
    """Median ms of one call of ``replay``, the GPU doing nothing else."""
    times = []
    for _ in range(reps):
        begin, end = _timing_pair()
        torch.cuda.synchronize()
        begin.record()
        replay()  # type: ignore[operator]
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return _median(times)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


if __name__ == "__main__":
    main()
