"""Regenerate the checked-in gRPC code from hybridcache.proto: `python -m hybridcache.services.protocol.build`.

The generated modules are checked in (so a plain install needs no protoc); tests/services checks
that they match what grpcio-tools produces from the .proto today.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GENERATED = ("hybridcache_pb2.py", "hybridcache_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    rc = protoc.main(["protoc", f"-I{HERE}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
                      str(HERE / "hybridcache.proto")])
    if rc != 0:
        raise RuntimeError(f"protoc failed with status {rc}")
    grpc_mod = out_dir / "hybridcache_pb2_grpc.py"
    # protoc writes a top-level import; the modules live in a package.
    text = grpc_mod.read_text().replace("import hybridcache_pb2 as", "from . import hybridcache_pb2 as")
    grpc_mod.write_text(text)


def generated_text() -> dict[str, str]:
    with tempfile.TemporaryDirectory() as d:
        generate(Path(d))
        return {name: (Path(d) / name).read_text() for name in GENERATED}


if __name__ == "__main__":
    for name, text in generated_text().items():
        (HERE / name).write_text(text)
    print("wrote", ", ".join(GENERATED), file=sys.stderr)
