"""The recipes of docs/recipes.md against the local cluster: LangChain's stuff-documents chain (the
library itself, through ChatOpenAI), the openai SDK with an f-string prompt, and LlamaIndex's
response synthesizer (its requests recorded with the library, tests/data/, replayed: its OpenAI
client needs openai < 3, which this environment's openai 3 excludes). Each gets its documents back
from cache when they come back in another order, marked only by the default segment separator."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import openai
from serving_helpers import http

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
SEP = "<<PIC_SEP>>"


def _rag_reuse():
    spec = importlib.util.spec_from_file_location("rag_reuse", ROOT / "benchmarks" / "rag_reuse.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_langchain_stuff_chain_gets_reordered_documents_from_cache(clients_cluster):
    # benchmarks/rag_reuse.py's chain (the figure's), on 4 documents: the tiny model's bytes-as-tokens
    # prompts of 8 would pass the cluster's --max-model-len
    out = _rag_reuse().run(f"{clients_cluster.url}/v1", n_docs=4)
    first, second = out["first"], out["reordered"]
    assert second["prompt_tokens"] == first["prompt_tokens"] > 1000
    assert second["cached_fraction"] >= 0.9, out
    assert first["cached_tokens"] < second["cached_tokens"]


def test_openai_sdk_f_string_prompt_gets_reordered_documents_from_cache(clients_cluster):
    client = openai.OpenAI(base_url=f"{clients_cluster.url}/v1", api_key="none", max_retries=0, timeout=120)
    docs = [f"Ledger {i}: the {w} lighthouse keeper logged {i * 7 + 3} ships passing the Osk estuary "
            f"during the storms of the winter of 18{60 + i}, and noted each one's flag and cargo.\n" * 2
            for i, w in enumerate(("north", "south", "east", "west"))]

    def ask(order):
        context = SEP.join(docs[i] for i in order)
        return client.chat.completions.create(model="default", max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": f"Answer from the ledgers.\n{SEP}{context}"},
            {"role": "user", "content": "Which keeper logged the most ships?"}])

    first, second = ask([0, 1, 2, 3]), ask([3, 1, 0, 2])
    assert first.usage.prompt_tokens == second.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.9 * second.usage.prompt_tokens
    assert second.model_extra["hybridcache"]["reused_segments"] == 4

    # the legacy completions API: the prompt one f-string
    def complete(order):
        prompt = f"Answer from the ledgers.\n{SEP}{SEP.join(docs[i] for i in order)}{SEP}Q: who logged most?\nA:"
        return client.completions.create(model="default", prompt=prompt, max_tokens=2, temperature=0)

    complete([2, 0, 3, 1])
    again = complete([1, 3, 0, 2])
    assert again.usage.prompt_tokens_details.cached_tokens >= 0.9 * again.usage.prompt_tokens


def test_llamaindex_synthesizer_requests_get_reordered_documents_from_cache(clients_cluster):
    recorded = json.loads((DATA / "llamaindex_synthesizer_requests.json").read_text())
    first, second = recorded["requests"]
    assert first["path"] == second["path"] == "/v1/chat/completions"
    results = []
    for r in (first, second):
        status, res = http("POST", clients_cluster.url + r["path"], r["body"])
        assert status == 200, res
        results.append(res)
    # every document came back as one segment of its own, from cache the second time
    segments = results[1]["hybridcache"]["segments"]
    for doc in recorded["documents"]:
        assert any(s["tokens"] == len(doc.encode()) and s["hit"] for s in segments), (doc, segments)
    assert results[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > sum(
        len(d.encode()) - 8 for d in recorded["documents"])
