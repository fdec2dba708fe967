"""``python -m dmlc``: what this process would use, and whether it works.

Prints the C library this package loads (its path, version and C ABI), the
job settings found in the environment (``DMLC_*``, and torchrun's ``RANK``
and ``WORLD_SIZE``), then opens the device those settings name, as
``dmlc.Device.from_env`` and ``init_process_group("dmlc")`` would, and
prints its rank, group, wait mode and features. ``--no-open`` stops before
opening. The exit status is 1 when the library cannot be loaded or the
device cannot be opened, with the reason.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import _capi
from .device import Device
from .errors import DmlcError

# The settings dmlc_open_env reads (capi/include/dmlc_guest.h), and the
# launcher's and torchrun's ranks it checks.
SETTINGS = (
    "DMLC_LIBRARY",
    "DMLC_SOCKET",
    "DMLC_SOCKET_PREFIX",
    "DMLC_DEVICE",
    "DMLC_POLL",
    "DMLC_DMA_BYTES",
    "DMLC_TASK_ID",
    "DMLC_NUM_WORKER",
    "RANK",
    "WORLD_SIZE",
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dmlc",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument("--no-open", action="store_true", help="show the library and settings only")
    a = p.parse_args(argv)

    try:
        lib = Device.library()
    except ImportError as e:
        print(f"library       cannot be loaded: {e}")
        return 1
    version: bytes | None = lib.dmlc_version()
    print(f"library       {getattr(lib, '_name', '?')}")
    print(f"version       {(version or b'?').decode()} (C ABI {_capi.ABI_VERSION})")
    for k in SETTINGS:
        if k in os.environ:
            print(f"environment   {k}={os.environ[k]}")
    if not any(k in os.environ for k in ("DMLC_SOCKET", "DMLC_SOCKET_PREFIX", "DMLC_DEVICE")):
        print("environment   nothing names a device (DMLC_SOCKET, DMLC_SOCKET_PREFIX, DMLC_DEVICE)")
    if a.no_open:
        return 0
    try:
        dev = Device.from_env()
    except (DmlcError, ValueError) as e:
        print(f"device        cannot be opened: {e}")
        return 1
    try:
        features = [
            name
            for name, on in (
                ("communicators", dev.has_comms),
                ("send/recv", dev.has_p2p),
                ("all-to-all, gather, scatter", dev.has_blocks),
            )
            if on
        ]
        print(f"device        rank {dev.rank} of {dev.world_size}")
        print(f"wait mode     {dev.wait_mode}")
        print(f"features      {', '.join(features) or 'the collectives of 5.X.6.1 only'}")
        print(f"communicators at most {dev.max_comms} alive (0: none)")
        memory = "any contiguous buffer" if dev.reaches_any_memory else "buffers of Device.empty"
        print(f"zero copy     {memory}")
    finally:
        dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
