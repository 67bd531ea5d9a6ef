"""Regenerate the checked-in protobuf/gRPC stubs of `protos/tandem/*/*.proto` into `tandem/*/`.

Two packages: `tandem/v1` (Tandem's own contract) and `tandem/smg` (the SMG router's worker
protocol, vendored from smg-grpc-proto; its version is in the files' headers). The one way stubs
are made (CONTRIBUTING.md, "Protos"):

    python protos/generate.py           # rewrite tandem/{v1,smg}/*_pb2{.py,.pyi,_grpc.py}
    python protos/generate.py --check   # exit 1, listing files, if the checked-in stubs differ

It runs `python -m grpc_tools.protoc -Iprotos --python_out --pyi_out --grpc_python_out` from
the repository root, so imports come out package-qualified (`from tandem.v1 import
common_pb2`). The generated code is version-gated: `_pb2_grpc.py` refuses a grpcio older than
its generator and `_pb2.py` a protobuf runtime older than its gencode, so only one generator
version is allowed here: the oldest grpcio the GPU machines run.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

REQUIRED_GRPCIO_TOOLS = "1.84.0"
REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PACKAGE_DIRS = (Path("tandem") / "v1", Path("tandem") / "smg")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


class GeneratorError(RuntimeError):
    """The environment or protoc cannot produce the stubs."""


def check_grpcio_tools_version() -> None:
    """Raise GeneratorError unless grpcio-tools is exactly REQUIRED_GRPCIO_TOOLS."""
    try:
        found = metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        found = "not installed"
    if found != REQUIRED_GRPCIO_TOOLS:
        raise GeneratorError(
            f"grpcio-tools=={REQUIRED_GRPCIO_TOOLS} is required to generate the stubs, found "
            f"{found}. Stubs from a newer generator refuse older grpcio runtimes. Install it "
            f"with: pip install 'grpcio-tools=={REQUIRED_GRPCIO_TOOLS}'"
        )


def proto_files() -> list[Path]:
    """The .proto sources, relative to the repository root, in a stable order."""
    files: list[Path] = []
    for package in PACKAGE_DIRS:
        found = sorted(p.relative_to(REPO_ROOT) for p in (PROTO_ROOT / package).glob("*.proto"))
        if not found:
            raise GeneratorError(f"no .proto files under {PROTO_ROOT / package}")
        files += found
    return files


def run_protoc(out_dir: Path) -> None:
    """Generate the stubs for every proto into out_dir (as out_dir/tandem/v1/...)."""
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT.relative_to(REPO_ROOT)}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in proto_files()),
    ]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise GeneratorError(f"protoc failed ({result.returncode}):\n{result.stderr.strip()}")


def generated_names(directory: Path) -> set[str]:
    """Names of the generated stub files directly in directory."""
    if not directory.is_dir():
        return set()
    return {
        p.name for p in directory.iterdir() if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def diff_stubs(fresh_dir: Path, checked_in_dir: Path) -> list[str]:
    """Stub files that differ between two directories, are missing or are stale, sorted."""
    fresh = generated_names(fresh_dir)
    checked_in = generated_names(checked_in_dir)
    differing = {
        name
        for name in fresh & checked_in
        if not filecmp.cmp(fresh_dir / name, checked_in_dir / name, shallow=False)
    }
    return sorted(differing | (fresh ^ checked_in))


def write_stubs(fresh_dir: Path, target_dir: Path) -> list[str]:
    """Replace the generated files in target_dir with those of fresh_dir; return what changed.

    Only files with a generated suffix are touched, so `__init__.py` and `py.typed` stay.
    """
    changed = diff_stubs(fresh_dir, target_dir)
    target_dir.mkdir(parents=True, exist_ok=True)
    for name in generated_names(target_dir) - generated_names(fresh_dir):
        (target_dir / name).unlink()
    for name in generated_names(fresh_dir):
        shutil.copyfile(fresh_dir / name, target_dir / name)
    return changed


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--check",
        action="store_true",
        help="regenerate into a temporary directory and fail if the checked-in stubs differ",
    )
    args = parser.parse_args(argv)
    try:
        check_grpcio_tools_version()
        with tempfile.TemporaryDirectory(prefix="tandem-protos-") as tmp:
            run_protoc(Path(tmp))
            if args.check:
                differing = [
                    package / name
                    for package in PACKAGE_DIRS
                    for name in diff_stubs(Path(tmp) / package, REPO_ROOT / package)
                ]
                if differing:
                    print("stubs out of date; run `python protos/generate.py`:", file=sys.stderr)
                    for path in differing:
                        print(f"  {path}", file=sys.stderr)
                    return 1
                print(f"stubs in {', '.join(map(str, PACKAGE_DIRS))} are up to date")
                return 0
            changed = {p: write_stubs(Path(tmp) / p, REPO_ROOT / p) for p in PACKAGE_DIRS}
    except GeneratorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for package, names in changed.items():
        print(f"generated {len(generated_names(REPO_ROOT / package))} files in {package}", end="")
        print(f" ({len(names)} changed)" if names else " (no changes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
