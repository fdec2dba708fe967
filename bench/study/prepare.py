"""What a study needs before its cells run, and what it records about the
machine: the builds (release binaries, the MPI benchmark, the patched
XGBoost, other architectures' guest programs, roots, XGBoost and
LightGBM), the KVM probe,
the commit, the CPU, the load and the QEMU version."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

from . import cells as cl
from . import runners
from .runners import log


def kvm_usable() -> tuple[bool, str]:
    """Whether KVM guests start here, probed with a time limit: nested KVM
    hangs on some hosts."""
    if not os.path.exists("/dev/kvm"):
        return False, "KVM: this machine has no /dev/kvm (no hardware virtualisation offered)"
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
        os.close(fd)
    except OSError as e:
        return False, f"KVM: /dev/kvm cannot be opened ({e.strerror})"
    log("probing KVM: one VM that runs `true`, 45 s at most")
    cmd = [
        str(cl.TARGET / "dmlc-qemu"),
        "submit",
        "-n",
        "1",
        "--accel",
        "kvm",
        "--timeout",
        "45",
        "--",
        "true",
    ]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=75, check=False)
    except subprocess.TimeoutExpired:
        r = None
    if r is None or r.returncode == 124:
        return False, (
            "KVM: /dev/kvm opens, but a 1-VM probe job that runs `true` did not end "
            "in 45 s (nested KVM hangs on some hosts)"
        )
    if r.returncode:
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"status {r.returncode}"
        return False, f"KVM: a 1-VM probe job failed: {last}"
    return True, ""


def describe(*written: Path) -> str:
    """The commit, with "-dirty" when a tracked file differs from it;
    the files and folders a study writes itself do not count (a report
    committed under docs/ is rewritten by the next study)."""

    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=cl.ROOT, capture_output=True, text=True, check=False)
        return r.stdout.strip()

    commit = git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return "unknown"
    paths = ["."]
    for path in (w.resolve() for w in written):
        if path.is_relative_to(cl.ROOT):
            paths.append(f":(exclude){path.relative_to(cl.ROOT)}")
    changed = git("status", "--porcelain", "--untracked-files=no", "--", *paths)
    return commit + ("-dirty" if changed else "")


def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.machine(),
    )
    mem = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal")
    )
    return {"cpus": os.cpu_count(), "cpu": cpu, "memory_gib": round(mem / 1048576)}


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def qemu_version() -> str:
    binary = os.environ.get("DMLC_QEMU")
    if not binary:
        r = subprocess.run(
            [str(cl.ROOT / "qemu-patches" / "build-qemu.sh"), "--env"],
            capture_output=True,
            text=True,
            check=False,
        )
        env = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
        binary = env.get("DMLC_QEMU")
    if not binary:
        return "QEMU: not built"
    r = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    return r.stdout.splitlines()[0] if r.stdout else "QEMU: unknown version"


def model_times(cluster: Path, sizes_by_n: dict[int, set[int]]) -> dict[str, Any]:
    """What the target cluster's timing model makes one allreduce of each
    size take among n members, in microseconds by n and size, and its
    modelled world: dmlc-timing, the backend's own formulas, so the
    projection and the daemon's `--timing` agree by construction. Exits
    with dmlc-timing's message when the file is not a valid timing file."""
    table: dict[str, dict[str, float]] = {}
    world = None
    for n, sizes in sorted(sizes_by_n.items()):
        argv = [str(cl.TARGET / "dmlc-timing"), str(cluster), "--members", str(n)]
        r = subprocess.run(
            [*argv, *map(str, sorted(sizes))], capture_output=True, text=True, check=False
        )
        if r.returncode:
            raise SystemExit(f"--cluster {cluster}: {r.stderr.strip()}")
        answer = json.loads(r.stdout)
        table[str(n)] = answer["us"]
        world = answer["world"]
    return {"world": world, "allreduce_us": table}


def build_mpi_bench() -> str | None:
    """bench/mpi_allreduce.c with mpicc, for the sweep's MPI path; None, or
    why it is absent."""
    mpicc = shutil.which("mpicc")
    if not mpicc:
        return (
            "Open MPI: mpicc is not installed (apt-get install openmpi-bin "
            "libopenmpi-dev), so the sweeps have no MPI path."
        )
    out = cl.mpi_bench("x86_64")
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [mpicc, "-O2", "-Wall", "-o", str(out), str(cl.ROOT / "bench" / "mpi_allreduce.c")],
        check=True,
    )
    return None


