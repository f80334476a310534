"""The processes of a tensor-parallel worker: rank 0 and the N - 1 followers it starts.

Rank 0 runs everything a worker runs (scheduler, engine, servers) and keeps all the bookkeeping:
the request queue, the page tree, the entry and prefix stores. Every rank holds a ModelRunner over
its shard of the model (its slices of every layer's heads), and its slices of the tensors those
caches name. The followers run nothing but the runner calls rank 0 makes, nano-vllm's
ModelRunner.call: rank 0's runner is a RankedRunner, and each of its method calls is one call
that reaches every rank, in the order rank 0 makes them. Rank 0 pickles (method, arguments),
broadcasts them on a gloo group and runs the method on its own runner; each follower runs the
same method on its own. There is no list of methods that cross: every method of the runner does,
and the objects a call returns that carry methods of their own (a state pool) come back to rank 0
as RankObjects, whose methods refuse to run (they would change rank 0's object alone): they
change through the runner's methods. Every model forward thus runs on all ranks in the same order
and its all-reduces meet.

`start(size, build, device)` spawns the followers (torch.multiprocessing, spawn), joins them in
one torch.distributed group (NCCL on CUDA, one GPU a rank; gloo on the CPU) and calls
`build(rank, size)` on every rank: each builds its target, a runner (build_runner) or a namespace
of runners (build_runners, tests). `open_engine` is a worker's: rank 0's Engine over the group.

Objects are named across ranks by handle: what rank 0 passes to a call and gets back holds that
rank's tensors (states, entries, K/V, page payloads), and each follower holds its own
counterparts. After every call every rank walks the call's arguments and result in the same order
(lists, tuples, dict values, the fields of dataclasses; a list of ints is token ids, not entered)
and gives each object that has no handle yet the next one; a handle in a later call's arguments
stands for the follower's own object, and a handle whose object rank 0 has dropped is dropped on
the followers with the next call. An object rank 0 made itself and passes for the first time (a
page recorder, a layout's live runs) travels by value and is named alike from then on. A tensor
without a handle is refused (TPError) unless it is a CPU integer tensor (token ids, positions): it
would carry rank 0's slice to the other ranks, a wrong answer instead of an error.

Per-rank objects also move between rank 0 and the followers as a whole, point to point on the
gloo group (torch.save bytes, tensors landing on the receiving rank's device): `gather(obj)`
hands rank 0 every rank's counterpart of a named object (a scatter worker collects the ranks'
slices of the entries it built), `scatter(objs)` gives rank r objs[r] and names them alike on
every rank (a combine worker hands each rank its slice of a received entry).

What runs otherwise at tensor-parallel size > 1 is decided by the ModelRunner in one place
(ModelRunner.__init__): no CUDA graphs, no overlapped decode steps.
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

_CPU_GROUP = None  # the gloo group of the control messages and the calls' outcomes
_DEVICE = torch.device("cpu")  # this rank's device: where the objects it receives land
_OP = -1  # the handle of a group operation (gather, scatter) in a control message
_PLAIN = (int, float, str, bool, bytes, complex, slice, type(None), torch.dtype, torch.device, type)
# the tensors rank 0 may pass without a handle: the same on every rank (token ids, positions)
_SHARED_DTYPES = (torch.int64, torch.int32)


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
        try:
            ref = weakref.ref(obj)
        except TypeError:
            if handle is None:
                return None
            ref = None
        if self.strong or handle is not None:
            ref = obj
        else:
            weakref.finalize(obj, self._gone, id(obj))
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
        of dataclasses, in a fixed order, so that every rank names its own counterparts with the
        same handles. A list whose first item is an int (token ids) is not entered."""
        seen = set() if seen is None else seen
        if isinstance(obj, _PLAIN) or id(obj) in seen or isinstance(obj, (nn.Module, RankObject)):
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            if isinstance(obj, list) and obj and type(obj[0]) is int:
                return
            for x in obj:
                self.walk(x, seen)
            return
        if isinstance(obj, dict):
            for x in obj.values():
                self.walk(x, seen)
            return
        self.name(obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                self.walk(getattr(obj, f.name), seen)


class _Pickler(pickle.Pickler):
    def __init__(self, f, handles: _Handles):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.handles = handles

    def persistent_id(self, obj):
        if isinstance(obj, _PLAIN) or isinstance(obj, (list, tuple, dict)):
            return None
        if isinstance(obj, RankObject):
            return obj._handle
        h = self.handles.of.get(id(obj))
        if h is not None:
            return h
        if isinstance(obj, torch.Tensor) and (obj.device.type != "cpu" or obj.dtype not in _SHARED_DTYPES):
            raise TPError(
                f"a {tuple(obj.shape)} {obj.dtype} tensor on {obj.device} made outside the runner's calls was passed "
                "to one: it holds rank 0's data only (make it inside a runner call)"
            )
        if isinstance(obj, nn.Module):
            raise TPError(f"a {type(obj).__name__} module of rank 0 was passed to a runner call")
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


def _resolve(root, path: tuple):
    """root.path[0].path[1]...: a target's method (names starting with "_" are not reachable)."""
    obj = root
    for name in path:
        if name.startswith("_"):
            raise TPError(f"{name!r} is not a runner call")
        obj = getattr(obj, name)
    return obj


class RankObject:
    """Rank 0's view of an object a runner call returned that has methods of its own (a state
    pool): its attributes read rank 0's object; its methods refuse to run, since they would change
    rank 0's object alone (change it through the runner's calls). Passed back to a call, each rank
    finds its own counterpart."""

    def __init__(self, handle: int, obj):
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_obj", obj)

    def __getattr__(self, name):
        value = getattr(self._obj, name)
        if callable(value) and not isinstance(value, (type, nn.Module)):
            raise TPError(f"{type(self._obj).__name__}.{name} would run on rank 0 alone: change it through the runner")
        return value

    def __setattr__(self, name, value):
        raise TPError(f"setting {name!r} on rank 0's {type(self._obj).__name__} alone would leave the other "
                      "ranks behind")

    @property
    def local(self):
        """Rank 0's own object (read it; never change it)."""
        return self._obj


def _returned(handles: _Handles, out):
    """What rank 0's caller gets back: objects with methods of their own as RankObjects."""
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return tuple(_returned(handles, x) for x in out)
    if isinstance(out, list):
        return [_returned(handles, x) for x in out]
    if (isinstance(out, _PLAIN) or isinstance(out, (dict, torch.Tensor, nn.Module))
            or dataclasses.is_dataclass(out) or not _has_methods(out)):
        return out
    h = handles.of.get(id(out))
    return RankObject(h, out) if h is not None else out


@functools.cache
def _methods_of(cls) -> bool:
    return any(callable(v) and not k.startswith("__") for c in cls.__mro__[:-1] for k, v in vars(c).items())


def _has_methods(obj) -> bool:
    return _methods_of(type(obj))


def _local(x):
    """x with every RankObject in it (through lists, tuples and dict values) replaced by its object."""
    if isinstance(x, RankObject):
        return x._obj
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_local(v) for v in x)
    if isinstance(x, dict):
        return {k: _local(v) for k, v in x.items()}
    return x


