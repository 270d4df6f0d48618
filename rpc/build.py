"""Generate the Python protobuf/gRPC modules from protos/ into rpc/generated.

The .proto files are the only source; this runs at install (``make protos``)
and again whenever a .proto is newer than its generated module.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "rpc" / "generated"


def stale() -> bool:
    for proto in PROTOS.rglob("*.proto"):
        rel = proto.relative_to(PROTOS).with_suffix("")
        generated = OUT / rel.parent / f"{rel.name}_pb2.py"
        if not generated.exists() or generated.stat().st_mtime < proto.stat().st_mtime:
            return True
    return False


def build() -> None:
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    OUT.mkdir(parents=True, exist_ok=True)
    if protos:
        include = Path(protoc.__file__).parent / "_proto"
        args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={OUT}",
                f"--pyi_out={OUT}", f"--grpc_python_out={OUT}", *protos]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
    # Generated code imports its siblings as `tandem.v1...`, which would collide
    # with the `tandem` Python package: root those imports under rpc.generated.
    for path in OUT.rglob("*.py*"):
        text = path.read_text()
        fixed = re.sub(r"^from tandem\.", "from rpc.generated.tandem.", text, flags=re.M)
        if fixed != text:
            path.write_text(fixed)
    for d in [OUT, *[p for p in OUT.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()


def ensure_built() -> None:
    if stale():
        build()


if __name__ == "__main__":
    build()
    print(f"generated protobuf modules in {OUT}", file=sys.stderr)
