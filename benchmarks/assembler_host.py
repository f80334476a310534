"""Host time of receiving a batched build's entries over cuda_ipc (EntryAssembler), on the CPU.

The combine worker's side of the scatter -> combine move spends host time per message, per device
block and per tensor (mapping, queuing the slot copies, reading their checksums back, checking
each tensor's layout, the seal, making the entry's views). This measures that host work alone:
a batched build of --entries entries of --layers layers (the Qwen3.5-9B pattern: every fourth
layer attention, K and V; the others Gated DeltaNet, T, S and a conv tail) with tensors of a few
hundred bytes, so that the copies cost next to nothing, is sent as the scatter worker sends it
(codec.LayeredEntry, codec.layer_blocks, through a CudaIpcTransport with its arena) and received
by a fresh EntryAssembler per request. CUDA IPC's export and open are replaced by an in-process
registry of the CPU buffers (no GPU here); everything else is the served code. Figures: the
median host milliseconds a request, and per tensor and per block.

    python benchmarks/assembler_host.py --out benchmarks/results/assembler_host_cpu_<commit>.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from hybridcache.services.protocol import pb
from hybridcache.services.transport import cuda_ipc, ipc_pool
from hybridcache.services.transport.codec import EntryAssembler, LayeredEntry, layer_blocks
from hybridcache.services.transport.cuda_ipc import CudaIpcTransport
from hybridcache.services.transport.ipc_pool import ArenaPool

GPU = "GPU-assembler-host"


class InProcessIpc:
    """CUDA IPC's export and open as a registry of this process's CPU buffers (one handle a buffer)."""

    def __init__(self):
        self.shared: dict[bytes, torch.Tensor] = {}
        cuda_ipc.share = self.share
        cuda_ipc.open_shared = self.open_shared
        cuda_ipc.release_counter = lambda block, index: None
        cuda_ipc.visible_gpus = lambda: (GPU,)
        cuda_ipc.MAPPINGS = cuda_ipc.DeviceMappings()
        cuda_ipc.ARENAS = ipc_pool.ArenaMappings()

    def share(self, buf, block) -> None:
        base = buf if buf._base is None else buf._base
        handle = next((h for h, t in self.shared.items() if t is base), None)
        if handle is None:
            handle = f"h{len(self.shared)}".encode()
            self.shared[handle] = base
        block.device_uuid, block.handle, block.storage_bytes = GPU, handle, base.numel()
        block.tensor_offset = buf.storage_offset() - base.storage_offset()

    def open_shared(self, block, index):
        return self.shared[block.handle]


def layer_tensors(layer: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    if layer % 4 == 3:
        return [("k", torch.randn(1, 2, 8, 4, generator=g).bfloat16()),
                ("v", torch.randn(1, 2, 8, 4, generator=g).bfloat16())]
    return [("T", torch.randn(1, 2, 4, 4, generator=g)), ("S", torch.randn(1, 2, 4, 4, generator=g)),
            ("conv_tail", torch.randn(1, 16, 3, generator=g).bfloat16())]


def build_request(pool: ArenaPool, r: int, entries: int, layers: int) -> tuple[list[pb.EntryChunk], CudaIpcTransport]:
    """The messages of one batched build, as the combine worker parses them off the stream, and
    the transport that sent them (its arena slots and fallbacks)."""
    transport = CudaIpcTransport(pool=pool, receiver="assembler-host")
    n_tensors = sum(len(layer_tensors(layer, 0)) for layer in range(layers))
    les = [LayeredEntry(i, f"r{r}-e{i}", 1032, 8, n_tensors, transport) for i in range(entries)]
    msgs = [le.header() for le in les]
    for layer in range(layers):
        pairs = [(le, layer_tensors(layer, r * 10_000 + i * 100 + layer)) for i, le in enumerate(les)]
        msgs += list(layer_blocks(pairs, layer, transport))
    msgs += [le.seal(0.0) for le in les]
    return [pb.EntryChunk.FromString(m.SerializeToString()) for m in msgs], transport


def receive(msgs: list[pb.EntryChunk], entries: int) -> tuple[float, EntryAssembler]:
    asm = EntryAssembler()
    t0 = time.perf_counter()
    out = [done for m in msgs if (done := asm.feed(m)) is not None]
    seconds = time.perf_counter() - t0
    asm.close()
    bad = [err for _, entry, err in out if entry is None]
    if len(out) != entries or bad:
        raise SystemExit(f"assembler_host: {len(out)} of {entries} entries, errors {bad[:2]}")
    return seconds, asm


def commit() -> str:
    if os.environ.get("HYBRIDCACHE_COMMIT"):
        return os.environ["HYBRIDCACHE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=32)
    ap.add_argument("--layers", type=int, default=32, help="layers an entry (32: the Qwen3.5-9B count)")
    ap.add_argument("--requests", type=int, default=15, help="requests timed (after two untimed)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.entries < 1 or args.layers < 1 or args.requests < 1:
        print("assembler_host: --entries, --layers and --requests must be at least 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # the host work is one thread's; the tiny copies gain nothing from more
    InProcessIpc()
    pool = ArenaPool(64 << 20)
    try:
        times, asm, fallbacks = [], None, 0
        for r in range(args.requests + 2):  # each request built, then received (its slots released)
            msgs, transport = build_request(pool, r, args.entries, args.layers)
            fallbacks += transport.fallbacks
            gc.collect()
            seconds, asm = receive(msgs, args.entries)
            if r >= 2:
                times.append(seconds)
    finally:
        pool.close()
    tensors = args.entries * sum(len(layer_tensors(layer, 0)) for layer in range(args.layers))
    blocks = asm.device_blocks
    ms = statistics.median(times) * 1e3
    result = {
        "benchmark": "assembler_host",
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "command": "python benchmarks/assembler_host.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "shape": {"entries": args.entries, "layers": args.layers, "tensors_per_request": tensors,
                  "blocks_per_request": blocks, "messages_per_request": len(msgs),
                  "slots_per_request": asm.slots_received, "sender_fallbacks": fallbacks},
        "figures": {
            "host_ms_per_request": round(ms, 2),
            "host_us_per_tensor": round(ms * 1e3 / tensors, 2),
            "host_us_per_block": round(ms * 1e3 / blocks, 2),
            "host_ms_all": [round(t * 1e3, 2) for t in times],
        },
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
