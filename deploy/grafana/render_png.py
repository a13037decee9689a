"""Draws the dashboard's panels as docs/images/dashboard.png, from real data: the real server
(default config) under tests/deploy/test_prometheus.py's scripted load, repeated, scraped by a real
Prometheus each second; every panel's queries over the run, through Prometheus' query_range.

    PYTHONPATH=. python deploy/grafana/render_png.py [out.png]

A picture for docs/operations.md, not Grafana's rendering: same queries, same units, matplotlib.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tests.conftest import make_settings, running_server  # noqa: E402
from tests.deploy.test_prometheus import DASHBOARD, JOB, as_prometheus_sees_it, prometheus_scraping, scripted_load, wait_for  # noqa: E402
from voicebot.config.base import REPO_ROOT  # noqa: E402

ROUNDS = 4  # of the scripted load
WINDOW = "20s"  # $__rate_interval for 1 s scrapes over a short run
SCALE = {"s": (1000, "ms"), "bytes": (2**-20, "MiB"), "percentunit": (100, "%")}


def legend(template: str, labels: dict) -> str:
    """As Grafana fills a legend: {{label}} by the series' label, empty where it has none."""
    return re.sub(r"\{\{(\w+)\}\}", lambda m: labels.get(m.group(1), "") if m.group(1) != "instance" else "", template).strip()


def render(url: str, start: float, end: float, out: Path) -> None:
    rows: list[list[dict]] = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        rows.append([]) if panel["type"] == "row" else rows[-1].append(panel)
    columns = max(len(row) for row in rows)
    fig, axes = plt.subplots(len(rows), columns, figsize=(5.5 * columns, 3.8 * len(rows)))
    for ax in axes.flat:
        ax.set_visible(False)
    for r, row in enumerate(rows):
        for c, panel in enumerate(row):
            draw(axes[r][c], panel, url, start, end)
    for ax in axes[-1]:
        ax.set_xlabel("seconds into the run")
    fig.suptitle("voicebot: live show (default config on CPU, a scripted load of espeak speech, 1 s scrapes)", fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(out, dpi=70)


def draw(ax, panel: dict, url: str, start: float, end: float) -> None:
    ax.set_visible(True)
    factor, unit = SCALE.get(panel["fieldConfig"]["defaults"]["unit"], (1, ""))
    drawn = False
    for target in panel["targets"]:
        answer = httpx.get(f"{url}/api/v1/query_range", timeout=10, params={
            "query": as_prometheus_sees_it(target["expr"], WINDOW), "start": start, "end": end, "step": 1}).json()
        for series in answer["data"]["result"]:
            t = [float(v[0]) - start for v in series["values"]]
            y = [float(v[1]) * factor for v in series["values"]]
            ax.plot(t, y, label=legend(target["legendFormat"], series["metric"]) or " ")
            drawn = True
    ax.set_title(panel["title"], fontsize=11, loc="left")
    ax.set_ylabel(unit)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7, loc="upper left")
    else:
        ax.text(0.5, 0.5, panel["fieldConfig"]["defaults"]["noValue"], ha="center", va="center", transform=ax.transAxes, color="grey")


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT / "docs" / "images" / "dashboard.png"
    with running_server(make_settings(reset={"interval_s": 2.0})) as server:
        with prometheus_scraping(server.settings.server.port, Path(tempfile.mkdtemp())) as url:
            wait_for(url, f'up{{job="{JOB}"}} == 1')
            start = time.time()
            for _ in range(ROUNDS):
                asyncio.run(scripted_load(server.ws_url))
            time.sleep(3)
            render(url, start, time.time(), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
