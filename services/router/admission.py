"""Admission at the router: whether a request goes to a combine worker now or is refused at once
(HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED), decided before anything is planned, fetched
or built for it.

Per combine worker the router counts the requests it has in flight there and knows the worker's
seats (--max-num-seqs) and queue (--max-waiting) from its Info reply. It takes its requests there
as seated in the order they came, the first --max-num-seqs of them, the next one as one ends, and
the seated ones as sharing the worker equally: a request's work is the integral over its time in
a seat of 1 / (requests seated), the seconds of the worker it took. A running mean of the work of
the requests answered in full is the estimated cost of a request; a request that comes when the
seats are taken would get one once as many seated requests have finished as wait before it
(itself included), which the router works out from the work the seated ones have left and the
mean work of those waiting: its estimated wait. (A worker that decodes a batch faster than its
requests one by one finishes sooner than that: the estimate errs towards refusing.) A request is
refused when the queue is full or its wait would pass --max-queue-wait-s: a client is told to come
back rather than left waiting past the bound. Until one request there has been measured, none is
let wait: only the seats are given. Requests other routers sent are the combine worker's own check
(its full queue answers RESOURCE_EXHAUSTED too).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field


class Refused(Exception):
    """No combine worker has room: the message says why, retry_after_s when to come back."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Ticket:
    """One admitted request: where it went and when it took a seat there (None: still waiting)."""

    address: str
    seated: float | None = None
    share: float = 0.0  # the worker's share integral when it took its seat


@dataclass
class _Worker:
    seats: int
    queue: int
    tickets: list = field(default_factory=list)  # in flight, oldest first: the first `seats` hold the seats
    work_s: float | None = None  # running mean of a request's work (None: none measured yet)
    share: float = 0.0  # the integral of 1 / (requests seated) over the time any was
    at: float = 0.0  # when `share` was last brought up to date

    def advance(self, now: float) -> None:
        seated = min(len(self.tickets), self.seats)
        if seated:
            self.share += max(0.0, now - self.at) / seated
        self.at = now

    def wait_s(self, now: float) -> float:
        """The estimated wait for a seat of a request sent at `now`; inf past the queue, and for any
        wait before a request was measured (nothing says it would be short)."""
        ahead = len(self.tickets) - self.seats + 1  # finishes a request sent now waits for
        if ahead <= 0:
            return 0.0
        if ahead > self.queue or self.work_s is None:
            return math.inf
        self.advance(now)
        # the seated ones share the worker; each that finishes gives its seat to the next waiting
        left = [max(self.work_s - (self.share - t.share), 0.05 * self.work_s) for t in self.tickets[: self.seats]]
        waiting = len(self.tickets) - len(left)
        t = 0.0
        for _ in range(ahead):
            first = min(range(len(left)), key=left.__getitem__)  # the next to finish
            least = left.pop(first)
            t += least * (len(left) + 1)
            left = [r - least for r in left]
            if waiting:
                waiting -= 1
                left.append(self.work_s)
        return t


class Admission:
    SMOOTHING = 0.2  # weight of a new measurement in the running mean

    def __init__(self, max_queue_wait_s: float, seats: int = 16, queue: int = 64, clock=time.monotonic):
        self.max_queue_wait_s = max_queue_wait_s
        self._clock = clock
        self.default = (seats, queue)  # until a worker's Info says its own
        self._workers: dict[str, _Worker] = {}
        self._lock = threading.Lock()

    def configure(self, address: str, seats: int, queue: int) -> None:
        """A combine worker's seats and queue (its Info reply), also taken for workers not heard
        from yet (the workers of one deployment share their settings); seats 0 (a worker that does
        not say) changes nothing."""
        if seats <= 0:
            return
        with self._lock:
            self.default = (seats, max(0, queue))
            w = self._worker(address)
            w.seats, w.queue = self.default

    def _worker(self, address: str) -> _Worker:
        w = self._workers.get(address)
        if w is None:
            w = self._workers[address] = _Worker(*self.default)
        return w

    def wait_s(self, address: str) -> float:
        """The estimated wait of a request sent to `address` now (0: a seat is free)."""
        with self._lock:
            return self._worker(address).wait_s(self._clock())

    def check(self, order: list[str]) -> None:
        """Refused when no worker of `order` would take a request now (admit without taking a ticket):
        what a door asks before it parses a request, so a refusal costs no parsing."""
        with self._lock:
            now = self._clock()
            waits = [(w.wait_s(now), w) for w in map(self._worker, order)]
        if waits and all(wait > self.max_queue_wait_s for wait, _ in waits):
            self._refuse(*min(waits, key=lambda x: x[0]))

    def admit(self, order: list[str]) -> Ticket:
        """A ticket at the first of the combine workers `order` (the router's preference) with room;
        Refused when none has."""
        with self._lock:
            waits = []
            now = self._clock()
            for address in order:
                w = self._worker(address)
                wait = w.wait_s(now)
                if wait <= self.max_queue_wait_s:
                    w.advance(now)
                    ticket = Ticket(address)
                    if len(w.tickets) < w.seats:
                        ticket.seated, ticket.share = now, w.share
                    w.tickets.append(ticket)
                    return ticket
                waits.append((wait, w))
        self._refuse(*min(waits, key=lambda x: x[0]))

    def _refuse(self, wait: float, w: _Worker):
        retry = 1.0
        if math.isinf(wait) and w.work_s is None:
            message = (f"{len(w.tickets)} requests in flight at the combine worker fill its {w.seats} seats, and "
                       f"none has finished yet to tell how long a wait would be; retry later")
        elif math.isinf(wait):
            message = (f"{len(w.tickets)} requests in flight at the combine worker, {w.seats} running and "
                       f"{len(w.tickets) - w.seats} waiting: its seats and queue of {w.queue} are full; retry later")
            retry = w.work_s or 1.0
        else:
            message = (f"a request sent now would wait about {wait:.1f} s for a seat, more than the "
                       f"{self.max_queue_wait_s:g} s this server queues for (--max-queue-wait-s); retry later")
            retry = wait - self.max_queue_wait_s
        raise Refused(message, max(1.0, retry))

    def done(self, ticket: Ticket, answered: bool) -> None:
        """An admitted request ended (answered: in full, so its work is a measurement); the oldest
        waiting one takes its seat."""
        now = self._clock()
        with self._lock:
            w = self._worker(ticket.address)
            w.advance(now)
            if ticket in w.tickets:
                w.tickets.remove(ticket)
            if answered and ticket.seated is not None and w.share > ticket.share:
                work = w.share - ticket.share  # its share of the worker while it was seated
                w.work_s = work if w.work_s is None else (1 - self.SMOOTHING) * w.work_s + self.SMOOTHING * work
            for t in w.tickets[: w.seats]:
                if t.seated is None:
                    t.seated, t.share = now, w.share

    def in_flight(self, address: str) -> int:
        with self._lock:
            return len(self._worker(address).tickets)
