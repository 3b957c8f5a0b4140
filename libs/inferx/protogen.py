"""Generate Python stubs (with .pyi) for protos/inferx/v1 into libs/inferx/v1.

Used by `make proto` and by the package build (setup.py), so installed copies and
checkouts always carry stubs that match the .proto files.
"""

from __future__ import annotations

from pathlib import Path


def generate(proto_root: Path, out_root: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc  # imported late: only needed at build time

    protos = sorted((proto_root / "inferx" / "v1").glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {proto_root / 'inferx' / 'v1'}")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    package = out_root / "inferx" / "v1"
    init = package / "__init__.py"
    init.write_text('"""Generated from protos/inferx/v1 by `make proto`. Do not edit."""\n')
    return protos


def main() -> None:
    root = Path(__file__).resolve().parents[2]
    protos = generate(root / "protos", root / "libs")
    print(f"generated stubs for {len(protos)} protos into libs/inferx/v1")


if __name__ == "__main__":
    main()
