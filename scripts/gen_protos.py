#!/usr/bin/env python3
"""Generate the Python gRPC stubs for every contract under protos/.

The one way stubs are made: ``python scripts/gen_protos.py`` writes
``agent/**/{*_pb2.py,*_pb2.pyi,*_pb2_grpc.py}`` next to this repository's root,
plus the ``__init__.py`` files that make them importable. ``--out DIR`` writes
the same tree elsewhere; the stub drift test uses it to compare.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
INIT_TEXT = '"""Generated from protos/ by scripts/gen_protos.py. Do not edit."""\n'


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto under ``root``, sorted so output order is stable."""
    return sorted(root.rglob("*.proto"))


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Compile every contract under ``proto_root`` into ``out_dir``; return the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = proto_files(proto_root)
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(proto_root)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    written: list[Path] = []
    for proto in protos:
        package_dir = out_dir / proto.relative_to(proto_root).parent
        # Each folder from the top package down needs an __init__.py.
        for folder in [package_dir, *package_dir.parents]:
            if folder == out_dir or out_dir not in folder.parents:
                break
            init = folder / "__init__.py"
            init.write_text(INIT_TEXT)
            written.append(init)
        stem = proto.stem
        written += [package_dir / f"{stem}{suffix}" for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return sorted(set(written))


def drift(generated_root: Path, committed_root: Path = REPO_ROOT) -> list[str]:
    """Files under ``generated_root`` whose committed copy differs or is missing."""
    problems = []
    for generated in sorted(generated_root.rglob("*")):
        if not generated.is_file() or "__pycache__" in generated.parts:
            continue
        relative = generated.relative_to(generated_root)
        committed = committed_root / relative
        if not committed.exists():
            problems.append(f"{relative}: not committed")
        elif committed.read_bytes() != generated.read_bytes():
            problems.append(f"{relative}: differs from protos/")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repository)")
    parser.add_argument("--protos", type=Path, default=PROTO_ROOT, help="contract root (default: protos/)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    for path in generate(out, args.protos.resolve()):
        print(path.relative_to(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
