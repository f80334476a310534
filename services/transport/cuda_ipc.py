"""Entry bytes that stay on the GPU: CUDA IPC between processes of one host (torch's CUDA tensor
sharing, torch.multiprocessing.reductions).

The sender packs the tensors of an entry (a whole entry, or one layer of it while the rest is
being computed: codec.LayeredEntry) into one device buffer (services/runtime/packing.py),
computes its checksum on the device, and exports the buffer's CUDA allocation with
storage._share_cuda_(): a cudaIpcMemHandle, an IPC event recorded after the bytes were written,
and a reference counter in a shared-memory file. Only those few hundred bytes travel in the
stream's messages. The receiver opens the handle on the GPU that holds the memory (matched by UUID,
since the two processes may number their GPUs differently), copies the buffer into its own
device memory (device-to-device, over NVLink when the GPUs differ), checks the checksum on its
copy and takes the tensors as views of it; it releases the mapping when the next block from that
GPU arrives, which lets the sender's allocator reuse the block (torch keeps it in its IPC limbo
until then). A block its receiver never opens (a combine worker that died mid-stream) stays
allocated in the sender until the sender exits.

What it takes: both processes on one host with the same IPC namespace (the reference counters
live in /dev/shm and CUDA IPC handles are opened through it) and the same PID namespace (the
driver resolves the exporting process), and the receiver able to see the sender's GPU. The
transport choice (services/transport/__init__.py) checks exactly that from the two Endpoints.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from hybridcache.services.runtime.packing import pack
from hybridcache.services.transport.base import TensorTransport, TransportError
from hybridcache.services.transport.checksum import checksum_text, device_checksum_sums


def device_uuid(index: int) -> str:
    """The UUID of CUDA device `index` of this process (the same GPU has the same UUID everywhere)."""
    return str(torch.cuda.get_device_properties(index).uuid)


@functools.cache
def visible_gpus() -> tuple[str, ...]:
    """UUIDs of this process's CUDA devices, in its own index order; () without CUDA."""
    if not torch.cuda.is_available():
        return ()
    return tuple(device_uuid(i) for i in range(torch.cuda.device_count()))


def local_index(uuid: str, gpus: tuple[str, ...] | None = None) -> int:
    """This process's index of the GPU with `uuid`; TransportError when it cannot see that GPU."""
    gpus = visible_gpus() if gpus is None else gpus
    if uuid not in gpus:
        raise TransportError(f"the GPU {uuid or '?'} holding the entry is not visible to this process",
                             unreachable=True)
    return gpus.index(uuid)


def share(buf: torch.Tensor, block) -> None:
    """Fill `block` (a DeviceBlock) with the CUDA IPC export of the uint8 CUDA buffer `buf`."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    fn, args = reduce_tensor(buf)
    if fn is not rebuild_cuda_tensor:
        raise TransportError("cuda_ipc needs a CUDA tensor")
    (_, _, _, tensor_offset, _, _, device, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset,
     event_handle, event_sync) = args
    block.device_uuid = device_uuid(device)
    block.handle = handle
    block.storage_bytes = storage_bytes
    block.storage_offset = storage_offset
    block.tensor_offset = tensor_offset
    block.ref_counter_handle = ref_handle
    block.ref_counter_offset = ref_offset
    block.event_handle = event_handle or b""
    block.event_sync_required = bool(event_sync)


def open_shared(block, index: int) -> torch.Tensor:
    """The sender's buffer, mapped into this process on its CUDA device `index` (no copy)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        return rebuild_cuda_tensor(torch.Tensor, (block.nbytes,), (1,), block.tensor_offset, torch.storage.TypedStorage,
                                   torch.uint8, index, block.handle, block.storage_bytes, block.storage_offset,
                                   False, block.ref_counter_handle, block.ref_counter_offset,
                                   block.event_handle or None, block.event_sync_required)
    except (RuntimeError, OSError) as e:
        raise TransportError(f"cannot open the CUDA IPC handle: {e}", unreachable=True) from None


class CudaIpcTransport(TensorTransport):
    """Exports whole entries as device blocks (write_entry); one instance per stream. `share` is
    how a buffer is exported (the module's share: torch's CUDA IPC)."""

    name = "cuda_ipc"
    packs_entries = True  # the codec hands it whole entries (write_entry)

    def __init__(self, share=None):
        self._share = share
        self._moved = 0

    def write(self, chunk, tensor: torch.Tensor) -> None:
        raise TransportError("cuda_ipc moves whole entries: the codec calls write_entry")

    def write_entry(self, block, tensors: list[torch.Tensor], ready=None) -> None:
        """Pack `tensors` into one buffer, export it into `block` with its device checksum. On CUDA
        this runs on a side stream that waits only for `ready` (a CUDA event recorded once the
        tensors were computed): the builder's next batch, queued on the default stream meanwhile,
        neither delays this entry's export nor is waited for by its checksum. The sender may drop
        everything afterwards: torch holds the buffer's allocation until the receiver released it."""
        with _side_stream(tensors[0].device if tensors else None, ready):
            buf = pack(tensors)
            block.nbytes = buf.numel()
            sums = device_checksum_sums(buf)
            # torch records the IPC event on the current (side) stream: after the pack
            (self._share or globals()["share"])(buf, block)
            block.checksum = checksum_text(sums)
        self._moved += block.nbytes

    def close(self) -> None:
        # blocks the receivers released wait in torch's IPC limbo until collected
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()

    def bytes_moved(self) -> int:
        return self._moved


