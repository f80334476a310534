"""Where the local services run and how much device memory their caches get.

`hybridcache up --device cuda --gpus 0,1` puts every worker (combine, scatter) on one GPU, round
robin over --gpus in start order (the combine worker first), and keeps the router and the cache
tier on the CPU. A worker's own GPU is its `cuda:0`; the other GPUs of the list stay visible after
it (CUDA_VISIBLE_DEVICES="own,others"), because a receiver opens a CUDA IPC handle on the GPU
that holds the memory (services/transport/cuda_ipc.py). Cache budgets left unset are sized once
the model is loaded, from the worker's memory pool: --gpu-memory-utilization of the GPU's total
memory less what the process already holds (its weights), never more than is free then. Workers
that `up` places on one GPU split the utilization between them, so their pools do not overlap
whichever loads first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

log = logging.getLogger("hybridcache.devices")

WORKER_ROLES = ("combine", "scatter")
CPU_CACHE_BYTES = 1 << 30  # entry and prefix budgets on the CPU (and the cache tier's store)
# Share of a worker's memory pool (memory_pool) that the caches may take: the rest is for the
# running requests' K/V and the activations of batched cold builds.
CACHE_MEMORY_FRACTION = 0.5
ENTRY_SHARE = 0.75  # of that, the segment entries' part; the prefix page tree gets the rest
# The running requests' attention K/V (the scheduler's admission budget): another share of that
# pool on CUDA, a fixed budget on the CPU.
KV_MEMORY_FRACTION = 0.25
CPU_KV_BYTES = 4 << 30


def parse_gpus(text: str | None) -> tuple[int, ...]:
    """"0,1,3" -> (0, 1, 3); None or "" -> (0,). Bad lists raise ValueError (one error line)."""
    if not text:
        return (0,)
    try:
        gpus = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise ValueError(f"--gpus must be a comma-separated list of GPU indices, got {text!r}") from None
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus must list distinct non-negative GPU indices, got {text!r}")
    return gpus


@dataclass(frozen=True)
class Placement:
    """One child process of `hybridcache up`: its device and the environment it adds (its --device
    comes with the other settings, services/config.py)."""

    role: str
    device: str  # cpu | cuda
    gpu: int | None  # physical GPU index (its cuda:0), None on the CPU
    env: dict[str, str]
    visible: tuple[int, ...] = ()  # the GPUs it sees, in its cuda:N order (its own first)


def place_services(roles: list[str], device: str, gpus: tuple[int, ...] = (0,)) -> list[Placement]:
    """The placement of each role in `roles` (start order). Workers on CUDA take the GPUs round
    robin; everything else, and every role with device cpu, runs with no GPU visible."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not gpus:
        raise ValueError("--device cuda needs at least one GPU in --gpus")
    out, n = [], 0
    for role in roles:
        if device == "cuda" and role in WORKER_ROLES:
            own = gpus[n % len(gpus)]
            n += 1
            visible = [own, *(g for g in gpus if g != own)]
            out.append(Placement(role, "cuda", own, {"CUDA_VISIBLE_DEVICES": ",".join(map(str, visible))},
                                 tuple(visible)))
        else:
            out.append(Placement(role, "cpu", None, {"CUDA_VISIBLE_DEVICES": ""}))
    return out


CPU_SCATTER_WORKERS = 2  # `hybridcache up` on the CPU: cold segments built in two more processes


def default_scatter_workers(device: str, gpus: tuple[int, ...], tensor_parallel_size: int = 1) -> int:
    """`hybridcache up`'s scatter workers when --scatter-workers is not given: CPU_SCATTER_WORKERS
    on the CPU; on CUDA one on each GPU of `gpus` besides the combine worker's, none with tensor
    parallelism (a worker's ranks take several GPUs). A scatter worker on the combine worker's own
    GPU builds nothing for it unless --scatter-same-gpu on, yet takes its part of that GPU's memory."""
    if device != "cuda":
        return CPU_SCATTER_WORKERS
    return len(gpus) - 1 if tensor_parallel_size == 1 else 0


