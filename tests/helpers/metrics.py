"""A service's ``/metrics`` page, read and checked as Prometheus checks it: ``promtool check
metrics`` where promtool is on PATH (Debian's ``prometheus`` package), and always the same rules
through ``prometheus_client``'s parser (every family with HELP and TYPE, counters ending in
``_total``, no other type named like a counter or a histogram's parts, histograms of time in
seconds)."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

_SUFFIXES = ("_total", "_count", "_sum", "_bucket")


def page(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return answer.read().decode()


def samples(text: str) -> dict[str, float]:
    """Every sample by name and labels (``name{k=v,...}``, sorted, OTel scope labels left out)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if not k.startswith("otel_scope")
            )
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def problems(text: str) -> list[str]:
    """What promtool (where installed) and the parser's rules find wrong; empty when clean."""
    found = []
    promtool = shutil.which("promtool")
    if promtool is not None:
        run = subprocess.run(
            [promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60
        )
        said = (run.stdout + run.stderr).decode().splitlines()
        found += [f"promtool: {line}" for line in said if line.strip()]
        if run.returncode != 0 and not said:
            found.append(f"promtool: exit {run.returncode}")
    helped = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")}
    typed = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    for family in text_string_to_metric_families(text):
        names = {s.name for s in family.samples}
        exposed = f"{family.name}_total" if family.type == "counter" else family.name
        if exposed not in helped or not family.documentation.strip():
            found.append(f"{exposed}: no HELP")
        if exposed not in typed or family.type == "unknown":
            found.append(f"{exposed}: no TYPE")
        if family.type == "counter":
            found += [f"{n}: a counter's sample not ending in _total" for n in names - {exposed}]
        elif family.type in ("gauge", "info") and family.name.endswith(_SUFFIXES):
            found.append(f"{family.name}: a {family.type} named like a counter or histogram")
        elif family.type == "histogram":
            parts = {f"{family.name}{p}" for p in ("_bucket", "_sum", "_count", "_created")}
            found += [f"{n}: not a histogram's part" for n in names - parts]
            timed = "duration" in family.name or "time" in family.name
            if timed and not family.name.endswith("_seconds"):
                found.append(f"{family.name}: a time histogram not in seconds")
    return found
