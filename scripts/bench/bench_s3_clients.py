"""Which S3 client: boto3, obstore and opendal against one real SeaweedFS on loopback, in one run.

For each client that is installed: the median latency of small PUTs and
GETs (2 KiB objects, the size of most compile-cache files), the throughput
of a large PUT and GET (64 MiB), and the size of the package with what it
pulls in.  Clients take turns (ABBA order over the repetitions), so a busy
moment of the machine does not fall on one client alone.

    .venv/bin/pip install boto3 opendal   # obstore is a dependency already
    .venv/bin/python scripts/bench/bench_s3_clients.py --reps 4
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import seaweedfs_s3

SMALL = os.urandom(2048)
LARGE = os.urandom(64 << 20)


def boto3_client(env: dict[str, str]) -> tuple[Callable[[str, bytes], Any], Callable[[str], bytes]]:
    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1",
                      config=Config(retries={"max_attempts": 1}))
    return (lambda k, d: s3.put_object(Bucket="bench", Key=k, Body=d),
            lambda k: s3.get_object(Bucket="bench", Key=k)["Body"].read())


def obstore_client(env: dict[str, str]) -> tuple[Callable[[str, bytes], Any], Callable[[str], bytes]]:
    import obstore
    from obstore.store import S3Store

    st = S3Store("bench", endpoint=env["AWS_ENDPOINT_URL"], access_key_id=env["AWS_ACCESS_KEY_ID"],
                 secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region="us-east-1",
                 virtual_hosted_style_request=False, client_options={"allow_http": True})
    return (lambda k, d: obstore.put(st, k, io.BytesIO(d) if len(d) > 8 << 20 else d, chunk_size=8 << 20),
            lambda k: bytes(obstore.get(st, k).bytes()))


def opendal_client(env: dict[str, str]) -> tuple[Callable[[str, bytes], Any], Callable[[str], bytes]]:
    import opendal

    op = opendal.Operator("s3", bucket="bench", endpoint=env["AWS_ENDPOINT_URL"],
                          access_key_id=env["AWS_ACCESS_KEY_ID"], secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                          region="us-east-1")
    return op.write, lambda k: bytes(op.read(k))


CLIENTS = {"boto3": (boto3_client, ["boto3", "botocore", "s3transfer", "jmespath", "dateutil", "urllib3"]),
           "obstore": (obstore_client, ["obstore"]),
           "opendal": (opendal_client, ["opendal"])}


def installed_mib(modules: list[str]) -> float:
    total = 0
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        root = Path(spec.origin).parent
        total += sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return total / (1 << 20)


def measure(put: Callable[[str, bytes], Any], get: Callable[[str], bytes], tag: str, n: int) -> dict[str, float]:
    lat_put, lat_get = [], []
    for i in range(n):
        t = time.perf_counter()
        put(f"{tag}/s{i}", SMALL)
        lat_put.append(time.perf_counter() - t)
    for i in range(n):
        t = time.perf_counter()
        assert get(f"{tag}/s{i}") == SMALL
        lat_get.append(time.perf_counter() - t)
    t = time.perf_counter()
    put(f"{tag}/large", LARGE)
    up = len(LARGE) / (time.perf_counter() - t) / 1e6
    t = time.perf_counter()
    assert len(get(f"{tag}/large")) == len(LARGE)
    down = len(LARGE) / (time.perf_counter() - t) / 1e6
    return {"put_us": statistics.median(lat_put) * 1e6, "get_us": statistics.median(lat_get) * 1e6,
            "put_mb_s": up, "get_mb_s": down}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--ops", type=int, default=300, help="small PUTs and GETs per client and repetition")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    have = [name for name, (_, mods) in CLIENTS.items() if importlib.util.find_spec(mods[0]) is not None]
    missing = sorted(set(CLIENTS) - set(have))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in have}
    with seaweedfs_s3() as env:
        clients = {name: CLIENTS[name][0](env) for name in have}
        for name, (put, get) in clients.items():  # warm each connection pool
            measure(put, get, f"warm-{name}", 20)
        for rep in range(args.reps):
            order = have if rep % 2 == 0 else list(reversed(have))
            for name in order:
                results[name].append(measure(*clients[name], f"{name}-{rep}", args.ops))
    summary = {name: {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}
               | {"spread_get_us": [round(min(r["get_us"] for r in runs)), round(max(r["get_us"] for r in runs))],
                  "installed_mib": round(installed_mib(CLIENTS[name][1]), 1)}
               for name, runs in results.items()}
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{'client':<10}{'PUT 2K us':>11}{'GET 2K us':>11}{'GET spread':>14}{'PUT MB/s':>10}{'GET MB/s':>10}"
          f"{'MiB':>7}")
    for name, s in summary.items():
        print(f"{name:<10}{s['put_us']:>11.0f}{s['get_us']:>11.0f}{str(s['spread_get_us']):>14}{s['put_mb_s']:>10.0f}"
              f"{s['get_mb_s']:>10.0f}{s['installed_mib']:>7.1f}")
    if missing:
        print(f"not installed: {', '.join(missing)} (pip install {' '.join(missing)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
