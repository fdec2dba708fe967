"""The ctypes binding against the C header: every constant, struct size and
field offset of python/src/dmlc/_capi.py equals what a C compiler makes of
capi/include/dmlc_guest.h, and a library of another ABI is refused."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import dmlc
from conftest import REPO, _binary
from dmlc import _capi

HEADER_DIR = REPO / "capi" / "include"
PRINTER = REPO / "capi" / "tests" / "c" / "allreduce.c"


def _header_values(tmp_path: Path) -> dict[str, int]:
    """`allreduce --constants` (capi/tests/c), compiled here against the header."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed to read the header"
    lib = Path(os.environ.get("DMLC_LIBRARY") or _binary("DMLC_LIBRARY", "libdmlc_guest.so"))
    exe = tmp_path / "constants"
    subprocess.run(
        [
            cc,
            "-std=c99",
            f"-I{HEADER_DIR}",
            str(PRINTER),
            "-o",
            str(exe),
            str(lib),
            f"-Wl,-rpath,{lib.parent}",
        ],
        check=True,
    )
    out = subprocess.run([str(exe), "--constants"], check=True, capture_output=True, text=True)
    return {k: int(v) for k, v in (ln.rsplit(" ", 1) for ln in out.stdout.splitlines())}


def test_every_bound_function_is_in_the_header_with_as_many_parameters() -> None:
    header = (HEADER_DIR / "dmlc_guest.h").read_text()
    for name, (_, argtypes) in _capi.signatures().items():
        found = re.search(rf"\b{name}\(([^)]*)\);", header)
        assert found, f"{name} is bound but not declared in dmlc_guest.h"
        params = found.group(1).strip()
        count = 0 if params in ("", "void") else params.count(",") + 1
        assert count == len(argtypes), (
            f"{name}: {count} parameters in the header, bound with {len(argtypes)}"
        )


def test_every_constant_and_struct_layout_matches_the_header(tmp_path: Path) -> None:
    c = _header_values(tmp_path)
    ours: dict[str, int] = {"DMLC_ABI_VERSION": _capi.ABI_VERSION, "DMLC_OK": _capi.OK}
    for name, value in vars(_capi).items():
        if name.startswith("ERR_"):
            ours[f"DMLC_{name}"] = value
        elif name in ("NO_PEER", "WAIT_HYBRID", "FLAG_IN_PLACE"):
            ours[f"DMLC_{name}"] = value
        elif name.startswith(("FEATURE_", "BAD_", "MISMATCH_TABLE", "TOO_BIG_")):
            ours[f"DMLC_{name}"] = value
        elif name in ("COMM_WORLD", "ANY_SOURCE", "UNDEFINED"):
            ours[f"DMLC_{name}"] = value
    opcodes = ["ALLREDUCE", "BROADCAST", "REDUCE", "ALLGATHER", "REDUCE_SCATTER", "BARRIER", "NOP"]
    opcodes += ["SEND", "RECV", "ALLTOALL", "ALLTOALLV", "GATHER", "GATHERV", "SCATTER"]
    opcodes += ["SCATTERV", "COMM_SPLIT", "COMM_CREATE", "COMM_FREE"]
    for name in opcodes:
        ours[f"DMLC_OPCODE_{name}"] = getattr(_capi, name)
    for d in dmlc.Dtype:
        ours[f"DMLC_DTYPE_{d.name}"] = d.value
    for o in dmlc.ReduceOp:
        ours[f"DMLC_OP_{o.name}"] = o.value
    for struct, cname in (
        (_capi.Config, "dmlc_config"),
        (_capi.OpenOptions, "dmlc_open_options"),
        (_capi.Request, "dmlc_request"),
        (_capi.Segment, "dmlc_segment"),
        (_capi.Completion, "dmlc_completion"),
        (_capi.CommInfo, "dmlc_comm_info"),
        (_capi.CommRequest, "dmlc_comm_request"),
        (_capi.CommCompletion, "dmlc_comm_completion"),
    ):
        ours[f"sizeof({cname})"] = ctypes.sizeof(struct)
        for field, _ in struct._fields_:
            ours[f"offsetof({cname}, {field})"] = getattr(struct, field).offset
            ours[f"sizeof({cname}.{field})"] = getattr(struct, field).size
    differ = {k: (v, c.get(k)) for k, v in ours.items() if c.get(k) != v}
    assert not differ, f"binding vs header (python, C): {differ}"
    # And nothing of the header's is missing here: every status, dtype, op
    # and field the C side prints has its twin.
    missing = [
        k
        for k in c
        if k.startswith(("DMLC_ERR_", "DMLC_DTYPE_", "DMLC_OP", "DMLC_BAD_", "DMLC_FEATURE_"))
        or k.startswith("offsetof(")
        if k not in ours
    ]
    assert not missing, f"in the header, not in the binding: {missing}"
    assert c["dmlc_abi_version()"] == _capi.ABI_VERSION


def _fake_library(tmp_path: Path, body: str) -> Path:
    """A shared library made of `body` (C), standing in for libdmlc_guest."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed"
    src, lib = tmp_path / "fake.c", tmp_path / "libfake.so"
    src.write_text("#include <stdint.h>\n" + body)
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    return lib


def test_a_library_of_another_abi_is_refused_naming_both_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = _fake_library(tmp_path, "uint32_t dmlc_abi_version(void) { return 7; }\n")
    monkeypatch.setenv("DMLC_LIBRARY", str(other))
    want = rf"{other} has C ABI 7; this dmlc package needs C ABI {_capi.ABI_VERSION}"
    with pytest.raises(ImportError, match=want):
        _capi.load()
    (tmp_path / "old").mkdir()
    older = _fake_library(tmp_path / "old", "int dmlc_rank(void *d) { return 0; }\n")
    monkeypatch.setenv("DMLC_LIBRARY", str(older))
    with pytest.raises(ImportError, match="predates ABI versions"):
        _capi.load()
    # The right version, built before a function the package calls.
    (tmp_path / "same").mkdir()
    body = f"uint32_t dmlc_abi_version(void) {{ return {_capi.ABI_VERSION}; }}\n"
    same = _fake_library(tmp_path / "same", body)
    monkeypatch.setenv("DMLC_LIBRARY", str(same))
    with pytest.raises(ImportError, match=r"lacks dmlc_\w+, which this dmlc package calls"):
        _capi.load()
