"""No cheap request costs the router dearly: a 4 MiB request of every shape (one long text, many
messages, many content parts, a separator cutting a text into pieces, large tools, /tokenize of a
prompt and of messages, /detokenize, a long id list, many segments) costs under 0.5 s of the router's
CPU and delays a concurrent /health by under 100 ms, on the shipped model's tokenizer with a real
chat template (Qwen's ChatML with tools). The bounds are checked before the template renders and
before text is tokenized; what runs runs off the event loop."""

from __future__ import annotations

import http.client as httpclient
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from hybridcache.services.api.chat_template import ChatLimits, ChatTemplate, PrepareCancelled, PrepareDeadline
from hybridcache.services.launcher import LocalCluster, free_port
from hybridcache.services.runtime.modelzoo import SHIPPED_MODEL
from hybridcache.services.runtime.sampling import RequestError
from serving_helpers import http

TEMPLATE = (Path(__file__).parent / "data" / "chatml_tools.jinja").read_text()
MIB = 1 << 20
BODY = 4 * MIB - 4096  # under the default --max-request-bytes (4 MiB): read and parsed, not refused unread
CPU_S = 0.5
HEALTH_S = 0.1
BASELINE_S = 0.5  # /health probed this long before each request: the waits it sees with no request running


def shipped_with_template(root: Path) -> Path:
    """models/default with a chat template (the shipped model has none: real model directories do)."""
    out = root / "default-chat"
    shutil.copytree(SHIPPED_MODEL, out)
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = shipped_with_template(tmp_path_factory.mktemp("cost"))
    with LocalCluster(path, port=free_port(), scatter_workers=0) as c:
        yield c


def _fill(make, size: int = BODY) -> bytes:
    """The JSON of make(n) for the largest n whose body stays under `size` (make is monotone in n)."""
    lo, hi = 1, 1
    while len(json.dumps(make(hi))) < size:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(json.dumps(make(mid))) < size else (lo, mid)
    raw = json.dumps(make(lo)).encode()
    assert size - 64 * 1024 < len(raw) < size, len(raw)
    return raw


def _chat(messages, **extra):
    return {"messages": messages, "max_tokens": 2, **extra}


