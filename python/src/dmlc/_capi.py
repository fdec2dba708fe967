"""ctypes declarations of the C ABI (capi/include/dmlc_guest.h).

The package talks to the device only through ``libdmlc_guest.so``, the one
library the ``dmlc-capi`` crate builds: no second driver, no compiled
extension, so a guest needs nothing but Python and that file.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import (
    POINTER,
    Structure,
    c_char_p,
    c_int,
    c_int32,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
)
from pathlib import Path

LIBRARY_ENV = "DMLC_LIBRARY"
LIBRARY_NAME = "libdmlc_guest.so"

# Statuses (dmlc_status).
OK = 0
ERR_BAD_REQUEST = 1
ERR_MISMATCH = 2
ERR_PEER_LOST = 3
ERR_TIMEOUT = 4
ERR_UNSUPPORTED = 5
ERR_TOO_BIG = 6
ERR_RESET = 7
ERR_TRUNCATE = 8
ERR_NONFINITE = 9
ERR_INVALID_ARGUMENT = 100
ERR_NO_STATUS = 101
ERR_UNKNOWN_STATUS = 102
ERR_WAIT_TIMEOUT = 103
ERR_QUEUE_FULL = 104
ERR_OUT_OF_MEMORY = 105
ERR_UNKNOWN_HANDLE = 106
ERR_TRANSPORT = 107
ERR_DEVICE = 108
ERR_INTERNAL = 109
ERR_UNANSWERED = 110
ERR_REQUEST_DROPPED = 111
ERR_BUFFER_BUSY = 112
ERR_ENVIRONMENT = 113

# DMLC_ABI_VERSION of the header these declarations follow: load() refuses
# a library of another ABI (python/tests/test_capi.py checks every constant
# and struct here against the header).
ABI_VERSION = 1

NO_PEER = 0xFFFFFFFF
# dmlc_open_options.poll and dmlc_wait_mode(): DMLC_WAIT_*, by the names
# every client gives the wait modes.
WAIT_INTERRUPT = 0
WAIT_POLL = 1
WAIT_HYBRID = 2
WAIT_CODES = {"interrupt": WAIT_INTERRUPT, "poll": WAIT_POLL, "hybrid": WAIT_HYBRID}
FLAG_IN_PLACE = 1

# Opcodes (dmlc_opcode).
ALLREDUCE = 0
BROADCAST = 1
REDUCE = 2
ALLGATHER = 3
REDUCE_SCATTER = 4
BARRIER = 5
NOP = 6
# Opcodes of communicators, send and receive, all-to-all, gather and scatter
# (spec 5.X.6.13; through dmlc_comm_call and the functions that name them).
SEND = 7
RECV = 8
ALLTOALL = 9
ALLTOALLV = 10
GATHER = 11
GATHERV = 12
SCATTER = 13
SCATTERV = 14
COMM_SPLIT = 15
COMM_CREATE = 16
COMM_FREE = 17

# Communicators: the group's id, a receive from any rank, a split member
# that joins no communicator; dmlc_comm_features() bits; the device's
# details of their failures.
COMM_WORLD = 0
ANY_SOURCE = 0xFFFFFFFF
UNDEFINED = 0xFFFFFFFF
FEATURE_COMM = 1 << 1
FEATURE_P2P = 1 << 2
FEATURE_BLOCKS = 1 << 3
BAD_COMM = 14
BAD_PEER = 15
BAD_TABLE = 16
BAD_IN_PLACE_OPCODE = 17
MISMATCH_TABLE = 0x40
TOO_BIG_COMMS = 3

# Fields of a MISMATCH's detail mask, in bit order (virtio_dmlc::mismatch).
MISMATCH_FIELDS = ("opcode", "dtype", "op", "count", "root", "tag", "table")


class Config(Structure):
    """dmlc_config."""

    _fields_ = [
        ("rank", c_uint32),
        ("world_size", c_uint32),
        ("num_queues", c_uint32),
        ("max_segments", c_uint32),
        ("max_bytes", c_uint64),
        ("dtypes", c_uint32),
        ("ops", c_uint32),
        ("opcodes", c_uint32),
        ("generation", c_uint32),
        ("group_id", c_uint64),
    ]


class OpenOptions(Structure):
    """dmlc_open_options."""

    _fields_ = [
        ("poll", c_int),
        ("queue_size", c_uint16),
        ("event_idx", c_int),
        ("dma_bytes", c_uint64),
    ]


class Request(Structure):
    """dmlc_request."""

    _fields_ = [
        ("opcode", c_uint16),
        ("dtype", c_uint8),
        ("op", c_uint8),
        ("root", c_uint32),
        ("count", c_uint64),
        ("tag", c_uint64),
        ("flags", c_uint32),
        ("timeout_ms", c_uint32),
    ]


class Segment(Structure):
    """dmlc_segment."""

    _fields_ = [("buf", c_void_p), ("offset", c_size_t), ("len", c_size_t)]


class Completion(Structure):
    """dmlc_completion."""

    _fields_ = [
        ("status", c_int),
        ("detail", c_uint32),
        ("peer", c_uint32),
        ("generation", c_uint32),
    ]


class CommInfo(Structure):
    """dmlc_comm_info."""

    _fields_ = [("id", c_uint32), ("rank", c_uint32), ("size", c_uint32)]


class CommRequest(Structure):
    """dmlc_comm_request."""

    _fields_ = [
        ("opcode", c_uint16),
        ("dtype", c_uint8),
        ("op", c_uint8),
        ("root", c_uint32),
        ("count", c_uint64),
        ("tag", c_uint64),
        ("flags", c_uint32),
        ("timeout_ms", c_uint32),
        ("comm", c_uint32),
        ("peer", c_uint32),
        ("key", c_uint32),
        ("table_bytes", c_uint32),
        ("table", c_void_p),
    ]


class CommCompletion(Structure):
    """dmlc_comm_completion."""

    _fields_ = [
        ("status", c_int),
        ("detail", c_uint32),
        ("peer", c_uint32),
        ("generation", c_uint32),
        ("length", c_uint64),
        ("comm", c_uint32),
        ("comm_rank", c_uint32),
        ("comm_size", c_uint32),
        ("peer_world", c_uint32),
    ]


def _candidates() -> list[Path]:
    """Where to look for the library, in order."""
    found: list[Path] = []
    here = Path(__file__).resolve().parent
    # The copy the wheel bundles (`pip install ./python` builds it: setup.py).
    found.append(here / LIBRARY_NAME)
    # A source checkout (editable install, or the tests): the workspace's
    # target folder, release build first.
    for parent in here.parents:
        if (parent / "Cargo.toml").is_file() and (parent / "capi").is_dir():
            found += [parent / "target" / p / LIBRARY_NAME for p in ("release", "debug")]
            break
    return found


def load() -> ctypes.CDLL:
    """Loads libdmlc_guest.so and declares its functions.

    ``$DMLC_LIBRARY`` wins; otherwise the copy installed with this package
    (``dmlc/libdmlc_guest.so``, which ``pip install`` builds and bundles),
    the workspace's ``target/release`` or ``target/debug`` when the package
    runs from a source checkout, then the system's library path.
    """
    explicit = os.environ.get(LIBRARY_ENV)
    candidates = [] if explicit else _candidates()
    path = explicit or next((str(p) for p in candidates if p.is_file()), LIBRARY_NAME)
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        build = f"`cargo build --release -p dmlc-capi`: target/release/{LIBRARY_NAME}"
        if explicit:
            raise ImportError(
                f"cannot load the virtio-dmlc C library {path} named by {LIBRARY_ENV}: {e}. "
                f"Unset {LIBRARY_ENV} to use the copy installed with this package, or point "
                f"it at a built one ({build})"
            ) from e
        looked = ", ".join(str(p) for p in candidates)
        where = path if path != LIBRARY_NAME else f"none at {looked} nor on the library path"
        raise ImportError(
            f"cannot load the virtio-dmlc C library {LIBRARY_NAME} ({where}): {e}. "
            f"`pip install ./python` builds it and installs it with the package; or set "
            f"{LIBRARY_ENV} to a built one ({build})"
        ) from e
    _check_abi(lib, path)
    _declare(lib, path)
    return lib


def _check_abi(lib: ctypes.CDLL, path: str) -> None:
    """Refuses a library built for another C ABI than this package's."""
    rebuild = f"rebuild it (`cargo build --release -p dmlc-capi`) or point {LIBRARY_ENV} at one"
    try:
        version_of = lib.dmlc_abi_version
    except AttributeError:
        raise ImportError(
            f"the virtio-dmlc C library {path} predates ABI versions; this dmlc package "
            f"needs C ABI {ABI_VERSION}: {rebuild}"
        ) from None
    version_of.restype = c_uint32
    version_of.argtypes = []
    found = version_of()
    if found != ABI_VERSION:
        raise ImportError(
            f"the virtio-dmlc C library {path} has C ABI {found}; this dmlc package "
            f"needs C ABI {ABI_VERSION}: {rebuild}"
        )


