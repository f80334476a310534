"""A real load generator, unmodified: guidellm (requirements/loadgen.txt, in the side environment
.venv/loadgen that scripts/bootstrap.d/loadgen.sh builds) benchmarks `hybridcache up` serving the
shipped model, a few synchronous requests of 64 prompt and 8 output tokens on each OpenAI route it
drives. Its JSON report must count every request successful, none errored or incomplete, each with
streamed output: guidellm exits 0 even when every request failed (a server refusing one of the
fields it always sends, `ignore_eos` or `stream_options`, leaves all-zero tables), so the report is
what is checked, not its exit status."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hybridcache.services.launcher import free_port
from serving_helpers import stop_up
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
GUIDELLM = ROOT / ".venv" / "loadgen" / "bin" / "guidellm"
PINNED = re.search(r"^guidellm==(\S+)", (ROOT / "requirements" / "loadgen.txt").read_text(), re.M).group(1)
TOKENIZER = Tokenizer.from_file(str(ROOT / "models" / "default" / "tokenizer.json"))
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 4, 64, 8

pytestmark = pytest.mark.skipif(
    not GUIDELLM.exists(),
    reason="guidellm's side environment .venv/loadgen is absent: `make setup` "
           "(scripts/bootstrap.d/loadgen.sh) builds it")


@pytest.fixture(scope="module")
def up_url():
    """`hybridcache up` with its defaults but no scatter workers: guidellm's prompts carry no
    segments, so the router, combine worker and cache tier serve them all (and start in half the time)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hybridcache.services.cli", "up", "--port", str(port),
                             "--scatter-workers", "0"], stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"], ready
        yield ready["http"]
    finally:
        stop_up(proc)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_benchmark_of_up_succeeds_on_every_request(up_url, tmp_path, route):
    report_path = tmp_path / "benchmarks.json"
    cmd = [str(GUIDELLM), "run",
           "--backend", f"kind=openai_http,target={up_url},request_format={route}",
           "--profile", "kind=synchronous",
           "--constraint", f"kind=max_requests,count={REQUESTS}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=huggingface_auto,model={ROOT / 'models' / 'default'}",
           "--output", f"kind=json,path={report_path}",
           "--disable-console-interactive"]
    # no hub: the tokenizer is the shipped model's file, the data synthetic; caches in tmp_path
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    report = json.loads(report_path.read_text())
    assert report["metadata"]["guidellm_version"] == PINNED
    (bench,) = report["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    errors = [r["info"]["error"] for r in bench["requests"]["errored"] or []]
    assert totals["errored"] == 0 and totals["incomplete"] == 0, (totals, errors)
    # guidellm's max_requests constraint stops taking results once its processed count reaches the
    # limit, which its worker processes report racily: a report has held 3 of 4 (none errored or
    # incomplete) on a loaded CI machine
    assert REQUESTS - 1 <= totals["successful"] == totals["total"] <= REQUESTS, (totals, errors)
    done = bench["requests"]["successful"]
    assert len(done) == totals["successful"]
    for req in done:
        body = json.loads(req["request_args"])["body"]
        # the request as guidellm sends it: streamed, usage asked for, the output length fixed by ignore_eos
        assert body["ignore_eos"] is True and body["stream_options"]["include_usage"] is True
        assert ("messages" in body) == (route == "/v1/chat/completions")
        info = req["info"]
        assert info["status"] == "completed" and info["error"] is None
        # tokens streamed back, and the stream's usage read: only the server's usage sets
        # cached_tokens (prompt_tokens_details), and its counts override the ones guidellm asked for
        assert info["timings"]["token_iterations"] >= 1 and req["output"]
        assert req["input_metrics"]["cached_tokens"] is not None
        assert req["output_metrics"]["text_tokens"] == OUTPUT_TOKENS
        # guidellm decodes 64 sampled token ids into the prompt; the server counts that text as
        # the shipped tokenizer encodes it (63 where two tokens re-merge), messages joined as they
        # are for a model without a chat template
        text = body["prompt"] if route == "/v1/completions" else body["messages"][0]["content"][0]["text"]
        assert req["input_metrics"]["text_tokens"] == len(TOKENIZER.encode(text).ids)


def test_side_environment_holds_the_pinned_versions_and_leaves_the_test_environment_alone():
    pins = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", (ROOT / "requirements" / "loadgen.txt").read_text(), re.M))
    probe = ("import importlib.metadata as md, json, sys; "
             "print(json.dumps({n: md.version(n) for n in sys.argv[1:]}))")
    out = subprocess.run([str(GUIDELLM.parent / "python"), "-c", probe, *pins], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert json.loads(out) == pins
    # guidellm's click (~=8.4) stays in its own environment: the tests run with constraints.txt's
    constraints = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", (ROOT / "constraints.txt").read_text(), re.M))
    assert md.version("click") == constraints["click"] != pins["click"]
