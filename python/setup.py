"""What pyproject.toml's tables cannot say about the build.

Everything else (the package, the crates setuptools-rust builds) is in
pyproject.toml. An editable install builds no Rust (see BuildRust.run). The
C library is loaded with ctypes, never imported, so:

- it keeps its own name, ``dmlc/libdmlc_guest.so``, where setuptools-rust
  would name it as an extension module of the building interpreter
  (``libdmlc_guest.cpython-311-x86_64-linux-gnu.so``);
- the wheel is tagged ``py3-none-PLATFORM``: any Python 3 on the platform
  can use it, where setuptools would tag it for the building interpreter
  (``cp311-cp311``). abi3 would not fit: there is no use of CPython's
  stable ABI to declare, and free-threaded CPython and PyPy refuse abi3.
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools_rust import RustExtension, build_rust


class BuildRust(build_rust):
    """setuptools-rust's build_rust, the library named as the C library."""

    def run(self) -> None:
        # An editable install (pip install -e) builds nothing: the package
        # then uses the workspace's target/release or target/debug
        # (dmlc/_capi.py, dmlc/run.py), which cargo keeps current, where a
        # copy in src/dmlc would go stale and be found first.
        if not self.inplace:
            super().run()

    def get_dylib_ext_path(self, ext: RustExtension, target_fname: str) -> str:
        path: str = super().get_dylib_ext_path(ext, target_fname)
        return os.path.join(os.path.dirname(path), target_fname.rpartition(".")[2] + ".so")


class BdistWheel(bdist_wheel):
    """A wheel for every Python 3 on this platform."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(cmdclass={"build_rust": BuildRust, "bdist_wheel": BdistWheel})