def receive_block(block, device) -> torch.Tensor:
    """A copy of the block's bytes in this process's memory on `device`, checked against the
    block's checksum; the mapping of the sender's memory is released before returning. On CUDA
    the copy and the checksum run on a side stream, so that they wait neither for nor behind the
    model's work on the default stream; the copy is marked in use by the default stream, where
    the engine reads it."""
    if block.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    index = local_index(block.device_uuid)
    dev = torch.device(device)
    # opened on the side stream, so that the wait for the sender's IPC event lands there too; it
    # waits for nothing of this process (the copy goes to fresh memory)
    with _side_stream(dev if dev.type == "cuda" else None, after_default=False):
        src = open_shared(block, index)
        if src.numel() != block.nbytes:
            raise TransportError(f"device block holds {src.numel()} bytes, the header says {block.nbytes}")
        own = torch.empty(block.nbytes, dtype=torch.uint8, device=dev)
        own.copy_(src)
        sums = device_checksum_sums(own)
        ok = checksum_text(sums) == block.checksum
        # The mapping stays open until the next block from that GPU replaces it here: torch maps a
        # sender's allocation once while any of its storages lives, and the sender's next blocks
        # mostly come from the same allocation, so they open without another cudaIpcOpenMemHandle.
        # Dropping the previous one unmaps it (torch syncs this stream first, then releases the
        # sender's reference counter).
        with _LAST_LOCK:
            _LAST_OPENED[block.device_uuid] = src
        del src
        if dev.type == "cuda":
            own.record_stream(torch.cuda.default_stream(dev))
    if not ok:
        raise TransportError("device block: checksum mismatch")
    return own


_SIDE: dict = {}
_LAST_OPENED: dict[str, torch.Tensor] = {}  # sender GPU UUID -> the last block opened from it
_LAST_LOCK = threading.Lock()


@contextlib.contextmanager
def _side_stream(device, ready=None, after_default: bool = True):
    """A per-device side stream made current, after waiting for the event `ready` (or, without one
    and with `after_default`, for the work queued on the default stream so far); nothing off CUDA."""
    if device is None or torch.device(device).type != "cuda":
        yield
        return
    device = torch.device(device)
    stream = _SIDE.get(device)
    if stream is None:
        stream = _SIDE.setdefault(device, torch.cuda.Stream(device))
    if ready is not None:
        stream.wait_event(ready)
    elif after_default:
        stream.wait_stream(torch.cuda.default_stream(device))
    with torch.cuda.stream(stream):
        yield


def measure_bandwidth(device, nbytes: int = 256 << 20) -> float:
    """Bytes/s of the device work of one cuda_ipc move on `device`, both ends in this process:
    the sender's pack and checksum, the receiver's copy and checksum (the handle's export and
    opening, which need two processes, are not in it: the combine workers' measurements on
    requests are). A starting value for the router's cost model."""
    import time

    t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    for _ in range(2):  # the first round allocates and warms the kernels
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with _side_stream(device):
            buf = pack([t])
            checksum_text(device_checksum_sums(buf))
            own = torch.empty_like(buf)
            own.copy_(buf)
            checksum_text(device_checksum_sums(own))
        seconds = time.perf_counter() - t0
    return nbytes / seconds


DEVICE_SEAL_PREFIX = "hmac-sha256-dev:"


def device_seal(header, parts) -> str:
    """The seal of an entry sent in device blocks: an HMAC-SHA256 keyed by the deployment's
    sealing key (services/security.py, as cache/entry.py seals entries on the host) over the
    entry's key and lengths and, per block in order (one for the whole entry, or one per layer of
    a layered entry), every tensor's (layer, name, dtype, shape, offset in the block) and the
    block's size and device checksum. `parts`: [(specs, block)]. The bytes never reach the host,
    so the HMAC covers their device checksums, which the receiver recomputes on its copies: only a
    holder of the secret can make a seal the entry verifies against."""
    import hashlib
    import hmac

    from hybridcache.services.security import seal_key

    h = hmac.new(seal_key(), digestmod=hashlib.sha256)
    h.update(f"{header.key}|{header.segment_tokens}|{header.num_tokens}|{header.local_start}".encode())
    for specs, block in parts:
        for layer, name, dtype, shape, offset in specs:
            h.update(f"|{layer}:{name}:{dtype}:{tuple(shape)}@{offset}".encode())
        h.update(f"|{block.nbytes}:{block.checksum}".encode())
    return DEVICE_SEAL_PREFIX + h.hexdigest()


def verify_device_seal(seal: str, header, parts) -> bool:
    import hmac

    return bool(seal) and hmac.compare_digest(seal, device_seal(header, parts))