class RankedRunner:
    """Rank 0's ModelRunner under tensor parallelism (module docstring): every method call is one
    call on every rank (TPGroup.call); a plain attribute (the config, the device, whether graphs
    apply) reads rank 0's runner. `group` is the group; `local` rank 0's own runner."""

    def __init__(self, group: TPGroup, path: tuple, runner):
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "_path", tuple(path))
        object.__setattr__(self, "local", runner)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self.local, name)
        if isinstance(value, nn.Module):
            raise TPError(f"{name!r} is a module of rank 0 only: run it through the runner's calls")
        if callable(value) and not isinstance(value, type):
            return functools.partial(self.group.call, (*self._path, name))
        return value

    def __setattr__(self, name, value):
        raise TPError(f"setting {name!r} on rank 0's runner alone would leave the other ranks behind")


class TPGroup:
    """Rank 0's side of a started group: `local` is rank 0's built target (runner(...) reaches a
    runner of it)."""

    def __init__(self, size: int, procs: list, channel: Channel, target):
        self.size, self.procs, self.channel = size, procs, channel
        self.handles = _Handles(strong=False)
        self._lock = threading.RLock()
        self._closed = self._shut = self._diverged = False
        self.handles.name(target, 0)
        self.local = target

    def runner(self, *path: str) -> RankedRunner:
        """The RankedRunner of the runner at attribute `path` of the target (none: the target)."""
        return RankedRunner(self, path, _resolve(self.local, path))

    def call(self, path: tuple, *args, **kwargs):
        """Run target.path(*args, **kwargs) on every rank; rank 0's result."""
        with self._lock:
            if self._closed:
                raise TPError("the tensor-parallel group is shut down")
            self._send_call(0, path, args, kwargs)
            try:
                out = _resolve(self.local, path)(*_local(args), **_local(kwargs))
            except Exception:
                if self._outcome(True) != self.size:
                    self._broken("rank 0 failed where the other ranks did not")
                raise  # every rank failed alike: the caller's error, the group goes on
            if self._outcome(False):
                self._broken(f"{'.'.join(path)} failed on another rank (its log says why)")
            self.handles.walk((args, kwargs, out))
            return _returned(self.handles, out)

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
        alike, as a call's result is: rank 0's object (objs[0]) can then be passed to runner
        calls, where each follower finds its own. A follower's tensors land on its device; rank 0's
        object is its own, as given."""
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


def _store(port: int, size: int, timeout_s: float) -> dist.TCPStore:
    """The group's rendezvous store: rank 0's listens on a port the OS picks (port 0, from the
    ephemeral range, so never one that `hybridcache up` chose for a service that has not bound it
    yet); a follower connects to it."""
    return dist.TCPStore("127.0.0.1", port, size, is_master=port == 0, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _init(rank: int, size: int, store: dist.Store, device: str, timeout_s: float) -> Channel:
    if device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
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


def _follow(rank: int, size: int, port: int, device: str, timeout_s: float, build: Callable) -> None:
    """A follower's life: join the group, build its target, then run every call rank 0 sends."""
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    channel = _init(rank, size, _store(port, size, timeout_s), device, timeout_s)
    handles = _Handles(strong=True)
    target = build(rank, size)
    handles.name(target, 0)
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
            fn = _OPS[path[0]] if handle == _OP else _resolve(target, path)
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
        # name what the call made as rank 0 does (TPGroup.call walks its arguments and result;
        # a scatter, its result)
        handles.walk(out if handle == _OP else (args, kwargs, out))
    dist.destroy_process_group()


