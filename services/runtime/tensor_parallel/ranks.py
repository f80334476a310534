"""The processes of a tensor-parallel worker: rank 0 and the N - 1 followers it starts.

Rank 0 runs everything a worker runs (engine, scheduler, servers); the followers only mirror its
engine. `start(size, build, device)` spawns the followers (torch.multiprocessing, spawn), joins
them in one torch.distributed group (NCCL on CUDA, one GPU a rank; gloo on the CPU) and calls
`build(rank, size)` on every rank: each builds its own target (an Engine over its shard of the
model, build_engine). Rank 0 gets a Remote of its target.

A Remote forwards the calls that touch the model or the caches (Remote.broadcast names them) to
every rank: rank 0 pickles the call, broadcasts it on a gloo group, and then runs it itself;
each follower runs the same call on its own target. Every model forward thus runs on all ranks
in the same order, and its all-reduces meet. What rank 0 passes in and gets back holds that
rank's tensors (states, entries, K/V), so objects are named across ranks by handle: every
object a broadcast call returns (walked through the runtime's dataclasses, lists and dicts) gets
the next handle on every rank in the same order, a handle in a later call's arguments stands for
the follower's own object, and a handle whose object rank 0 has dropped is dropped on the
followers with the next call. A floating-point tensor without a handle is refused (TPError): it
would carry rank 0's slice to the other ranks, a wrong answer instead of an error.

Per-rank objects also move between rank 0 and the followers as a whole, point to point on the
gloo group (torch.save bytes, tensors landing on the receiving rank's device): `gather(obj)`
hands rank 0 every rank's counterpart of a named object (a scatter worker collects the ranks'
slices of the entries it built), `scatter(objs)` gives rank r objs[r] and names them alike on
every rank (a combine worker hands each rank its slice of a received entry).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import functools
import io
import logging
import os
import pickle
import threading
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger("hybridcache.tensor_parallel")

# classes whose fields the handle walk enters (the runtime's per-request data); anything else
# weak-referenceable is named as a whole, without looking inside (a page node, a recorder)
_WALK = {
    "SequenceState", "LinearState", "AttnState", "SpanData", "LinearSpan", "AttnSpan", "SegmentEntry",
    "Prefill", "PrefillJob", "Recording",
}
# results rank 0 gets back as Remotes (their methods change per-rank state, so they broadcast)
_REMOTE = {"StatePool"}
_CPU_GROUP = None  # the gloo group of the control messages and the calls' outcomes
_DEVICE = torch.device("cpu")  # this rank's device: where the objects it receives land
_OP = -1  # the handle of a group operation (gather, scatter) in a control message
_PLAIN = (int, float, str, bool, bytes, complex, slice, type(None), torch.dtype, torch.device, type)


class TPError(RuntimeError):
    """A call that cannot be mirrored on every rank (the message says why)."""


class _Handles:
    """Handles of the objects the ranks name alike. Rank 0 holds weak references (an object's
    handle dies with it and is queued for the followers); a follower holds its objects until rank 0
    drops them."""

    def __init__(self, strong: bool):
        self.strong = strong
        self.next = 1
        self.of: dict[int, int] = {}  # id(obj) -> handle
        self.objs: dict[int, object] = {}  # handle -> obj (followers) or weakref (rank 0)
        self.dead: list[int] = []
        self._lock = threading.Lock()

    def name(self, obj, handle: int | None = None) -> int | None:
        """The handle of obj, a new one if it has none (`handle` for the root). Objects that cannot
        be weakly referenced get none, on every rank alike."""
        h = self.of.get(id(obj))
        if h is not None:
            return h
        if handle is not None or self.strong:
            ref = obj
        else:
            try:
                ref = weakref.ref(obj)
            except TypeError:
                return None
            weakref.finalize(obj, self._gone, id(obj))
        if handle is None and self.strong:
            try:
                weakref.ref(obj)
            except TypeError:
                return None
        h = self.next if handle is None else handle
        self.next = max(self.next, h + 1)
        self.of[id(obj)] = h
        self.objs[h] = ref
        return h

    def _gone(self, key: int) -> None:
        with self._lock:
            h = self.of.pop(key, None)
            if h is not None:
                self.objs.pop(h, None)
                self.dead.append(h)

    def take_dead(self) -> list[int]:
        with self._lock:
            dead, self.dead = self.dead, []
        return dead

    def get(self, h: int):
        obj = self.objs.get(h)
        if obj is None:
            raise TPError(f"handle {h} is unknown on this rank")
        return obj if self.strong or h == 0 else obj()

    def drop(self, handles: list[int]) -> None:
        for h in handles:
            obj = self.objs.pop(h, None)
            if obj is not None:
                self.of.pop(id(obj), None)

    def walk(self, obj, seen=None) -> None:
        """Name every object reachable from `obj` through lists, tuples, dict values and the fields
        of the runtime's data classes (_WALK), in a fixed order, so that every rank names its own
        counterparts with the same handles."""
        seen = set() if seen is None else seen
        if isinstance(obj, _PLAIN) or id(obj) in seen or isinstance(obj, nn.Module):
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            for x in obj:
                self.walk(x, seen)
            return
        if isinstance(obj, dict):
            for x in obj.values():
                self.walk(x, seen)
            return
        self.name(obj)
        if type(obj).__name__ not in _WALK:
            return
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                self.walk(getattr(obj, f.name), seen)


class _Pickler(pickle.Pickler):
    def __init__(self, f, handles: _Handles):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.handles = handles

    def persistent_id(self, obj):
        if isinstance(obj, _PLAIN) or isinstance(obj, (list, tuple, dict)):
            return None
        h = self.handles.of.get(id(obj))
        if h is not None:
            return h
        if isinstance(obj, Remote):
            return obj._handle
        if isinstance(obj, torch.Tensor) and (obj.is_floating_point() or obj.is_complex()):
            raise TPError(
                f"a {tuple(obj.shape)} {obj.dtype} tensor made outside the broadcast calls was passed to one: "
                "it holds rank 0's slice only (make it inside a broadcast call)"
            )
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, f, handles: _Handles):
        super().__init__(f)
        self.handles = handles

    def persistent_load(self, pid):
        return self.handles.get(pid)


class Channel:
    """Pickled messages from rank 0 to every rank over a gloo group (CPU tensors)."""

    def __init__(self, group):
        self.group = group

    def send(self, payload: bytes) -> None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
        dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), 0, group=self.group)
        if data.numel():
            dist.broadcast(data, 0, group=self.group)

    def recv(self) -> bytes:
        n = torch.empty(1, dtype=torch.int64)
        dist.broadcast(n, 0, group=self.group)
        data = torch.empty(int(n), dtype=torch.uint8)
        if data.numel():
            dist.broadcast(data, 0, group=self.group)
        return data.numpy().tobytes()


def _send_obj(payload: bytes, dst: int) -> None:
    """Send a serialised object to rank `dst` on the gloo group (length first; 0: none, a failure)."""
    dist.send(torch.tensor([len(payload)], dtype=torch.int64), dst, group=_CPU_GROUP)
    if payload:
        dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst, group=_CPU_GROUP)


def _recv_obj(src: int):
    """The object rank `src` sent (_send_obj), its tensors on this rank's device."""
    n = torch.empty(1, dtype=torch.int64)
    dist.recv(n, src, group=_CPU_GROUP)
    if int(n) == 0:
        raise TPError(f"rank {src} could not send its object")
    data = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(data, src, group=_CPU_GROUP)
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location=_DEVICE, weights_only=False)


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _op_gather(obj) -> None:
    """A follower's side of TPGroup.gather: send its own `obj` to rank 0 (nothing, when it cannot
    be serialised: rank 0 raises, and the ranks, which changed nothing, go on)."""
    try:
        payload = _dumps(obj)
    except Exception:  # noqa: BLE001 - rank 0 hears of it by the empty message
        log.warning("gather: this rank's object cannot be serialised", exc_info=True)
        payload = b""
    _send_obj(payload, 0)


