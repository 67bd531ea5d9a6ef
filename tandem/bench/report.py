"""What one benchmark row measured, and how rows are printed (fixed-width, vLLM/SGLang-style
labels), serialised (``--json``) and plotted (``--plot DIR``)."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MODES = (
    "target-only",
    "target-sync",
    "spec",
    "spec-chain",
    "k0",
    "services",
    "services-control",
    "services-chain",
    "services-chain-control",
    "services-grpc",
    "hf-generate",
    "hf-assisted",
)


@dataclass(kw_only=True)
class Row:
    """One mode at one batch size. Times in ms; None where the mode cannot measure it."""

    mode: str  # one of MODES
    batch_size: int
    num_requests: int = 0
    output_tokens: int = 0
    duration_s: float = 0.0
    tokens_per_s: float | None = None  # output tokens / wall time (prefill included)
    accept_length: float | None = None  # tokens per verify step, bonus included
    acceptance_per_position: list[float] = field(default_factory=list)  # accepted / drafted
    # The mean accept length forced on the target (tandem.spec.simulate), where simulated.
    simulated_accept_length: float | None = None
    tree_fraction: float | None = None  # decode steps that verified a tree / all decode steps
    without_tree: dict[str, int] = field(default_factory=dict)  # the other steps, by cause
    tpot_p50_ms: float | None = None  # per request: (last - first token time) / (tokens - 1)
    tpot_p99_ms: float | None = None
    ttft_p50_ms: float | None = None
    cycle_ms: float | None = None  # median decode step
    draft_ms: float | None = None  # median draft model time per step
    verify_ms: float | None = None  # median target forward per step
    wire_host_ms: float | None = None  # median cycle - verify - draft
    t_verify_min_ms: float | None = None  # speed-of-light verify (sol.py)
    verify_efficiency: float | None = None  # t_verify_min / verify
    sol_fraction: float | None = None  # (1 / tpot_p50) / (accept_length / t_verify_min)
    idle_per_device: list[float] = field(default_factory=list)  # GPU idle fraction, by device
    gpu_idle: dict[str, Any] | None = None  # the profiled round's tandem.bench.idle report
    # Where target and draft take turns on one GPU (the profiled round): the target's turn,
    # its verify step as the GPU ran it, and the period between its starts, the true cycle.
    verify_turn_ms: float | None = None
    turn_period_ms: float | None = None
    note: str = ""

    def finish(self, t_verify_min_s: float | None) -> Row:
        """Fills the speed-of-light columns from the measured ones."""
        if t_verify_min_s is None:
            return self
        self.t_verify_min_ms = t_verify_min_s * 1e3
        if self.verify_ms:
            self.verify_efficiency = self.t_verify_min_ms / self.verify_ms
        plain = ("target-only", "target-sync", "hf-generate")
        a = self.accept_length or (1.0 if self.mode in plain else None)
        if a and self.tpot_p50_ms:
            self.sol_fraction = (1.0 / self.tpot_p50_ms) / (a / self.t_verify_min_ms)
        return self


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median_ms(values_ns: list[int]) -> float | None:
    return statistics.median(values_ns) / 1e6 if values_ns else None


_COLUMNS: list[tuple[str, str, int]] = [  # (field, header, width)
    ("mode", "mode", 16),
    ("batch_size", "bs", 4),
    ("tokens_per_s", "tok/s", 9),
    ("accept_length", "accept", 6),
    ("tree_fraction", "tree", 5),
    ("acceptance_per_position", "acc/pos", 17),
    ("tpot_p50_ms", "TPOT p50", 9),
    ("tpot_p99_ms", "TPOT p99", 9),
    ("cycle_ms", "cycle", 7),
    ("draft_ms", "draft", 7),
    ("verify_ms", "verify", 7),
    ("wire_host_ms", "wire+host", 9),
    ("t_verify_min_ms", "t_v_min", 7),
    ("verify_efficiency", "v_eff", 5),
    ("sol_fraction", "SOL", 5),
    ("note", "note", 0),
]
_SIMULATED = ("simulated_accept_length", "sim", 4)  # only in a run with simulated acceptance
_IDLE_COLUMNS = [  # only in a run with --profile-idle
    ("idle_per_device", "GPU idle", 9),
    ("verify_turn_ms", "v_turn", 7),
    ("turn_period_ms", "period", 7),
]


def _cell(value: Any, width: int) -> str:
    if value is None or value == []:
        text = "-"
    elif isinstance(value, list):
        text = "/".join(f"{v:.2f}" for v in value[:4]) + ("/.." if len(value) > 4 else "")
    elif isinstance(value, float):
        text = f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}"
    else:
        text = str(value)
    return text.rjust(width) if width else text


def table(rows: list[Row], header: dict[str, Any]) -> str:
    """The run's settings as a vLLM-style block, then one fixed-width line per row."""
    title = " Tandem Benchmark Result "
    lines = [f"{title:=^72}"]
    lines += [f"{k + ':':<40} {v!s:<10}".rstrip() for k, v in header.items()]
    lines.append("-" * 72)
    columns = list(_COLUMNS)
    simulated = any(r.simulated_accept_length for r in rows)
    if simulated:
        columns.insert(columns.index(("accept_length", "accept", 6)) + 1, _SIMULATED)
    profiled = any(r.idle_per_device for r in rows)
    if profiled:
        columns = [*columns[:-1], *_IDLE_COLUMNS, columns[-1]]
    lines.append(" ".join(_cell(h, w) if w else h for _, h, w in columns))
    for row in rows:
        values = asdict(row)
        values["note"] = _note(row)
        lines.append(" ".join(_cell(values[f], w) for f, _, w in columns).rstrip())
    lines.append(
        "times in ms; acc/pos = accepted / drafted per draft position; tree = decode steps "
        "that verified a tree (no tree: the others by cause); see docs"
    )
    if simulated:
        lines.append("sim = the simulated accept length forced on the target (perf only)")
    if profiled:
        lines.append(
            "GPU idle = idle fraction of each GPU over a profiled round (tandem.bench.idle); "
            "v_turn, period = the target's turn on a GPU it shares with the draft, and the "
            "period between its starts"
        )
    lines += ratios(rows)
    lines.append("=" * 72)
    return "\n".join(lines)


