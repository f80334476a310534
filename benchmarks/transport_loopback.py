"""Entry transfer bandwidth over loopback: cache tier (its own process) -> client, per transport.

Starts `hybridcache serve cache-tier` on 127.0.0.1, puts one synthetic entry of --mib MiB, then
times Get over the gRPC stream (bytes inline) and over shared memory (bytes in /dev/shm, metadata
over gRPC). Prints one JSON object; --out also writes it to a file.

    python benchmarks/transport_loopback.py --mib 64 --repeats 5 --out benchmarks/results/transport_loopback_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from hybridcache.services import security
from hybridcache.services.cache_tier.client import CacheTierClient
from hybridcache.services.launcher import free_port
from hybridcache.services.runtime.cache import SegmentEntry
from hybridcache.services.runtime.sequence import AttnSpan, LinearSpan, SpanData


def synthetic_entry(mib: int) -> SegmentEntry:
    """An entry shaped like a real one (per linear layer T, S, conv tail; per attention layer K, V)."""
    g = torch.Generator().manual_seed(0)
    layers = 8
    per_layer = mib * (1 << 20) // layers // 2 // 4  # floats per T (and per S)
    d = max(8, int((per_layer / 4) ** 0.5))
    linear = {i: LinearSpan(torch.randn(1, 4, d, d, generator=g), torch.randn(1, 4, d, d, generator=g),
                            torch.randn(1, 64, 3, generator=g)) for i in range(layers) if i % 4 != 3}
    attn = {i: AttnSpan(torch.randn(1, 2, 4 * d, d // 4, generator=g), torch.randn(1, 2, 4 * d, d // 4, generator=g))
            for i in range(layers) if i % 4 == 3}
    return SegmentEntry(key="bench-" + str(mib), segment_tokens=4 * d, data=SpanData(4 * d, 0, linear, attn),
                        build_seconds=1.0).seal()


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    port = free_port()
    # the tier answers members of its deployment only: this process is one (same secret installed)
    secret = security.DeploymentSecret.generate()
    secret_file = secret.write(Path(tempfile.mkdtemp()) / "secret")
    security.install(secret)
    tier = subprocess.Popen([sys.executable, "-m", "hybridcache.services.cli", "serve", "cache-tier", "--grpc-port",
                             str(port), "--http-port", str(free_port()), "--cache-bytes", str(8 << 30),
                             "--secret-file", str(secret_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        if not tier.stdout.readline().startswith('{"ready"'):
            raise RuntimeError("the cache tier did not start")
        client = CacheTierClient(f"127.0.0.1:{port}", timeout_s=600)
        entry = synthetic_entry(args.mib)
        t0 = time.perf_counter()
        assert client.put([entry]) == 1
        put_s = time.perf_counter() - t0
        figures = {"entry_mib": round(entry.nbytes / (1 << 20), 2),
                   "put_grpc_gb_s": round(entry.nbytes / put_s / 1e9, 3)}
        t0 = time.perf_counter()
        entry.verify()
        figures["sha256_verify_gb_s"] = round(entry.nbytes / (time.perf_counter() - t0) / 1e9, 3)
        for transport in ("grpc", "shm"):
            times = []
            for _ in range(args.repeats + 1):
                t0 = time.perf_counter()
                got = client.get([entry.key], transport)
                times.append(time.perf_counter() - t0)
                assert got[entry.key].checksum == entry.checksum
            best = min(times[1:])  # the first call warms the channel
            figures[f"get_{transport}_gb_s"] = round(entry.nbytes / best / 1e9, 3)
            figures[f"get_{transport}_ms"] = round(best * 1000, 1)
        client.close()
    finally:
        tier.terminate()
        tier.wait(timeout=10)
    result = {"benchmark": "transport_loopback", "gpu": "none (CPU loopback)", "host": platform.node(),
              "cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2), "commit": commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "command": "python " + " ".join(sys.argv), "figures": figures,
              "note": "best of --repeats after one warm-up; every Get verifies the entry's HMAC-SHA256 seal twice "
                      "(tier on read, client on arrival) plus a CRC32 per tensor, all inside the measured time; "
                      "sha256_verify_gb_s is one such pass in this process"}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
