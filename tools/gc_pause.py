"""How long a full garbage collection pauses a worker process, with and without gc.freeze(). An
engine on --model (the shipped model by default) is loaded and warmed up as a served worker is,
then: the objects the collector tracks, a full collection's time (median of --repeats), and the
same after gc.freeze() (what `hybridcache serve` does once its role is warm: the objects made so
far, which live as long as the process, move out of the collector's sight). Python runs a full
collection by itself whenever the objects that survived younger collections reach a quarter of
the long-lived ones, so on a request's path from time to time. Prints one JSON object.

    python tools/gc_pause.py [--model DIR] [--device cpu] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def full_collection_ms(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 2)


def _shown(path: Path) -> str:
    """`path` relative to the repository when it lies inside it."""
    root = Path(__file__).resolve().parents[1]
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="model directory (default: the shipped model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        print("gc_pause: --repeats must be >= 1", file=sys.stderr)
        return 2
    import grpc  # noqa: F401 - a worker's libraries, as serve imports them
    from hybridcache.services.runtime.llm import LLM
    from hybridcache.services.runtime.modelzoo import default_model_dir

    model = args.model or default_model_dir()
    if not (Path(model) / "config.json").is_file():
        print(f"gc_pause: no model at {model} (a directory with config.json)", file=sys.stderr)
        return 2
    llm = LLM.from_dir(model, device=args.device)
    llm.warmup()
    gc.collect()
    tracked = len(gc.get_objects())
    before = full_collection_ms(args.repeats)
    gc.freeze()
    after = full_collection_ms(args.repeats)
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    res = {"tool": "gc_pause", "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "python tools/gc_pause.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": _shown(Path(model)), "device": args.device, "python": sys.version.split()[0],
           "tracked_objects_after_warmup": tracked, "full_collection_ms": before,
           "frozen_objects": frozen, "full_collection_ms_frozen": after}
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