def ratios(rows: list[Row]) -> list[str]:
    """Each mode's tok/s over target-only's at the same batch size, and every services
    mode's over in-process speculation's (``spec``); [] without target-only rows."""
    rates = {(r.mode, r.batch_size): r.tokens_per_s for r in rows if r.tokens_per_s}
    sizes = sorted({bs for mode, bs in rates if mode == "target-only"})
    if not sizes:
        return []
    modes = list(dict.fromkeys(m for m, _ in rates if m != "target-only"))
    lines = [f"{'tok/s over target-only':<24}" + "".join(f"{'bs ' + str(b):>9}" for b in sizes)]

    def line(label: str, num: str, den: str) -> str:
        cells = []
        for bs in sizes:
            a, b = rates.get((num, bs)), rates.get((den, bs))
            cells.append(f"{a / b:.3f}x".rjust(9) if a and b else "-".rjust(9))
        return f"{label:<24}" + "".join(cells)

    lines += [line(m, m, "target-only") for m in modes]
    lines += [line(f"{m} / spec", m, "spec") for m in modes if m.startswith("services")]
    return lines


def _note(row: Row) -> str:
    """The row's note, with its decode steps without a tree by cause where there were any."""
    causes = ", ".join(f"{k} {v}" for k, v in sorted(row.without_tree.items()) if v)
    if not causes:
        return row.note
    return "; ".join(x for x in (row.note, f"no tree: {causes}") if x)


def to_json(rows: list[Row], header: dict[str, Any]) -> dict[str, Any]:
    return {"settings": header, "rows": [asdict(r) for r in rows]}


def plot(rows: list[Row], out_dir: Path) -> list[Path]:
    """throughput.png (tok/s against batch size per mode) and acceptance.png (acceptance per
    draft position per speculative mode); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode in MODES:
        points = sorted((r.batch_size, r.tokens_per_s or 0.0) for r in rows if r.mode == mode)
        points = [p for p in points if p[1] > 0]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    written.append(out_dir / "throughput.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for row in rows:
        if row.acceptance_per_position:
            positions = list(range(1, len(row.acceptance_per_position) + 1))
            label = f"{row.mode} bs={row.batch_size}"
            ax.plot(positions, row.acceptance_per_position, marker="o", label=label)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafted")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance per draft position")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")
    fig.tight_layout()
    written.append(out_dir / "acceptance.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written