def build_mpi_bench_foreign(arch: str, root: Path) -> None:
    """bench/mpi_allreduce.c for another architecture: its cross compiler
    (tests/image/cross-build.sh installs it), with the mpi.h and libmpi of
    Debian's root of that architecture, whose Open MPI runs it in the
    guests. The cross C library is older than the root's, so the linker
    is told not to resolve libmpi's own references: the root's C library
    does, at run time."""
    multiarch = f"{arch}-linux-gnu"
    lib = root / "usr" / "lib" / multiarch
    out = cl.mpi_bench(arch)
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            f"{multiarch}-gcc",
            "-O2",
            "-Wall",
            "-I",
            str(lib / "openmpi" / "include"),
            "-o",
            str(out),
            str(cl.ROOT / "bench" / "mpi_allreduce.c"),
            str(lib / "libmpi.so.40"),
            f"-Wl,-rpath-link={lib}",
            "-Wl,--allow-shlib-undefined",
        ],
        check=True,
    )


def _package_build(argv: list[str], what: str) -> tuple[str | None, str | None]:
    """One of the package builds: the folder for PYTHONPATH that `argv`
    prints last, or None and why not."""
    log(f"{what} ({' '.join(argv)}; cached after the first build)")
    r = subprocess.run(
        [str(cl.ROOT / argv[0]), *argv[1:]], stdout=subprocess.PIPE, text=True, check=False
    )
    lines = r.stdout.strip().splitlines()
    if r.returncode or not lines:
        return None, f"{what}: the build failed ({' '.join(argv)}), so its cells do not run."
    return lines[-1], None


def build_packages(chosen: list[cl.Cell]) -> tuple[runners.Builds, list[str]]:
    """The Python packages that the chosen XGBoost and LightGBM cells run
    and this host's wheels do not hold: the patched XGBoost for this host
    (about 10 minutes the first time), and for each other architecture
    the same XGBoost and stock LightGBM cross-compiled (about 5 and 2 to
    4 minutes). All cached. Returns them by (workload, architecture), and
    a line for each build that failed."""
    needed = {b for c in chosen if (b := runners.package_build(c))}
    built: runners.Builds = {}
    missing = []
    for workload, arch in sorted(needed):
        if workload == "xgboost":
            script = ["xgboost-patches/build-xgboost.sh"]
            what = "the patched XGBoost"
        else:
            script = ["bench/study/cross-lightgbm.sh"]
            what = "LightGBM"
        if arch != "x86_64":
            script += ["--arch", arch]
            what += f" for {arch}"
        path, why = _package_build(script, what)
        if path:
            built[(workload, arch)] = path
        else:
            missing.append(str(why))
    return built, missing


def build_foreign(arches: list[str]) -> None:
    """The guest programs, Debian's root of each architecture and the MPI
    benchmark built for it (all cached; a root's first build takes tens of
    minutes, its package scripts running under qemu-user)."""
    log(f"guest programs and Debian roots for {', '.join(arches)} (cached after the first build)")
    subprocess.run([str(cl.ROOT / "tests" / "image" / "cross-build.sh"), *arches], check=True)
    for arch in arches:
        # The root (tests/image/build-rootfs.sh) and its copy with Open MPI's
        # launcher and headers, for the sweeps.
        build_mpi_bench_foreign(arch, runners.mpi_rootfs(arch))


def build() -> None:
    """The release binaries, the C library, the digits data, QEMU and
    virtiofsd."""
    log("building the release binaries (cargo build --release) and fetching the digits data")
    crates = ["dmlc-capi", "vhost-device-dmlc", "dmlc-qemu", "dmlc-guest", "dmlc-example-digits"]
    subprocess.run(
        ["cargo", "build", "--release", "-q", *(x for c in crates for x in ("-p", c))],
        cwd=cl.ROOT,
        check=True,
    )
    subprocess.run(
        [str(cl.ROOT / "examples" / "digits" / "fetch-data.sh")],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    # What the first VM job would otherwise build inside its cell's time:
    # the patched QEMU and virtiofsd (both cached; minutes the first time).
    for script in ("qemu-patches/build-qemu.sh", "vm-harness/build-virtiofsd.sh"):
        subprocess.run([str(cl.ROOT / script), "--env"], check=True, stdout=subprocess.DEVNULL)