def _op_scatter():
    """A follower's side of TPGroup.scatter: its object from rank 0."""
    return _recv_obj(0)


_OPS = {"gather": _op_gather, "scatter": _op_scatter}


@dataclasses.dataclass(frozen=True)
class Surface:
    """What of an object a Remote forwards: `broadcast` methods run on every rank (None: every
    method), `drive` methods run on rank 0 with the Remote as self (so the calls they make
    broadcast), `children` are members reached as Remotes of their own Surface."""

    broadcast: frozenset | None = None
    drive: frozenset = frozenset()
    children: tuple[tuple[str, Surface], ...] = ()


class Remote:
    """Rank 0's view of an object every rank holds: reading a plain attribute reads rank 0's, a
    method runs as its Surface says. A module or a member that the Surface does not name is
    refused: a forward on rank 0 alone would wait for the other ranks forever."""

    def __init__(self, group: TPGroup, handle: int, obj, surface: Surface = Surface(), path=()):
        self._group, self._handle, self._obj, self._surface, self._path = group, handle, obj, surface, tuple(path)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        surface = self._surface
        for child, sub in surface.children:
            if child == name:
                return Remote(self._group, self._handle, getattr(self._obj, name), sub, (*self._path, name))
        value = getattr(self._obj, name)
        if name in surface.drive:
            fn = getattr(type(self._obj), name)
            return lambda *a, **k: fn(self, *a, **k)
        if callable(value) and (surface.broadcast is None or name in surface.broadcast):
            return lambda *a, **k: self._group.call(self._handle, (*self._path, name), a, k)
        if isinstance(value, nn.Module):
            raise TPError(f"{name!r} is a module of rank 0 only: reach it through a Remote")
        return value

    def __setattr__(self, name, value):
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            raise TPError(f"setting {name!r} on rank 0 alone would leave the other ranks behind")

    @property
    def group(self) -> TPGroup:
        return self._group

    @property
    def local(self):
        """Rank 0's own object (read it; never change it)."""
        return self._obj


