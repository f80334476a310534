"""Entry transfer bandwidth over loopback: cache tier (its own process) -> client, per transport;
with --cuda-ipc, scatter worker -> combine worker over CUDA IPC between two processes on one GPU.

Host paths: starts `hybridcache serve cache-tier` on 127.0.0.1, puts one synthetic entry of --mib
MiB, then times Get over the gRPC stream (bytes inline) and over shared memory (bytes in
/dev/shm, metadata over gRPC).

--cuda-ipc: a spawned sender process makes --entries entries of the Qwen3.5-9B shape cut to 8
layers (6 Gated DeltaNet: T and S [1, 32, 128, 128] fp32, conv tail [1, 8192, 3] bf16; 2
attention: K and V [1, 4, 1024, 256] bf16) on the GPU and sends them as the scatter worker sends
a batched build (codec.LayeredEntry, codec.layer_blocks: a header per entry, each layer of all
entries in one write, then the seals) through a CudaIpcTransport with its arena (--arena-mib; 0:
a fresh buffer exported per layer batch); the messages travel serialized over a pipe. This
process receives each of --requests requests with a fresh EntryAssembler on the GPU, as a
combine worker does. Figures: scatter_to_combine_gb_per_s (bytes / the seconds the assembler
spent receiving and checking them, what the served stack's stats report as scatter_seconds),
scatter_to_combine_link_gb_per_s (bytes / the GPU time of the copies and their checksums,
EntryAssembler.copy_seconds: what served_gpu.py reports as scatter_to_combine_gb_per_s),
scatter_to_combine_wall_gb_per_s (bytes / first message in to last entry verified and
synchronised, the sender's packing included), IPC opens per request, and whether every entry
equals what was sent (the first request, and the last).

Prints one JSON object; --out also writes it to a file.

    python benchmarks/transport_loopback.py --mib 64 --repeats 5 --out benchmarks/results/transport_loopback_cpu.json
    python benchmarks/transport_loopback.py --cuda-ipc --entries 32 --requests 5 --out transport_ipc.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
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
    if os.environ.get("HYBRIDCACHE_COMMIT"):
        return os.environ["HYBRIDCACHE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


LINEAR, ATTN, TOKENS, SEAM = 6, 2, 1024, 8


def ipc_entry(seed: int, device):
    """A synthetic entry of the Qwen3.5-9B shape cut to 8 layers, drawn from `seed` (both
    processes make the same one)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def r(*shape, dtype=torch.float32):
        return torch.randn(shape, generator=g, device=device).to(dtype)

    linear = {n: LinearSpan(r(1, 32, 128, 128), r(1, 32, 128, 128), r(1, 8192, 3, dtype=torch.bfloat16))
              for n in range(LINEAR)}
    attn = {LINEAR + a: AttnSpan(r(1, 4, TOKENS, 256, dtype=torch.bfloat16), r(1, 4, TOKENS, 256, dtype=torch.bfloat16))
            for a in range(ATTN)}
    return SegmentEntry(key=f"ipc-{seed}", segment_tokens=TOKENS + SEAM, data=SpanData(TOKENS, SEAM, linear, attn),
                        build_seconds=0.0)


def _ipc_sender(conn, entries: int, requests: int, arena_bytes: int) -> None:
    """The sending process: per request (when the receiver asks for it) `entries` entries sent
    layer by layer as the scatter worker sends a batched build; then its transport counters."""
    from hybridcache.services.transport.codec import LayeredEntry, layer_blocks, layer_tensors
    from hybridcache.services.transport.cuda_ipc import CudaIpcTransport
    from hybridcache.services.transport.ipc_pool import ArenaPool

    torch.cuda.init()
    pool = ArenaPool(arena_bytes) if arena_bytes > 0 else None
    n_tensors = LINEAR * 3 + ATTN * 2
    stats = []
    try:
        for r in range(requests):
            made = [ipc_entry(r * 1000 + i, "cuda") for i in range(entries)]
            torch.cuda.synchronize()
            conn.recv()  # the receiver is ready for request r
            transport = CudaIpcTransport(pool=pool, receiver="loopback-receiver")
            les = [LayeredEntry(i, e.key, e.segment_tokens, SEAM, n_tensors, transport) for i, e in enumerate(made)]
            conn.send([le.header().SerializeToString() for le in les])
            for layer in range(LINEAR + ATTN):
                pairs = [(le, [(n, t) for lay, n, t in layer_tensors(e.data) if lay == layer])
                         for le, e in zip(les, made)]
                conn.send([c.SerializeToString() for c in layer_blocks(pairs, layer, transport)])
            conn.send([le.seal(0.0).SerializeToString() for le in les])
            stats.append({"slots": transport.slots, "fallbacks": transport.fallbacks, "exports": transport.exports})
            del made, les, pairs
        conn.send({"transport": stats, "arenas_created": pool.created if pool else 0})
        conn.recv()  # the exporting process outlives the receiver's use of its memory
    finally:
        if pool is not None:
            pool.close()


