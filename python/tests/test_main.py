"""``python -m dmlc``: the library, the settings and the device it opens."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import Backend, _binary


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    base.pop("RANK", None)
    base.pop("WORLD_SIZE", None)
    base["DMLC_LIBRARY"] = str(_binary("DMLC_LIBRARY", "libdmlc_guest.so"))
    return subprocess.run(
        [sys.executable, "-m", "dmlc", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_it_opens_the_device_the_environment_names(backend2: Backend) -> None:
    r = _run(DMLC_SOCKET=str(backend2.socket(1)), DMLC_POLL="interrupt")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith("library ") and "libdmlc_guest.so" in line for line in lines)
    assert f"environment   DMLC_SOCKET={backend2.socket(1)}" in lines
    assert "device        rank 1 of 2" in lines
    assert "wait mode     interrupt" in lines
    assert "features      communicators, send/recv, all-to-all, gather, scatter" in lines


def test_without_settings_it_says_what_to_set_and_fails() -> None:
    r = _run()
    assert r.returncode == 1, r.stdout + r.stderr
    assert "nothing names a device" in r.stdout
    assert "device        cannot be opened: DMLC_DEVICE is not set" in r.stdout
    r = _run("--no-open")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not any(line.startswith(("device ", "wait mode ")) for line in r.stdout.splitlines())


def test_a_rank_that_disagrees_with_the_device_is_named(backend2: Backend) -> None:
    r = _run(DMLC_SOCKET=str(backend2.socket(0)), RANK="1", WORLD_SIZE="2")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "cannot be opened" in r.stdout
    assert "the device says rank 0, but RANK is 1" in r.stdout