def signatures() -> dict[str, tuple[object, list[object]]]:
    """The C functions this binding calls: name -> (restype, argtypes)."""
    dev = c_void_p
    return {
        "dmlc_open_options_init": (None, [POINTER(OpenOptions)]),
        "dmlc_open_host_ex": (c_int, [c_char_p, POINTER(OpenOptions), POINTER(c_void_p)]),
        "dmlc_open_pci": (c_int, [c_char_p, POINTER(OpenOptions), POINTER(c_void_p)]),
        "dmlc_open_kernel": (c_int, [c_char_p, POINTER(OpenOptions), POINTER(c_void_p)]),
        "dmlc_open_env": (c_int, [POINTER(c_char_p), POINTER(c_void_p)]),
        "dmlc_reaches_any_memory": (c_int, [dev]),
        "dmlc_wait_mode": (c_int, [dev]),
        "dmlc_host_chunk_bytes": (c_uint64, [dev]),
        "dmlc_close": (None, [dev]),
        "dmlc_rank": (c_int32, [dev]),
        "dmlc_world_size": (c_int32, [dev]),
        "dmlc_get_config": (c_int, [dev, POINTER(Config)]),
        "dmlc_alloc": (c_int, [dev, c_size_t, POINTER(c_void_p)]),
        "dmlc_wrap_memory": (c_int, [dev, c_void_p, c_size_t, POINTER(c_void_p)]),
        "dmlc_free": (None, [c_void_p]),
        "dmlc_buffer_data": (c_void_p, [c_void_p]),
        "dmlc_buffer_size": (c_size_t, [c_void_p]),
        "dmlc_submit": (
            c_int,
            [
                dev,
                c_uint16,
                POINTER(Request),
                POINTER(Segment),
                c_size_t,
                POINTER(Segment),
                c_size_t,
                POINTER(c_void_p),
            ],
        ),
        "dmlc_wait": (c_int, [dev, c_void_p, c_int64, POINTER(Completion)]),
        "dmlc_strerror": (c_char_p, [c_int]),
        "dmlc_version": (c_char_p, []),
        "dmlc_last_error_message": (c_char_p, []),
        "dmlc_last_error_completion": (None, [POINTER(Completion)]),
        # The collectives on ordinary memory (the library's bounce buffer).
        "dmlc_allreduce_host": (c_int, [dev, c_void_p, c_void_p, c_uint64, c_int, c_int]),
        "dmlc_broadcast_host": (c_int, [dev, c_void_p, c_uint64, c_int, c_uint32]),
        "dmlc_reduce_host": (c_int, [dev, c_void_p, c_uint64, c_int, c_int, c_uint32]),
        "dmlc_allgather_host": (c_int, [dev, c_void_p, c_void_p, c_uint64, c_int]),
        "dmlc_reduce_scatter_host": (c_int, [dev, c_void_p, c_void_p, c_uint64, c_int, c_int]),
        "dmlc_last_error_length": (c_uint64, []),
        "dmlc_set_check_finite": (c_int, [dev, c_int]),
        "dmlc_set_tag": (c_int, [dev, c_uint64]),
        # Communicators, send and receive, all-to-all, gather and scatter.
        "dmlc_comm_features": (c_int, [dev]),
        "dmlc_max_comms": (c_int32, [dev]),
        "dmlc_get_comm_info": (c_int, [dev, c_uint32, POINTER(CommInfo)]),
        "dmlc_comm_split": (c_int, [dev, c_uint32, c_uint32, c_uint32, POINTER(CommInfo)]),
        "dmlc_comm_create": (
            c_int,
            [dev, c_uint32, POINTER(c_uint32), c_size_t, c_uint64, POINTER(CommInfo)],
        ),
        "dmlc_comm_free": (c_int, [dev, c_uint32]),
        "dmlc_submit_comm": (
            c_int,
            [
                dev,
                c_uint16,
                c_uint32,
                POINTER(Request),
                POINTER(Segment),
                c_size_t,
                POINTER(Segment),
                c_size_t,
                POINTER(c_void_p),
            ],
        ),
        "dmlc_comm_call": (
            c_int,
            [
                dev,
                c_uint16,
                POINTER(CommRequest),
                POINTER(Segment),
                c_size_t,
                POINTER(Segment),
                c_size_t,
                POINTER(CommCompletion),
            ],
        ),
        "dmlc_send": (c_int, [dev, c_uint32, c_uint32, c_uint64, c_int, c_void_p, c_uint64]),
        "dmlc_recv": (
            c_int,
            [
                dev,
                c_uint32,
                c_uint32,
                c_uint64,
                c_int,
                c_void_p,
                c_uint64,
                POINTER(c_uint64),
                POINTER(c_uint32),
            ],
        ),
        "dmlc_alltoall": (c_int, [dev, c_uint32, c_void_p, c_void_p, c_uint64, c_int]),
        "dmlc_alltoallv": (
            c_int,
            [dev, c_uint32, c_void_p, c_void_p, POINTER(c_uint64), POINTER(c_uint64), c_int],
        ),
        "dmlc_gather": (c_int, [dev, c_uint32, c_void_p, c_void_p, c_uint64, c_int, c_uint32]),
        "dmlc_gatherv": (
            c_int,
            [dev, c_uint32, c_void_p, c_void_p, c_uint64, POINTER(c_uint64), c_int, c_uint32],
        ),
        "dmlc_scatter": (c_int, [dev, c_uint32, c_void_p, c_void_p, c_uint64, c_int, c_uint32]),
        "dmlc_scatterv": (
            c_int,
            [dev, c_uint32, c_void_p, c_void_p, POINTER(c_uint64), c_uint64, c_int, c_uint32],
        ),
        "dmlc_allreduce_host_comm": (
            c_int,
            [dev, c_uint32, c_void_p, c_void_p, c_uint64, c_int, c_int],
        ),
        "dmlc_broadcast_host_comm": (c_int, [dev, c_uint32, c_void_p, c_uint64, c_int, c_uint32]),
        "dmlc_reduce_host_comm": (
            c_int,
            [dev, c_uint32, c_void_p, c_uint64, c_int, c_int, c_uint32],
        ),
        "dmlc_allgather_host_comm": (c_int, [dev, c_uint32, c_void_p, c_void_p, c_uint64, c_int]),
        "dmlc_reduce_scatter_host_comm": (
            c_int,
            [dev, c_uint32, c_void_p, c_void_p, c_uint64, c_int, c_int],
        ),
        "dmlc_barrier_comm": (c_int, [dev, c_uint32]),
    }


def _declare(lib: ctypes.CDLL, path: str) -> None:
    for name, (restype, argtypes) in signatures().items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            # Same ABI version, but built before the function was added.
            raise ImportError(
                f"the virtio-dmlc C library {path} lacks {name}, which this dmlc package "
                "calls: it is older than the package; rebuild it (`cargo build --release "
                f"-p dmlc-capi`) or point {LIBRARY_ENV} at a newer one"
            ) from None
        fn.restype = restype
        fn.argtypes = argtypes
