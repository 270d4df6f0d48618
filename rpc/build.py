"""Generate the Python protobuf/gRPC modules from protos/ into rpc/generated.

The .proto files are the only source; this runs at install (``make protos``)
and again whenever a .proto is newer than its generated module.

NOTE: protoc names a generated module by the .proto's path under the
include root, and imports its dependencies the same way. The files live at
``protos/rpc/generated/tandem/v1/``, so with ``protos/`` as the root and the
repository as the output, ``worker.proto`` becomes
``rpc/generated/tandem/v1/worker_pb2.py`` importing
``rpc.generated.tandem.v1.common_pb2``: no top-level ``tandem`` module to
collide with the ``tandem`` package, and nothing to rewrite. The proto
package (``tandem.v1``, the services' wire names) does not depend on it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "rpc" / "generated"


def _protos() -> list[Path]:
    """Every .proto, relative to the include root (= to the output root)."""
    return sorted(p.relative_to(PROTOS) for p in PROTOS.rglob("*.proto"))


def stale() -> bool:
    for rel in _protos():
        generated = ROOT / rel.parent / f"{rel.stem}_pb2.py"
        if not generated.exists() or generated.stat().st_mtime < (PROTOS / rel).stat().st_mtime:
            return True
    return False


def build() -> None:
    from grpc_tools import protoc

    protos = [str(p) for p in _protos()]
    OUT.mkdir(parents=True, exist_ok=True)
    if protos:
        include = Path(protoc.__file__).parent / "_proto"
        args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={ROOT}",
                f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}", *protos]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
    # Regular packages, so that setuptools' package discovery finds them.
    for d in [OUT, *[p for p in OUT.rglob("*") if p.is_dir() and p.name != "__pycache__"]]:
        (d / "__init__.py").touch()


def ensure_built() -> None:
    if stale():
        build()


if __name__ == "__main__":
    build()
    print(f"generated protobuf modules in {OUT}", file=sys.stderr)
