"""Generates trainyard.v1 (protobuf messages and gRPC stubs) from the repository's proto/ into
python/trainyard/v1, with grpcio-tools: `python3 python/build_stubs.py`. Run by scripts/setup.sh
and by the package's build (setup.py: `pip install ./python`). Built away from the repository
(no proto/ beside it), the stubs already generated are kept."""
import os
import pathlib
import sys

from grpc_tools import protoc

HERE = pathlib.Path(__file__).resolve().parent
PROTO = HERE.parent / "proto"


def main(quiet=False):
    out = HERE
    if not (PROTO / "trainyard" / "v1").is_dir():
        if (out / "trainyard" / "v1" / "job_pb2.py").is_file():
            return
        sys.exit(f"build_stubs: no {PROTO / 'trainyard' / 'v1'} and no generated stubs")
    (out / "trainyard" / "v1").mkdir(parents=True, exist_ok=True)
    (out / "trainyard" / "v1" / "__init__.py").write_text("")
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    files = sorted(str(p.relative_to(PROTO)) for p in (PROTO / "trainyard" / "v1").glob("*.proto"))
    args = ["protoc", f"-I{PROTO}", f"-I{include}", f"--python_out={out}",
            f"--grpc_python_out={out}"] + files
    if protoc.main(args) != 0:
        sys.exit("build_stubs: protoc failed")
    if not quiet:
        print(f"build_stubs: {len(files)} protos into {out / 'trainyard' / 'v1'}")


if __name__ == "__main__":
    main()
