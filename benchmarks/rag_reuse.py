"""A LangChain RAG chain against `hybridcache up`: the share of prompt tokens served from cache when
the same documents come back in another order. Prints one JSON object (and writes it with --out).

The chain is LangChain's `create_stuff_documents_chain` through `ChatOpenAI`, its documents joined
by the server's segment separator (`document_separator="<<PIC_SEP>>"`, the recipe of
docs/recipes.md); the documents are 8 of the QA task's (services/runtime/qa_data.py, the shipped
model's task), the question one of theirs. The first request builds every document's entry; the
second sends the same documents reversed, and its `prompt_tokens_details.cached_tokens` (LangChain's
`usage_metadata.input_token_details.cache_read`) over its prompt tokens is the figure.

    python -P benchmarks/rag_reuse.py [--model models/default] [--documents 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

SEP = "<<PIC_SEP>>"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def documents(n: int, seed: int = 0):
    """n documents, the instruction and a question of one QA prompt of the test split."""
    from hybridcache.services.runtime.qa_data import QAGenerator

    ex = QAGenerator("test", seed, min_docs=n, max_docs=n).example(hops=1)
    return list(ex.documents), ex.instruction, ex.question, ex.answer


def stuff_chain(base_url: str, instruction: str, max_tokens: int = 8):
    """The recipe: a stuff-documents chain whose documents are joined by the segment separator."""
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key="none", model="default", temperature=0, max_tokens=max_tokens,
                     stop=["\n"])
    prompt = ChatPromptTemplate.from_messages([
        ("system", instruction + "\n\n" + SEP + "{context}"),
        ("human", "Question: {input}\nAnswer:"),
    ])
    return create_stuff_documents_chain(llm, prompt, document_prompt=PromptTemplate.from_template("{page_content}"),
                                        document_separator=SEP)


def ask(chain, docs: list[str], question: str) -> dict:
    """The chain's answer and the usage LangChain reports for its one model call."""
    from langchain_core.callbacks import UsageMetadataCallbackHandler
    from langchain_core.documents import Document

    usage = UsageMetadataCallbackHandler()
    answer = chain.invoke({"context": [Document(page_content=d) for d in docs], "input": question},
                          config={"callbacks": [usage]})
    (u,) = usage.usage_metadata.values()
    cached = u.get("input_token_details", {}).get("cache_read", 0)
    return {"answer": answer, "prompt_tokens": u["input_tokens"], "cached_tokens": cached,
            "cached_fraction": round(cached / u["input_tokens"], 4)}


def run(base_url: str, n_docs: int = 8) -> dict:
    docs, instruction, question, answer = documents(n_docs)
    chain = stuff_chain(base_url, instruction)
    first = ask(chain, docs, question)
    second = ask(chain, docs[::-1], question)
    return {"question": question, "expected_answer": answer, "first": first, "reordered": second}


def _shown(path: str) -> str:
    """A path as the repository names it, where it lies inside it."""
    root = Path(__file__).resolve().parents[1]
    p = Path(path).resolve()
    return str(p.relative_to(root)) if p.is_relative_to(root) else path


def main(argv=None) -> dict:
    from hybridcache.services.launcher import LocalCluster, free_port
    from hybridcache.services.runtime.modelzoo import SHIPPED_MODEL

    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHIPPED_MODEL))
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    with LocalCluster(args.model, port=free_port()) as cluster:
        result = run(f"{cluster.url}/v1", args.documents)
    out = {
        "benchmark": "rag_reuse", "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "device": "cpu", "model": _shown(args.model),
        "server": "hybridcache up (defaults: pic, --segment-separator <<PIC_SEP>>)",
        "client": "LangChain create_stuff_documents_chain + ChatOpenAI, document_separator=<<PIC_SEP>>",
        "documents": args.documents, **result,
        "command": "python -P benchmarks/rag_reuse.py" + (f" --out {args.out}" if args.out else ""),
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
