"""Prometheus text exposition of the stats, on 127.0.0.1:PORT/metrics.

Served from a thread of its own so a scrape never waits on FUSE requests;
it only reads the snapshot the event loop refreshes every second, and never
touches SQLite.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mithrilfs.observe.stats import COUNTERS

log = logging.getLogger(__name__)

_GAUGES = {
    "logical_bytes": "Sum of the sizes of all files in the mount",
    "physical_bytes": "Bytes the store holds on disk: unique blobs plus files being written",
    "max_bytes": "Byte budget of the store",
    "files": "Files in the mount",
    "blobs": "Unique blobs in the store",
    "written_files": "Files with uncommitted writes",
    "hit_rate": "hits / (hits + misses)",
    "dedup_ratio": "logical_bytes / physical_bytes",
    "restarts": "Times a new daemon took this live mount over (a crash, or mithrilfs restart)",
    "remote_tier_bytes": "Bytes the shared tier's names reference, at its last fleet gc",
    "remote_tier_blobs": "Blobs in the shared tier, at its last fleet gc",
    "remote_tier_names": "Names in the shared tier, at its last fleet gc",
    "remote_tier_gc_at": "When the shared tier's last fleet gc ran (unix seconds)",
    "remote_tier_gc_freed_bytes": "Bytes the shared tier's last fleet gc freed",
    "remote_idle": "1 while nobody has used the mount for a while (it asks the shared tier rarely)",
    "remote_idle_requests_per_hour": "Requests to the shared tier per hour of the mount's idleness",
}


#: Per level of the shared tier (Redis, the bucket): metric, stats key, type, help.
_LEVEL_METRICS = (
    ("reachable", "reachable", "gauge", "1 when the level answered its last request"),
    ("requests_total", "requests", "counter", "Requests sent to the level"),
    ("errors_total", "errors", "counter", "Requests to the level that failed"),
    ("slowdowns_total", "slowdowns", "counter", "Answers asking for fewer requests (503 SlowDown), each sent again"),
    ("received_bytes_total", "bytes_in", "counter", "Bytes read from the level"),
    ("sent_bytes_total", "bytes_out", "counter", "Bytes written to the level"),
)


def render(snapshot: dict[str, Any]) -> str:
    """The snapshot in the Prometheus text format (version 0.0.4)."""
    lines: list[str] = []
    for name, help_text in _GAUGES.items():
        if snapshot.get(name) is not None:
            lines += [f"# HELP mithrilfs_{name} {help_text}", f"# TYPE mithrilfs_{name} gauge",
                      f"mithrilfs_{name} {snapshot[name]}"]
    by_dir = snapshot.get("by_dir", {})
    for counter in COUNTERS:
        metric = f"mithrilfs_{counter}_total"
        lines += [f"# HELP {metric} {counter.replace('_', ' ')}, by top-level directory",
                  f"# TYPE {metric} counter"]
        for top, counters in by_dir.items():
            lines.append(f'{metric}{{dir="{_label(top)}"}} {counters.get(counter, 0)}')
    levels = snapshot.get("remote_levels") or []
    if levels:
        lines += ["# HELP mithrilfs_remote_upload_queue Changes waiting to be sent to the shared tier",
                  "# TYPE mithrilfs_remote_upload_queue gauge", f"mithrilfs_remote_upload_queue {snapshot['upload_queue']}"]
    for name, key, kind, help_text in _LEVEL_METRICS:
        if levels:
            lines += [f"# HELP mithrilfs_remote_{name} {help_text}", f"# TYPE mithrilfs_remote_{name} {kind}"]
        for lv in levels:
            lines.append(f'mithrilfs_remote_{name}{{level="{lv["kind"]}",url="{_label(lv["url"])}"}} {int(lv[key])}')
    lines += ["# HELP mithrilfs_latency_microseconds Latency of FUSE requests over recent samples",
              "# TYPE mithrilfs_latency_microseconds gauge"]
    for op, q in snapshot.get("latency_us", {}).items():
        for quantile in ("p50", "p99"):
            lines.append(f'mithrilfs_latency_microseconds{{op="{op}",quantile="0.{quantile[1:]}"}} {q[quantile]}')
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class MetricsServer:
    def __init__(self, port: int, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = render(server.snapshot()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        # bind now, so a taken port fails the mount with a clear message
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