def idle_scatter_workers(combine: Placement, scatters: list[Placement], scatter_same_gpu: bool,
                         tensor_parallel_size: int = 1) -> list[int]:
    """Indices of the scatter workers placed on a GPU of the combine worker's ranks, which that
    combine worker sends no cold segment to while --scatter-same-gpu is off (it builds them itself)."""
    if scatter_same_gpu or combine.gpu is None:
        return []
    mine = set(gpus_used(combine, tensor_parallel_size))
    return [i for i, p in enumerate(scatters) if p.gpu is not None and p.gpu in mine]


def gpus_used(p: Placement, tensor_parallel_size: int = 1) -> list[int]:
    """The GPUs a placed worker's ranks run on: rank r takes its r-th visible GPU (its own first)."""
    return list(p.visible[:tensor_parallel_size])


def utilization_per_worker(placements: list[Placement], utilization: float,
                           tensor_parallel_size: int = 1) -> dict[int, float]:
    """The --gpu-memory-utilization each worker is given when `placements` share GPUs, by the
    worker's own GPU: `utilization` of a GPU split evenly between the ranks on it, a worker taking
    the smallest share among the GPUs its ranks use (each rank sizes its caches alike)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    ranks: dict[int, int] = {}
    for p in placements:
        for g in gpus_used(p, tensor_parallel_size):
            ranks[g] = ranks.get(g, 0) + 1
    return {p.gpu: utilization / max(ranks[g] for g in gpus_used(p, tensor_parallel_size))
            for p in placements if p.gpu is not None}


def pool_bytes(total: int, free: int, held: int, utilization: float) -> tuple[int, str]:
    """(bytes, how) a worker may still take on its GPU: `utilization` of the `total` memory less
    what the process `held` already (its weights), at most what is `free` now, at least 0."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    want = int(utilization * total) - held
    pool = max(0, min(want, free))
    how = (f"{utilization:g} of {total / 2**30:.1f} GiB less {held / 2**30:.1f} GiB held = {max(want, 0) / 2**30:.1f} "
           f"GiB")
    if want > free:
        how += f", cut to the {free / 2**30:.1f} GiB free"
    return pool, how


def memory_pool(device, utilization: float) -> tuple[int, str] | None:
    """pool_bytes on a CUDA `device` now (the process's reserved memory counts as held), None off
    CUDA (or with no CUDA to ask)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    with torch.cuda.device(device):
        torch.cuda.empty_cache()  # blocks the process freed are not held
    free, total = torch.cuda.mem_get_info(device)
    return pool_bytes(total, free, torch.cuda.memory_reserved(device), utilization)


def cache_budgets(device: str, pool: int | None, entry_bytes: int | None = None,
                  prefix_bytes: int | None = None, fraction: float = CACHE_MEMORY_FRACTION,
                  pool_how: str = "") -> tuple[int, int, str]:
    """(entry budget, prefix budget, how they were chosen) for an engine process. Budgets given
    stay as given; the others are CPU_CACHE_BYTES on the CPU and shares of `fraction` of the
    worker's memory `pool` (memory_pool; `pool_how` says how it was found) on CUDA."""
    for name, v in (("entry", entry_bytes), ("prefix", prefix_bytes)):
        if v is not None and v <= 0:
            raise ValueError(f"the {name} cache budget must be positive, got {v}")
    if not 0 < fraction <= 1:
        raise ValueError(f"the cache memory fraction must be in (0, 1], got {fraction}")
    if device != "cuda" or pool is None:
        auto_entry = auto_prefix = CPU_CACHE_BYTES
        why = "CPU defaults"
    else:
        share = int(pool * fraction)
        auto_entry, auto_prefix = int(share * ENTRY_SHARE), share - int(share * ENTRY_SHARE)
        why = f"{fraction:g} of a {pool / 2**30:.1f} GiB pool" + (f" ({pool_how})" if pool_how else "")
    entry = entry_bytes if entry_bytes is not None else auto_entry
    prefix = prefix_bytes if prefix_bytes is not None else auto_prefix
    given = [n for n, v in (("entry", entry_bytes), ("prefix", prefix_bytes)) if v is not None]
    if given:
        why += f"; {' and '.join(given)} as given"
    return entry, prefix, why