# An Engine's surface: what runs the model or changes a cache broadcasts, the warm-up runs on rank
# 0 over the Remote (its requests go through rank 0's scheduler), the model, the entry store and the
# runner are Remotes
MODEL_SURFACE = Surface(frozenset({"empty_state", "forward_layout", "build_span_data", "replay_linear_group"}))
STORE_SURFACE = Surface(frozenset({"put", "get", "pop", "evict", "clear", "demote_all", "remove", "discard"}))
RUNNER_SURFACE = Surface(frozenset({"empty_state", "forward", "build_span", "build_spans", "stage",
                                    "new_state_pool", "decode", "warm_decode", "restore_state"}))
ENGINE_SURFACE = Surface(
    frozenset({"build_entry", "build_entries", "get_or_build_entry", "prefill", "start_prefill", "prefill_chunk",
               "abandon_prefill", "finish_prefix", "swap_caches", "decode_batch", "new_state_pool"}),
    frozenset({"warmup"}),
    (("model", MODEL_SURFACE), ("entries", STORE_SURFACE), ("runner", RUNNER_SURFACE)),
)


class TPGroup:
    """Rank 0's side of a started group: `target` is the Remote of rank 0's built object."""

    def __init__(self, size: int, procs: list, channel: Channel, target_obj, surface: Surface):
        self.size, self.procs, self.channel = size, procs, channel
        self.handles = _Handles(strong=False)
        self._lock = threading.RLock()
        self._closed = self._shut = self._diverged = False
        self.handles.name(target_obj, 0)
        self.target = Remote(self, 0, target_obj, surface)

    def call(self, handle: int, path: tuple, args: tuple, kwargs: dict):
        """Run target[handle].path(*args, **kwargs) on every rank; rank 0's result."""
        with self._lock:
            if self._closed:
                raise TPError("the tensor-parallel group is shut down")
            self._send_call(handle, path, args, kwargs)
            fn = self.handles.get(handle)
            for name in path:
                fn = getattr(fn, name)
            # rank 0 runs the call on its own objects: a Remote among the arguments is its local
            # object here (a call through it would broadcast again, inside this call)
            try:
                out = fn(*_local(args), **_local(kwargs))
            except Exception:
                if self._outcome(True) != self.size:
                    self._broken("rank 0 failed where the other ranks did not")
                raise  # every rank failed alike: the caller's error, the group goes on
            if self._outcome(False):
                self._broken(f"{'.'.join(path)} failed on another rank (its log says why)")
            self.handles.walk(out)
            if type(out).__name__ in _REMOTE:
                return Remote(self, self.handles.of[id(out)], out)
            return out

    def _send_call(self, handle: int, path: tuple, args: tuple, kwargs: dict) -> None:
        buf = io.BytesIO()
        _Pickler(buf, self.handles).dump((self.handles.next, handle, path, args, kwargs))
        self.channel.send(pickle.dumps((self.handles.take_dead(), buf.getvalue())))

    def _op(self, name: str, args: tuple, run: Callable):
        """Group operation `name`: the followers run _OPS[name](*args) (args pickled as a call's
        are: named objects by handle), rank 0 runs `run()` meanwhile; rank 0's result."""
        with self._lock:
            if self._closed:
                raise TPError("the tensor-parallel group is shut down")
            self._send_call(_OP, (name,), args, {})
            try:
                out = run()
            except Exception:
                if self._outcome(True) != self.size:
                    self._broken(f"{name} failed on rank 0 only")
                raise
            if self._outcome(False):
                self._broken(f"{name} failed on another rank (its log says why)")
            return out

    def gather(self, obj) -> list:
        """Every rank's counterpart of `obj` (rank 0's own object, or a structure of named objects:
        each follower sends its own), in rank order; the followers' copies are rank 0's alone
        (their tensors on rank 0's device, named on no rank)."""
        def run():
            got, errors = [obj], []
            for r in range(1, self.size):  # from every follower, even after one failed (none is left sending)
                try:
                    got.append(_recv_obj(r))
                except TPError as e:
                    errors.append(e)
            return got, errors

        # a follower that could not send leaves the ranks as they were: the call succeeds on every
        # rank, and rank 0 raises after it
        got, errors = self._op("gather", (obj,), run)
        if errors:
            raise errors[0]
        return got

    def scatter(self, objs: list):
        """Give rank r objs[r] (len(objs) == size, alike in structure) and name each rank's
        alike, as a broadcast call's result is: rank 0's object (objs[0]) can then be passed to
        broadcast calls, where each follower finds its own. A follower's tensors land on its
        device; rank 0's object is its own, as given."""
        if len(objs) != self.size:
            raise ValueError(f"scatter of {len(objs)} objects over {self.size} ranks")

        def run():
            payloads = []
            try:
                payloads = [_dumps(o) for o in objs[1:]]
            finally:
                if len(payloads) != self.size - 1:  # serialising failed: every follower fails too
                    for r in range(1, self.size):
                        _send_obj(b"", r)
            for r, payload in enumerate(payloads, 1):
                _send_obj(payload, r)
            return objs[0]

        out = self._op("scatter", (), run)
        self.handles.walk(out)
        return out

    def _outcome(self, failed: bool) -> int:
        try:
            return _outcome(failed, self.size)
        except RuntimeError:
            # a follower left (it failed a call rank 0 was still in, and exited to end it)
            self._broken("a follower rank exited")

    def _broken(self, why: str):
        """The ranks no longer hold the same objects: nothing more can be mirrored."""
        self._closed = self._diverged = True
        raise TPError(f"the tensor-parallel ranks diverged: {why}; the worker must restart")

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._lock:
            if self._shut:
                return
            self._closed = self._shut = True
            try:
                if not self._diverged:  # diverged followers have left already
                    self.channel.send(b"")
            finally:
                for p in self.procs:
                    p.join(timeout)
                    if p.is_alive():
                        p.kill()
                dist.destroy_process_group()


