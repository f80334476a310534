"""`hybridcache` command line: model init, generate, demo (and the serving commands as they land).

Errors in what the user gave (bad request, bad model directory, bad flag) print one line
`hybridcache: error: ...` and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybridcache.services.config import ENGINE_SECTIONS, SECTIONS, add_config_flags, config_from_args

EXIT_USAGE = 2

# The demo's request: a 1-hop question of the QA task's test split (documents the shipped model never
# saw in training) over four of its documents; the same seed gives the same request everywhere.
SAMPLE_SEED = 11


def sample_rag_request() -> tuple[dict, str, str]:
    """(request, question, expected answer) of the demo."""
    from hybridcache.services.runtime.qa_data import QAGenerator

    ex = QAGenerator("test", seed=SAMPLE_SEED, min_docs=4, max_docs=4).example(hops=1)
    return ex.request(max_new_tokens=8), ex.question, ex.answer


class UsageError(Exception):
    pass


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _llm(args):
    """The engine the flags describe and a scheduler over it (llm.LLM): every request of these
    commands runs the way a combine worker runs it."""
    from hybridcache.services.runtime.engine import Engine
    from hybridcache.services.runtime.llm import LLM
    from hybridcache.services.runtime.modelzoo import default_model_dir

    try:
        config = config_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if config.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda given but no CUDA device is available")
    model_dir = Path(args.model) if args.model else default_model_dir()
    if config.tensor_parallel_size > 1:
        from hybridcache.services.runtime.tensor_parallel.ranks import open_engine

        return LLM(open_engine(model_dir, config))  # rank 0 of a group of its own (tensor_parallel/ranks.py)
    return LLM(Engine.from_dir(model_dir, device=config.device, dtype=config.torch_dtype, config=config))


def _read_requests(path: str) -> list:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as e:
        raise UsageError(f"cannot read request file {path}: {e.strerror}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"request file {path} is not valid JSON: {e}") from None
    reqs = obj if isinstance(obj, list) else [obj]
    if not reqs:
        raise UsageError(f"request file {path} holds an empty list")
    return reqs


def cmd_model_init(args) -> int:
    from hybridcache.services.runtime.modelzoo import init_model_dir, parse_size

    try:
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda given but no CUDA device is available")
        out = init_model_dir(args.arch, args.preset, args.out, seed=args.seed, dtype=_dtype(args.dtype),
                             device=args.device, max_shard_bytes=parse_size(args.max_shard_size), progress=True)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(json.dumps({"model_dir": str(out), "arch": args.arch, "preset": args.preset, "seed": args.seed}))
    return 0


def cmd_generate(args) -> int:
    reqs = _read_requests(args.request)
    llm = _llm(args)
    from hybridcache.services.api.openai_compat import split_native

    # Validate every request before running any, so a bad one fails fast and alone; their texts are
    # split on the segment separator as the server splits a native request's
    parsed = [llm.parse_request(split_native(r, llm.engine.config.segment_separator)) for r in reqs]
    # They run at once through the scheduler (continuous batching), as a server runs them; results
    # are printed in the file's order, each as soon as it and those before it are done.
    try:
        for res in llm.results(parsed):
            print(json.dumps(res.to_dict()), flush=True)
    finally:
        llm.close()
    return 0


def cmd_demo(args) -> int:
    try:
        config_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.serve:
        from hybridcache.services.launcher import demo_serve

        return demo_serve(args, *sample_rag_request())
    llm = _llm(args)
    engine = llm.engine
    print(f"model: {engine.model.path} ({engine.cfg.model_type}, mode {engine.config.mode}, "
          f"seam window {engine.config.seam_window})")
    req, question, expected = sample_rag_request()
    print(f"{len(req['segments'])} documents; question: {question!r} (expected answer {expected!r})")
    for attempt, segments in (("first", req["segments"]), ("second, documents reordered", req["segments"][::-1])):
        res = llm.generate(dict(req, segments=segments))
        st = res.stats
        hits = sum(s.hit for s in st.segments)
        print(f"\n[{attempt}] answer: {res.text!r}")
        print(f"  prompt {st.prompt_tokens} tokens: reused {st.reused_tokens}, live {st.live_tokens}, "
              f"built {st.built_tokens}; segments hit {hits}/{len(st.segments)}; ttft {st.ttft_ms:.1f} ms")
    llm.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: with prefixes allowed, `--mode` would also match `--model`.
    p = argparse.ArgumentParser(prog="hybridcache", description=__doc__.splitlines()[0], allow_abbrev=False)
    subs = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, parent=subs) -> argparse.ArgumentParser:
        return parent.add_parser(name, help=help, allow_abbrev=False)

    def engine_flags(sp, model_required: bool, sections=ENGINE_SECTIONS):
        sp.add_argument("--model", required=model_required, help="model directory (HF format)")
        add_config_flags(sp, sections=sections)

    m = command("model", "model directories")
    msub = m.add_subparsers(dest="model_command", required=True)
    mi = command("init", "write a random-weight model directory in Hugging Face format", msub)
    mi.add_argument("--arch", required=True, help="Hugging Face model_type, e.g. qwen3_5, qwen3_next, qwen3_5_moe")
    mi.add_argument("--preset", required=True, help="tiny, qwen3.5-9b, qwen3.5-35b-a3b")
    mi.add_argument("--out", required=True)
    mi.add_argument("--seed", type=int, default=0)
    mi.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    mi.add_argument("--max-shard-size", default="5GB",
                    help="largest weights file; more is written as model-0000K-of-0000N.safetensors shards with "
                    "an index, one at a time (default 5GB, as save_pretrained)")
    mi.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the random values are drawn (cuda: faster for the real-size presets)")
    mi.set_defaults(func=cmd_model_init)

    g = command("generate", "run requests from a JSON file against one cache, print JSON lines")
    engine_flags(g, model_required=True)
    g.add_argument("--request", required=True, help="JSON file with one request or a list ('-' for stdin)")
    g.set_defaults(func=cmd_generate)

    d = command("demo", "send a sample RAG request twice to the embedded default model")
    # `demo --serve` starts the services: it takes their sections too
    engine_flags(d, model_required=False, sections=tuple(SECTIONS))
    d.add_argument("--serve", action="store_true", help="run it through `hybridcache up` over HTTP instead")
    d.set_defaults(func=cmd_demo)

    from hybridcache.services.runtime.evaluation import add_eval_flags, cmd_eval

    e = command("eval", "exact-match accuracy of cached answers (full, prefix, pic, naive) on QA")
    add_eval_flags(e)
    e.set_defaults(func=cmd_eval)

    from hybridcache.services.api.serve import add_serve_flags
    from hybridcache.services.launcher import add_up_flags

    u = command("up", "start router, scatter workers, combine worker and cache tier locally")
    add_up_flags(u)
    s = command("serve", "run one service (router, combine, scatter, cache-tier)")
    add_serve_flags(s)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from hybridcache.services.runtime.config import ModelConfigError
    from hybridcache.services.runtime.loader import ModelLoadError
    from hybridcache.services.runtime.sampling import RequestError

    raw = sys.argv[1:] if argv is None else argv
    if any(a == "--api-key" or a.startswith("--api-key=") for a in raw):
        # vLLM takes the key this way too; its docs, and this one, prefer the environment or a file
        print("hybridcache: warning: --api-key on the command line shows in `ps` and the shell's history; give it "
              "in HYBRIDCACHE_API_KEY or in a file readable by you alone (--api-key-file)", file=sys.stderr)
    if getattr(args, "trust_remote_code", False):
        print("hybridcache: error: --trust-remote-code is not supported: HybridCache runs only its own "
              "implementations of the supported model types, never Python code shipped with a model", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "up":
            from hybridcache.services.launcher import up

            return up(args)
        if args.command == "serve":
            from hybridcache.services.api.serve import serve

            return serve(args)
        return args.func(args)
    except (UsageError, RequestError, ModelLoadError, ModelConfigError, FileNotFoundError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"hybridcache: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