def _same_entry(got, want) -> bool:
    from hybridcache.services.transport.codec import layer_tensors

    pairs = zip(layer_tensors(got.data), layer_tensors(want.data), strict=True)
    return all((la, na) == (lb, nb) and torch.equal(a, b) for (la, na, a), (lb, nb, b) in pairs)


def cuda_ipc_loopback(entries: int = 32, requests: int = 5, arena_mib: int = 512) -> dict:
    """Run the sender in a spawned process and receive its requests here (see the module doc);
    per request: bytes, receive seconds (the assembler's), wall seconds, IPC opens, slots."""
    import torch.multiprocessing as mp
    from hybridcache.services.protocol import pb
    from hybridcache.services.transport import cuda_ipc
    from hybridcache.services.transport.codec import EntryAssembler

    torch.cuda.init()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_ipc_sender, args=(there, entries, requests, arena_mib << 20), daemon=True)
    proc.start()
    per_request, verified = [], []
    try:
        for r in range(requests):
            asm = EntryAssembler("cuda")
            here.send("go")
            got, t0 = {}, None
            while len(got) < entries:
                batch = here.recv()
                if t0 is None:
                    t0 = time.perf_counter()
                for raw in batch:
                    out = asm.feed(pb.EntryChunk.FromString(raw))
                    if out is not None:
                        if out[1] is None:
                            raise RuntimeError(f"entry {out[0]} of request {r} failed: {out[2]}")
                        got[out[0]] = out[1]
            asm.close()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            per_request.append({"bytes": asm.bytes_received, "receive_s": asm.transfer_seconds,
                                "copy_s": asm.copy_seconds, "wall_s": wall,
                                "ipc_opens": asm.ipc_opens, "slots": asm.slots_received,
                                "blocks": asm.device_blocks})
            if r in (0, requests - 1):
                verified.append(all(_same_entry(got[i], ipc_entry(r * 1000 + i, "cuda")) for i in range(entries)))
            del got, asm
        sender = here.recv()
        # unmap the sender's memory before it exits
        cuda_ipc.ARENAS.clear()
        cuda_ipc.MAPPINGS.clear()
        gc.collect()
        torch.cuda.synchronize()
        here.send("bye")
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    return {"requests": per_request, "verified": verified, "sender": sender}


def ipc_figures(run: dict) -> dict:
    """The figures of a cuda_ipc_loopback run: the median request after the first (which maps the arena)."""
    import statistics

    reqs = run["requests"]
    steady = reqs[1:] or reqs
    entry_bytes = reqs[0]["bytes"] / max(1, reqs[0]["blocks"] // (LINEAR + ATTN))
    return {
        "entry_mib": round(entry_bytes / (1 << 20), 2),
        "request_mib": round(reqs[0]["bytes"] / (1 << 20), 1),
        "scatter_to_combine_gb_per_s": round(statistics.median(r["bytes"] / r["receive_s"] for r in steady) / 1e9, 1),
        "scatter_to_combine_link_gb_per_s": round(
            statistics.median(r["bytes"] / r["copy_s"] for r in steady if r["copy_s"]) / 1e9, 1)
        if any(r["copy_s"] for r in steady) else None,
        "scatter_to_combine_wall_gb_per_s": round(statistics.median(r["bytes"] / r["wall_s"] for r in steady) / 1e9, 1),
        "first_request_gb_per_s": round(reqs[0]["bytes"] / reqs[0]["receive_s"] / 1e9, 1),
        "ipc_opens_per_request": [r["ipc_opens"] for r in reqs],
        "slots_per_request": [r["slots"] for r in reqs],
        "sender_fallbacks": sum(t["fallbacks"] for t in run["sender"]["transport"]),
        "arenas_created": run["sender"]["arenas_created"],
        "entries_equal_sent": all(run["verified"]),
    }


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cuda-ipc", action="store_true", help="scatter -> combine over CUDA IPC (needs a GPU)")
    p.add_argument("--entries", type=int, default=32, help="--cuda-ipc: entries per request")
    p.add_argument("--requests", type=int, default=5, help="--cuda-ipc: requests (the first maps the arena)")
    p.add_argument("--arena-mib", type=int, default=512, help="--cuda-ipc: the sender's arena (0: none)")
    p.add_argument("--out")
    args = p.parse_args()
    if args.cuda_ipc:
        return _main_ipc(args)
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


def _main_ipc(args) -> int:
    if not torch.cuda.is_available():
        print("transport_loopback: error: --cuda-ipc needs a CUDA GPU", file=sys.stderr)
        return 2
    run = cuda_ipc_loopback(args.entries, args.requests, args.arena_mib)
    result = {"benchmark": "transport_loopback_cuda_ipc", "gpu": torch.cuda.get_device_name(0), "commit": commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "command": "python " + " ".join(sys.argv), "figures": ipc_figures(run), "detail": run,
              "note": "two processes on one GPU; the sender writes each layer of all entries into one arena slot "
                      "(one device checksum), the receiver copies each slot once and checks it, then every entry's "
                      "HMAC seal; steady-state figures are the median of the requests after the first"}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if result["figures"]["entries_equal_sent"] else 1


if __name__ == "__main__":
    sys.exit(main())