def _local(x):
    """x with every Remote in it (through lists, tuples and dict values) replaced by its object."""
    if isinstance(x, Remote):
        return x._obj
    if isinstance(x, (list, tuple)):
        return type(x)(_local(v) for v in x)
    if isinstance(x, dict):
        return {k: _local(v) for k, v in x.items()}
    return x


def _init(rank: int, size: int, init_method: str, device: str, timeout_s: float) -> Channel:
    if device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    global _CPU_GROUP, _DEVICE
    _DEVICE = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    # a group of its own even on the CPU: a rank that skipped a forward's all-reduce must not meet
    # another rank's control message in its place
    _CPU_GROUP = dist.new_group(backend="gloo")
    return Channel(_CPU_GROUP)


def _outcome(failed: bool, size: int, timeout_s: float | None = None) -> int:
    """How many ranks' calls failed (every rank says after every call). A follower whose call
    failed waits `timeout_s` at most: rank 0 may be held in a collective the follower never
    reached, which ends only when the follower's process does."""
    flag = torch.tensor([int(failed)], dtype=torch.int64)
    work = dist.all_reduce(flag, group=_CPU_GROUP, async_op=True)
    if timeout_s is None:
        work.wait()
    elif not work.wait(timeout=datetime.timedelta(seconds=timeout_s)):
        raise TimeoutError("rank 0 did not finish the call")
    return int(flag)


