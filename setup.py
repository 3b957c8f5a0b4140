"""Generates the protobuf/gRPC stubs at build and install time (they are never committed)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent.resolve()


class BuildWithProtos(build_py):
    def run(self) -> None:
        import sys

        sys.path.insert(0, str(ROOT / "libs"))
        from inferx.protogen import generate  # noqa: PLC0415 - needs libs/ on the path

        generate(ROOT / "protos", ROOT / "libs")
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