def start(size: int, build: Callable, device: str = "cpu", timeout_s: float = 600.0) -> TPGroup:
    """Start a group of `size` ranks (this process is rank 0): spawn the followers, build every
    rank's target with build(rank, size) (a picklable callable: a runner, or a namespace of them)
    and return the group (group.runner(...) is rank 0's RankedRunner of a target's runner)."""
    if size < 2:
        raise ValueError("a tensor-parallel group needs at least 2 ranks")
    if device == "cuda" and torch.cuda.device_count() < size:
        raise TPError(f"tensor-parallel size {size} needs {size} GPUs, {torch.cuda.device_count()} are visible")
    store = _store(0, size, timeout_s)
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_follow, args=(r, size, store.port, device, timeout_s, build), daemon=True,
                         name=f"tp-rank-{r}") for r in range(1, size)]
    for p in procs:
        p.start()
    try:
        channel = _init(0, size, store, device, timeout_s)
        target = build(0, size)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return TPGroup(size, procs, channel, target)


def build_runner(path: str, config, rank: int, size: int):
    """A ModelRunner over rank `rank`'s shard of the model in `path` (config: a RuntimeConfig). Its
    config's cache budgets are the smallest any rank would pick: rank 0's engine sizes its stores
    by them, and every rank holds its slice of what they hold."""
    from hybridcache.services.devices import with_cache_budgets
    from hybridcache.services.runtime.loader import load_model
    from hybridcache.services.runtime.runner import ModelRunner

    config = dataclasses.replace(config, tensor_parallel_size=size)
    # every rank at once: each reads only its slices of the checkpoint (loader.load_model)
    model = load_model(path, config.device, config.torch_dtype, tp_rank=rank, tp_size=size)
    config = with_cache_budgets(config, model.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        budgets = torch.tensor([config.entry_cache_bytes, config.prefix_cache_bytes], dtype=torch.int64)
        dist.all_reduce(budgets, op=dist.ReduceOp.MIN, group=_CPU_GROUP)
        config = dataclasses.replace(config, entry_cache_bytes=int(budgets[0]), prefix_cache_bytes=int(budgets[1]))
    return ModelRunner(model, config)


def build_runners(named: dict, rank: int, size: int):
    """A namespace of runners, one per name: named = {name: (path, config)} (tests start one group
    for several models)."""
    import types

    return types.SimpleNamespace(**{n: build_runner(p, c, rank, size) for n, (p, c) in named.items()})


def engine_of(group: TPGroup, model_dir: str, *path: str):
    """Rank 0's Engine over the group's runner at `path` (of the model in `model_dir`): its caches and
    requests on rank 0, its runner's calls on every rank."""
    from hybridcache.services.runtime.engine import Engine
    from hybridcache.services.runtime.tokenizer import Tokenizer

    runner = group.runner(*path)
    return Engine(runner.local.model, Tokenizer.from_dir(model_dir), runner.config, runner=runner)


def check_split(path: str, size: int) -> None:
    """ModelConfigError when `size` does not divide a head count of the model in `path`: the split
    of a meta model (no weights read), before any rank starts and loads."""
    from hybridcache.services.runtime.models.registry import build_model, config_from_dir
    from hybridcache.services.runtime.tensor_parallel.shard import shard_model

    with torch.device("meta"):
        shard_model(build_model(config_from_dir(path)), 0, size)


def open_engine(path: str, config):
    """The engine a worker serves with: an Engine for tensor_parallel_size 1, else rank 0's Engine
    over a started group (its `group` shuts the followers down)."""
    from hybridcache.services.runtime.engine import Engine

    size = config.tensor_parallel_size
    if size == 1:
        return Engine.from_dir(path, config.device, config.torch_dtype, config)
    check_split(str(path), size)
    group = start(size, functools.partial(build_runner, str(path), config), config.device)
    atexit.register(group.shutdown)  # a command that returns without shutting it down
    return engine_of(group, str(path))