def with_cache_budgets(config, device):
    """`config` (a RuntimeConfig) with its unset cache budgets sized for `device` (cache_budgets,
    from the worker's memory pool: call it once the model is loaded), stated in the log."""
    if config.entry_cache_bytes is not None and config.prefix_cache_bytes is not None:
        return config
    import torch

    device = torch.device(device)
    found = memory_pool(device, config.gpu_memory_utilization)
    pool, how = found if found is not None else (None, "")
    entry, prefix, why = cache_budgets(device.type, pool, config.entry_cache_bytes, config.prefix_cache_bytes,
                                       pool_how=how)
    log.info("cache budgets on %s: entries %.2f GiB, prefix pages %.2f GiB (%s)", device, entry / 2**30,
             prefix / 2**30, why)
    return replace(config, entry_cache_bytes=entry, prefix_cache_bytes=prefix)


def kv_cache_budget(device, given: int | None, utilization: float, fraction: float = KV_MEMORY_FRACTION) -> int:
    """The attention K/V budget of a scheduler's running requests: `given`, else CPU_KV_BYTES on the
    CPU and `fraction` of the worker's memory pool on CUDA (memory_pool at `utilization`: call it
    once the model is loaded)."""
    if given is not None:
        return given
    found = memory_pool(device, utilization)
    if found is None:
        return CPU_KV_BYTES
    pool, how = found
    budget = int(pool * fraction)
    log.info("K/V budget of running requests on %s: %.2f GiB (%g of a %.1f GiB pool: %s)", device,
             budget / 2**30, fraction, pool / 2**30, how)
    return budget


def out_of_memory_message(what: str, device: str, total: int, free: int, held: int, utilization: float) -> str:
    """The one error line of a worker that ran out of device memory while `what` (loading the
    model, warming up): the GPU's memory, this process's part and the rest (other processes on
    the GPU), and what to change."""
    gib = 2**30
    others = max(0, total - free - held)
    return (f"out of GPU memory on {device} while {what}: the GPU has {total / gib:.1f} GiB, this process holds "
            f"{held / gib:.1f} GiB (--gpu-memory-utilization {utilization:g}), other processes {others / gib:.1f} GiB, "
            f"{free / gib:.2f} GiB free. Give each worker its own GPU (--gpus), lower --gpu-memory-utilization "
            f"or --max-num-batched-tokens, warm up a smaller --warmup-shape, or use a GPU with more memory")


class DeviceMemoryError(RuntimeError):
    """A worker ran out of device memory while starting (the message says what to change)."""


def explain_out_of_memory(e: BaseException, what: str, device, utilization: float) -> str | None:
    """out_of_memory_message for `e` if it is torch's CUDA out-of-memory error, else None."""
    import torch

    if not isinstance(e, torch.OutOfMemoryError):
        return None
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"out of device memory on {device} while {what}"
    free, total = torch.cuda.mem_get_info(device)
    return out_of_memory_message(what, str(device), total, free, torch.cuda.memory_reserved(device), utilization)


def starting(what: str, device, utilization: float, fn):
    """fn() while a worker starts (`what`: loading the model, warming up); torch's out-of-memory
    error becomes a DeviceMemoryError that says where the GPU's memory went (one error line, not
    a traceback), any other error passes."""
    try:
        return fn()
    except Exception as e:
        message = explain_out_of_memory(e, what, device, utilization)
        if message is None:
            raise
        raise DeviceMemoryError(message) from None