def _follow(rank: int, size: int, init_method: str, device: str, timeout_s: float, build: Callable) -> None:
    """A follower's life: join the group, build its target, then run every call rank 0 sends."""
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    channel = _init(rank, size, init_method, device, timeout_s)
    handles = _Handles(strong=True)
    handles.name(build(rank, size), 0)
    while True:
        payload = channel.recv()
        if not payload:
            break
        dead, call = pickle.loads(payload)
        handles.drop(dead)
        path = ("?",)
        try:
            counter, handle, path, args, kwargs = _Unpickler(io.BytesIO(call), handles).load()
            if counter != handles.next:
                raise TPError(f"handle counter {handles.next}, rank 0's {counter}")
            if handle == _OP:
                fn = _OPS[path[0]]
            else:
                fn = handles.get(handle)
                for name in path:
                    fn = getattr(fn, name)
            out = fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - rank 0 hears of it through _outcome
            log.warning("rank %d: %s failed", rank, ".".join(path), exc_info=True)
            try:
                failed = _outcome(True, size, timeout_s=60.0)
            except Exception:  # noqa: BLE001 - rank 0 is held in a collective: end this rank to free it
                log.error("rank %d: rank 0 is held in a call this rank failed; exiting", rank)
                os._exit(1)
            if failed != size:
                break  # rank 0 succeeded: the ranks diverged, and rank 0 stops mirroring
            continue
        if _outcome(False, size):
            break
        handles.walk(out)
    dist.destroy_process_group()


def start(size: int, build: Callable, surface: Surface = ENGINE_SURFACE, device: str = "cpu",
          timeout_s: float = 600.0) -> TPGroup:
    """Start a group of `size` ranks (this process is rank 0): spawn the followers, build every
    rank's target with build(rank, size) (a picklable callable) and return the group, whose
    `target` is the Remote of rank 0's, forwarding as `surface` says."""
    if size < 2:
        raise ValueError("a tensor-parallel group needs at least 2 ranks")
    if device == "cuda" and torch.cuda.device_count() < size:
        raise TPError(f"tensor-parallel size {size} needs {size} GPUs, {torch.cuda.device_count()} are visible")
    from hybridcache.services.launcher import free_port  # below the kernel's ephemeral range

    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_follow, args=(r, size, init_method, device, timeout_s, build), daemon=True,
                         name=f"tp-rank-{r}") for r in range(1, size)]
    for p in procs:
        p.start()
    try:
        channel = _init(0, size, init_method, device, timeout_s)
        target = build(0, size)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return TPGroup(size, procs, channel, target, surface)


def build_engine(path: str, config, rank: int, size: int):
    """An Engine over rank `rank`'s shard of the model in `path` (config: a RuntimeConfig). The
    cache budgets are the smallest any rank would pick, so every rank evicts alike."""
    from hybridcache.services.devices import with_cache_budgets
    from hybridcache.services.runtime.engine import Engine
    from hybridcache.services.runtime.loader import load_model
    from hybridcache.services.runtime.tokenizer import Tokenizer

    # CUDA graphs stay off: a captured forward would replay its all-reduces outside the order
    # in which the ranks' broadcast calls meet
    config = dataclasses.replace(config, tensor_parallel_size=size, cuda_graphs=config.cuda_graphs and size == 1)
    grouped = dist.is_initialized() and dist.get_world_size() > 1
    # every rank at once: each reads only its slices of the checkpoint (loader.load_model)
    model = load_model(path, config.device, config.torch_dtype, tp_rank=rank, tp_size=size)
    config = with_cache_budgets(config, model.device)
    if grouped:
        budgets = torch.tensor([config.entry_cache_bytes, config.prefix_cache_bytes], dtype=torch.int64)
        dist.all_reduce(budgets, op=dist.ReduceOp.MIN, group=_CPU_GROUP)
        config = dataclasses.replace(config, entry_cache_bytes=int(budgets[0]), prefix_cache_bytes=int(budgets[1]))
    return Engine(model, Tokenizer.from_dir(path), config)


def build_engines(named: dict, rank: int, size: int):
    """A namespace of engines, one per name: named = {name: (path, config)} (tests start one group
    for several models)."""
    import types

    return types.SimpleNamespace(**{n: build_engine(p, c, rank, size) for n, (p, c) in named.items()})



def check_split(path: str, size: int) -> None:
    """ModelConfigError when `size` does not divide a head count of the model in `path`: the split
    of a meta model (no weights read), before any rank starts and loads."""
    from hybridcache.services.runtime.models.registry import build_model, config_from_dir
    from hybridcache.services.runtime.tensor_parallel.shard import shard_model

    with torch.device("meta"):
        shard_model(build_model(config_from_dir(path)), 0, size)


def open_engine(path: str, config):
    """The engine a worker serves with: an Engine for tensor_parallel_size 1, else the Remote of
    rank 0's Engine in a started group (its `.group` shuts the followers down)."""
    size = config.tensor_parallel_size
    if size == 1:
        return build_engine(path, config, 0, 1)
    check_split(str(path), size)
    group = start(size, functools.partial(build_engine, str(path), config), ENGINE_SURFACE, config.device)
    atexit.register(group.shutdown)  # a command that returns without shutting it down
    return group.target