PART = {"type": "text", "text": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "description": "d" * 200, "parameters": {"type": "object"}}}
SHAPES = {
    "chat-one-long-text": ("/v1/chat/completions", lambda n: _chat([{"role": "user", "content": "word " * n}])),
    "chat-many-messages": ("/v1/chat/completions",
                           lambda n: _chat([{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"}
                                            for i in range(n)])),
    "chat-many-parts": ("/v1/chat/completions", lambda n: _chat([{"role": "user", "content": [PART] * n}])),
    "chat-separator-pieces": ("/v1/chat/completions",
                              lambda n: _chat([{"role": "user", "content": "a|" * n}], separator="|")),
    "chat-tools": ("/v1/chat/completions", lambda n: _chat([{"role": "user", "content": "hi"}], tools=[TOOL] * n)),
    "tokenize-prompt": ("/tokenize", lambda n: {"prompt": "word " * n}),
    "tokenize-messages": ("/tokenize", lambda n: {"messages": [{"role": "user", "content": [PART] * n}]}),
    "detokenize": ("/detokenize", lambda n: {"tokens": [5] * n}),
    "completion-ids": ("/v1/completions", lambda n: {"prompt": [5] * n, "max_tokens": 2}),
    "generate-text": ("/generate", lambda n: {"text": "w" * n}),
    "generate-segments": ("/generate", lambda n: {"segments": ["ab"] * n, "text": "q"}),
}


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid`, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class HealthProbe:
    """/health asked over and over on one kept-alive connection while a request runs; the longest wait."""

    def __init__(self, port: int):
        self.port, self.waits, self.failures = port, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        conn = httpclient.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                conn.request("GET", "/health")
                r = conn.getresponse()
                r.read()
                self.waits.append(time.perf_counter() - t0)
                if r.status != 200:
                    self.failures.append(r.status)
                time.sleep(0.005)
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.failures.append(repr(e))
        finally:
            conn.close()

    def __enter__(self):
        """Starts probing; the longest wait over BASELINE_S before the request (the machine's own
        scheduling noise, which a shared CI machine has) is the baseline a delay is counted from."""
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.failures and time.monotonic() < deadline and (
                not self.waits or sum(self.waits) < BASELINE_S):
            time.sleep(0.01)
        assert self.waits and not self.failures, self.failures
        self.baseline, self._mark = max(self.waits), len(self.waits)
        return self

    def delay(self) -> float:
        """How much longer than the baseline the longest /health wait since the request began was."""
        return max(self.waits[self._mark:], default=0.0) - self.baseline

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        assert not self.failures, self.failures


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_4mib_request_costs_the_router_little_and_never_blocks_health(served, shape):
    path, make = SHAPES[shape]
    raw = _fill(make)
    pid = served.role("router")[0].proc.pid
    assert http("POST", f"{served.url}/generate", {"text": "warm", "sampling_params": {"max_new_tokens": 1}})[0] == 200
    with HealthProbe(served.port) as probe:
        before = cpu_seconds(pid)
        status, res = http("POST", f"{served.url}{path}", raw=raw, timeout=60)
        spent = cpu_seconds(pid) - before
        time.sleep(0.05)  # a probe or two after the answer
    assert 400 <= status < 500, (status, str(res)[:300])
    assert isinstance(res, dict) and res["error"]["message"], res
    assert spent < CPU_S, (shape, spent, res["error"]["message"][:200])
    assert probe.delay() < HEALTH_S, (shape, max(probe.waits), probe.baseline)


def test_a_chat_just_under_the_bounds_is_rendered_and_tokenized_cheaply(served):
    """The most a chat that passes the bounds may cost: as many parts as segments, as many characters
    as could fit (the prompt then runs past the served length: refused after tokenizing)."""
    path = SHAPES["chat-many-parts"][0]
    info = http("POST", f"{served.url}/tokenize", {"prompt": "x"})[1]
    assert info["max_model_len"] == 8192
    parts = [{"type": "text", "text": ("lorem ipsum dolor " * 200)[:3400]} for _ in range(30)]
    pid = served.role("router")[0].proc.pid
    with HealthProbe(served.port) as probe:
        before = cpu_seconds(pid)
        status, res = http("POST", f"{served.url}{path}", _chat([{"role": "user", "content": parts}]), timeout=60)
        spent = cpu_seconds(pid) - before
    assert status == 400 and "context limit of 8192" in res["error"]["message"], res
    assert spent < CPU_S and probe.delay() < HEALTH_S, (spent, max(probe.waits), probe.baseline)
    # and a chat of the same parts that fits is served
    small = [{"type": "text", "text": "lorem ipsum"} for _ in range(30)]
    status, res = http("POST", f"{served.url}{path}", _chat([{"role": "user", "content": small}]), timeout=60)
    assert status == 200, res


def _template_and_tokenizer():
    from hybridcache.services.runtime.tokenizer import Tokenizer

    return ChatTemplate("test", TEMPLATE, {"eos_token": "<|im_end|>"}), Tokenizer.from_dir(SHIPPED_MODEL)


def test_rendering_stops_at_the_deadline_when_the_client_leaves_and_past_max_chars():
    from hybridcache.services.api.openai_compat import chat_to_native

    template, tok = _template_and_tokenizer()
    chat = {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(600)]}
    with pytest.raises(PrepareDeadline):
        chat_to_native(chat, template, tok, limits=ChatLimits(deadline=time.monotonic() - 1))
    with pytest.raises(PrepareCancelled):
        chat_to_native(chat, template, tok, limits=ChatLimits(cancelled=lambda: True))
    with pytest.raises(RequestError, match="renders these messages to more than 1000 characters"):
        template.render(chat["messages"], limits=ChatLimits(max_chars=1000))
    with pytest.raises(RequestError, match="600 messages"):
        chat_to_native(chat, template, tok, limits=ChatLimits(max_messages=512))
    # unbounded, the same chat renders (its texts markup and segments, as before)
    native = chat_to_native(chat, template, tok)
    assert native["suffix"] and len(native["segments"]) > 600


def test_marker_work_is_linear_in_the_texts():
    """2,000 content parts: the audit measured 2.4 s (markers replaced text by text, found one by one)."""
    from hybridcache.services.api.openai_compat import chat_to_native

    template, tok = _template_and_tokenizer()
    parts = [{"type": "text", "text": f"doc {i}."} for i in range(2000)]
    t0 = time.process_time()
    native = chat_to_native({"messages": [{"role": "user", "content": parts}]}, template, tok)
    spent = time.process_time() - t0
    assert len(native["segments"]) > 1000 and native["suffix"]
    assert spent < 0.5, spent