def peak_over_share(peak: int, total: int, utilization: float) -> str | None:
    """A warning when a worker's peak device memory (the allocator's most reserved, its warm-up's
    largest requests included) passed its --gpu-memory-utilization share of the GPU, else None."""
    share = utilization * total
    if peak <= share:
        return None
    gib = 2**30
    return (f"the warm-up peaked at {peak / gib:.1f} GiB of this GPU's {total / gib:.1f} GiB, over this worker's "
            f"{share / gib:.1f} GiB share (--gpu-memory-utilization {utilization:g}): the cache budgets leave out the "
            f"activations of its largest requests and its CUDA graphs, so other workers on this GPU may run out of "
            f"memory")


class _CudaMemory:
    """The caching allocator's reserved bytes on one device, as RequestPeaks reads them."""

    def __init__(self, device):
        self.device = device

    def start(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def end(self) -> tuple[int, int]:
        """(the peak reserved since start, what stays reserved once the free blocks went back)."""
        import torch

        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_reserved(self.device)
        torch.cuda.empty_cache()
        return peak, torch.cuda.memory_reserved(self.device)


class RequestPeaks:
    """`run(request)` (a warm-up's way of serving one request) measured request by request: the
    device memory reserved at its peak while the request ran, above what stays reserved after it
    (`transient`, the largest over the requests: the activations a memory plan sets beside full
    caches) and the peak itself (`peak`, the largest). What the request left in caches counts as
    held, not transient: a warm-up's throwaway caches, filled by its requests and dropped at its
    end, are not taken for activations (measured over the whole warm-up, a 64 x 2k request's
    entries were, and starved the planned caches). `memory`: start() / end() -> (peak, held), the
    CUDA allocator's by default."""

    def __init__(self, run, device, memory=None):
        self.run, self.transient, self.peak = run, 0, 0
        self._memory = memory or _CudaMemory(device)

    def __call__(self, request):
        self._memory.start()
        try:
            out = self.run(request)
        except BaseException:
            try:  # the request's own error is the one raised, not a failing read of the memory after it
                self._count(*self._memory.end())
            except Exception:  # noqa: BLE001
                log.warning("reading the device memory after a failed warm-up request failed", exc_info=True)
            raise
        self._count(*self._memory.end())
        return out

    def _count(self, peak: int, held: int) -> None:
        self.peak = max(self.peak, peak)
        self.transient = max(self.transient, peak - held)


def warm_up_measured(device, utilization: float, warmup) -> dict:
    """warmup() (a worker's warm-up, returning its summary) under `starting`, with the peak device
    memory it took on CUDA added to the summary (`peak_reserved_gib`) and a warning logged if that
    passed the worker's share (peak_over_share)."""
    import torch

    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    out = starting("warming up", device, utilization, warmup)
    if cuda:
        # a warm-up that measured its requests one by one (RequestPeaks) reset the peak between them
        peak = max(torch.cuda.max_memory_reserved(device), out.get("requests_peak_reserved_bytes", 0))
        out["peak_reserved_gib"] = round(peak / 2**30, 2)
        warning = peak_over_share(peak, torch.cuda.mem_get_info(device)[1], utilization)
        if warning:
            log.warning(warning)
    return out


# What a worker's planned budgets leave unused of its share (allocator fragmentation, the CUDA
# context's growth, kernels compiled later): this fraction of what is left, at least PLAN_MARGIN_MIN.
PLAN_MARGIN_FRACTION = 0.05
PLAN_MARGIN_MIN = 1 << 30
# How a planned worker splits what is left between its caches: the running requests' K/V, the
# segment entries and the prefix page tree (the proportions of the shares of an unplanned pool).
PLAN_SPLIT = {"kv": KV_MEMORY_FRACTION, "entry": CACHE_MEMORY_FRACTION * ENTRY_SHARE,
              "prefix": CACHE_MEMORY_FRACTION * (1 - ENTRY_SHARE)}


class MemoryPlanError(ValueError):
    """A worker's configuration does not fit its share of the GPU (one line: what to change)."""


@dataclass(frozen=True)
class MemoryPlan:
    """A worker's memory, vLLM style (its determine_available_memory): `share` (its
    --gpu-memory-utilization of the GPU) less what it holds for good (`held`: weights, the running
    requests' linear states, CUDA graph pools) and the transient peak of its warm-up above that
    (`transient`: activations of its largest batches) leaves `left` bytes, less a margin, for the
    caches: the running requests' K/V, the segment entries, the prefix pages."""

    share: int
    held: int
    transient: int
    left: int
    kv: int
    entry: int
    prefix: int
    how: str

    def summary(self) -> dict:
        """GiB figures for /health."""
        names = ("share", "held", "transient", "left", "kv", "entry", "prefix")
        return {f"{n}_gib": round(getattr(self, n) / 2**30, 2) for n in names}


def plan_memory(share: int, held: int, transient: int, free: int, kv_min: int, entry: int | None = None,
                prefix: int | None = None, kv: int | None = None, parts: dict[str, int] | None = None,
                advice: str = "") -> MemoryPlan:
    """The cache budgets of a worker that has loaded its model, run its warm-up and captured its
    CUDA graphs (MemoryPlan says what each figure is). `free`: bytes free on the GPU without the
    caches (other processes' share of it is not ours to take: what is left never exceeds it).
    Budgets given stay as given and come off first; the rest splits by PLAN_SPLIT, except that an
    unset K/V budget whose share falls under `kv_min` gets kv_min and the other unset budgets split
    what remains. `parts` names pieces of `held` for the error line; `advice` says what to change.
    Raises MemoryPlanError when the K/V budget would be under `kv_min` (what the worker must admit:
    max_num_seqs requests starting, and its warm-up shape's request) or what is given does not
    fit."""
    gib = 2**30
    room = min(share - held, free) - transient
    margin = max(PLAN_MARGIN_MIN, int(PLAN_MARGIN_FRACTION * max(room, 0)))
    left = room - margin
    given = {n: v for n, v in (("kv", kv), ("entry", entry), ("prefix", prefix)) if v is not None}
    for n, v in given.items():
        if v <= 0:
            raise MemoryPlanError(f"the {n} budget must be positive, got {v}")
    rest = left - sum(given.values())
    unset = [n for n in PLAN_SPLIT if n not in given]
    weight = sum(PLAN_SPLIT[n] for n in unset)
    out = dict(given)
    for n in unset:
        out[n] = int(max(rest, 0) * PLAN_SPLIT[n] / weight)
    raised = "kv" in unset and out["kv"] < kv_min < rest and len(unset) > 1
    if raised:
        # the K/V's share would refuse a request the worker must take (kv_min): it gets that
        # much, the other unset budgets split the rest
        out["kv"] = kv_min
        others = [n for n in unset if n != "kv"]
        for n in others:
            out[n] = int((rest - kv_min) * PLAN_SPLIT[n] / sum(PLAN_SPLIT[m] for m in others))
    held_text = ", ".join(f"{name} {v / gib:.1f}" for name, v in (parts or {}).items())
    how = (f"{share / gib:.1f} GiB share less {held / gib:.1f} held" + (f" ({held_text})" if held_text else "")
           + f", {transient / gib:.1f} warm-up activations and a {margin / gib:.1f} margin")
    if min(share - held, free) < share - held:
        how += f" (cut to the {free / gib:.1f} GiB free)"
    if rest < 0 or out["kv"] < kv_min or (unset and rest <= 0):
        need = f"at least {kv_min / gib:.2f} GiB for the running requests' K/V"
        if given:
            need += " and " + ", ".join(f"{v / gib:.1f} GiB of {n} as given" for n, v in given.items())
        raise MemoryPlanError(f"this worker does not fit its GPU memory: {how} leave {left / gib:.2f} GiB, "
                              f"it needs {need}; {advice or 'raise --gpu-memory-utilization'}")
    how += f" leave {left / gib:.1f} GiB: K/V {out['kv'] / gib:.1f}, entries {out['entry'] / gib:.1f}, " \
           f"prefix pages {out['prefix'] / gib:.1f}" + (f" ({', '.join(given)} as given)" if given else "")
    if raised:
        how += " (K/V raised to its minimum)"
    return MemoryPlan(share, held, transient, left, out["kv"], out["entry"], out["prefix"], how)
