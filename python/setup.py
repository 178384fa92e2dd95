"""The package's build: trainyard.v1 (protobuf messages and gRPC stubs) is generated from the
repository's proto/ before the packages are found, so that `pip install ./python` (and the wheel
built from this folder) installs a package that works alone. Everything else is in
pyproject.toml."""
import pathlib
import sys

from setuptools import setup

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import build_stubs  # noqa: E402  (python/build_stubs.py, beside this file)

build_stubs.main(quiet=True)
setup()
