#!/usr/bin/env python3
"""Smoke test of vhost-user-dmlc-pci in a patched QEMU, with no guest.

QEMU runs under its qtest accelerator, and this script plays the guest
driver over the qtest protocol: it finds the device on the PCI bus, walks
its virtio capabilities, negotiates VERSION_1, reads the config space
(fetched from the backend with VHOST_USER_GET_CONFIG), sets up queue 0 in
guest RAM (a memfd shared with the backend), and submits an allreduce and
a barrier. Then it kills the backend, starts it again, and checks that
QEMU reconnects and the queue still works.

Usage: smoke-test.py QEMU BACKEND   (vhost-device-dmlc binary)
Set DMLC_QEMU_FIRMWARE to colon-separated -L directories if QEMU does not
find its firmware by itself (build-qemu.sh --firmware prints them).
Prints one line per check and "N passed, N failed" at the end; exit 1 on
failure. Every wait is bounded.
"""

import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

VENDOR_VIRTIO = 0x1AF4
DEVICE_DMLC = 0x107F
NUM_QUEUES = 2
QUEUE_SIZE = 16

# virtio-pci capability types
CAP_COMMON, CAP_NOTIFY, CAP_ISR, CAP_DEVICE = 1, 2, 3, 4
# Common configuration offsets
DFSELECT, DF, GFSELECT, GF = 0x00, 0x04, 0x08, 0x0C
NUM_QUEUES_OFF, STATUS, QSELECT, QSIZE = 0x12, 0x14, 0x16, 0x18
QENABLE, QNOTIFYOFF, QDESC, QDRIVER, QDEVICE = 0x1C, 0x1E, 0x20, 0x28, 0x30
S_ACK, S_DRIVER, S_DRIVER_OK, S_FEATURES_OK = 1, 2, 4, 8

# Guest-physical layout (below the 64 MiB of RAM)
BAR4 = 0xFE000000
DESC, AVAIL, USED = 0x100000, 0x101000, 0x102000
HDR, INPUT, OUTPUT, RESP = 0x103000, 0x104000, 0x105000, 0x106000

# Device ABI (virtio-dmlc/src/lib.rs)
OPCODE_ALLREDUCE, OPCODE_BARRIER = 0, 5
DTYPE_F32, OP_SUM = 0, 0
STATUS_OK = 0
F_NEXT, F_WRITE = 1, 2


class Failure(Exception):
    pass


class QTest:
    """Line protocol of QEMU's -qtest chardev."""

    def __init__(self, proc):
        self.proc = proc
        self.buf = b""

    def cmd(self, line, timeout=10.0):
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                reply, self.buf = self.buf.split(b"\n", 1)
                reply = reply.decode()
                if reply.startswith("IRQ"):
                    continue
                if not reply.startswith("OK"):
                    raise Failure(f"qtest: {line!r} -> {reply!r}")
                return reply[3:]
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failure(f"qtest: no reply to {line!r}")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                data = os.read(self.proc.stdout.fileno(), 65536)
                if not data:
                    raise Failure(f"qtest: QEMU exited during {line!r}")
                self.buf += data

    def rd(self, width, addr):
        return int(self.cmd(f"read{width} 0x{addr:x}"), 16)

    def wr(self, width, addr, val):
        self.cmd(f"write{width} 0x{addr:x} 0x{val:x}")

    def mem_write(self, addr, data):
        self.cmd(f"write 0x{addr:x} {len(data)} 0x{data.hex()}")

    def mem_read(self, addr, size):
        return bytes.fromhex(self.cmd(f"read 0x{addr:x} {size}")[2:])

    def cfg_addr(self, dev, reg):
        self.cmd(f"outl 0xcf8 0x{0x80000000 | dev << 11 | (reg & 0xFC):x}")
        return 0xCFC + (reg & 3)

    def cfg_read(self, dev, reg, width):
        port = self.cfg_addr(dev, reg)
        return int(self.cmd(f"in{width} 0x{port:x}"), 16)

    def cfg_write(self, dev, reg, width, val):
        port = self.cfg_addr(dev, reg)
        self.cmd(f"out{width} 0x{port:x} 0x{val:x}")


class Driver:
    """Just enough of a virtio-pci driver for one split queue."""

    def __init__(self, qt):
        self.qt = qt
        self.avail_idx = 0
        self.used_idx = 0
        self.dev = next(
            (d for d in range(32)
             if qt.cfg_read(d, 0, "l") == DEVICE_DMLC << 16 | VENDOR_VIRTIO),
            None,
        )
        if self.dev is None:
            raise Failure("no PCI device 1af4:107f on bus 0")
        qt.cfg_write(self.dev, 0x20, "l", BAR4)  # BAR4, 64-bit
        qt.cfg_write(self.dev, 0x24, "l", 0)
        qt.cfg_write(self.dev, 0x04, "w", 0x6)  # memory space, bus master
        self.caps = {}
        ptr = qt.cfg_read(self.dev, 0x34, "b")
        while ptr:
            if qt.cfg_read(self.dev, ptr, "b") == 0x09:  # vendor-specific
                kind = qt.cfg_read(self.dev, ptr + 3, "b")
                bar = qt.cfg_read(self.dev, ptr + 4, "b")
                off = qt.cfg_read(self.dev, ptr + 8, "l")
                if bar == 4 and kind not in self.caps:
                    self.caps[kind] = BAR4 + off
                if kind == CAP_NOTIFY:
                    self.notify_mult = qt.cfg_read(self.dev, ptr + 16, "l")
            ptr = qt.cfg_read(self.dev, ptr + 1, "b")
        for kind in (CAP_COMMON, CAP_NOTIFY, CAP_DEVICE):
            if kind not in self.caps:
                raise Failure(f"virtio capability {kind} missing in BAR4")
        self.common = self.caps[CAP_COMMON]

    def init(self):
        qt, c = self.qt, self.common
        qt.wr("b", c + STATUS, 0)
        qt.wr("b", c + STATUS, S_ACK | S_DRIVER)
        qt.wr("l", c + DFSELECT, 1)
        if not qt.rd("l", c + DF) & 1:
            raise Failure("device does not offer VIRTIO_F_VERSION_1")
        qt.wr("l", c + GFSELECT, 0)
        qt.wr("l", c + GF, 0)
        qt.wr("l", c + GFSELECT, 1)
        qt.wr("l", c + GF, 1)  # VERSION_1 only
        qt.wr("b", c + STATUS, S_ACK | S_DRIVER | S_FEATURES_OK)
        if not qt.rd("b", c + STATUS) & S_FEATURES_OK:
            raise Failure("FEATURES_OK not accepted")
        queues = qt.rd("w", c + NUM_QUEUES_OFF)
        qt.wr("w", c + QSELECT, 0)
        if qt.rd("w", c + QSIZE) < QUEUE_SIZE:
            raise Failure("queue 0 is too small")
        qt.wr("w", c + QSIZE, QUEUE_SIZE)
        self.notify = (self.caps[CAP_NOTIFY]
                       + qt.rd("w", c + QNOTIFYOFF) * self.notify_mult)
        qt.mem_write(AVAIL, bytes(4 + 2 * QUEUE_SIZE))
        qt.mem_write(USED, bytes(4 + 8 * QUEUE_SIZE))
        for reg, addr in ((QDESC, DESC), (QDRIVER, AVAIL), (QDEVICE, USED)):
            qt.wr("l", c + reg, addr & 0xFFFFFFFF)
            qt.wr("l", c + reg + 4, addr >> 32)
        qt.wr("w", c + QENABLE, 1)
        qt.wr("b", c + STATUS, S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK)
        return queues

    def config(self):
        raw = self.qt.mem_read(self.caps[CAP_DEVICE], 48)
        names = ("rank", "world_size", "num_queues", "max_segments",
                 "max_bytes", "dtypes", "ops", "opcodes", "generation",
                 "group_id")
        return dict(zip(names, struct.unpack("<4IQ4IQ", raw)))

    def submit(self, descs, timeout=10.0):
        """Post one chain [(addr, len, writable)], kick, wait for it."""
        self.post(descs)
        return self.wait(timeout)

    def post(self, descs):
        """Post one chain [(addr, len, writable)] and kick."""
        qt = self.qt
        table = b""
        for i, (addr, length, writable) in enumerate(descs):
            flags = (F_WRITE if writable else 0) | (
                F_NEXT if i + 1 < len(descs) else 0)
            table += struct.pack("<QIHH", addr, length, flags, i + 1)
        qt.mem_write(DESC, table)
        slot = self.avail_idx % QUEUE_SIZE
        qt.wr("w", AVAIL + 4 + 2 * slot, 0)
        self.avail_idx = (self.avail_idx + 1) & 0xFFFF
        qt.wr("w", AVAIL + 2, self.avail_idx)
        qt.wr("w", self.notify, 0)
        self.kicks = 1

    def wait(self, timeout=10.0):
        """Wait for the oldest outstanding chain; (head, used.len)."""
        qt = self.qt
        start = time.monotonic()
        while qt.rd("w", USED + 2) == self.used_idx:
            waited = time.monotonic() - start
            if waited > timeout:
                raise Failure("request not completed in time")
            if waited > 0.5 * self.kicks:
                # A kick made while no backend was connected is lost.
                qt.wr("w", self.notify, 0)
                self.kicks += 1
            time.sleep(0.01)
        elem = qt.mem_read(USED + 4 + 8 * (self.used_idx % QUEUE_SIZE), 8)
        self.used_idx = (self.used_idx + 1) & 0xFFFF
        return struct.unpack("<II", elem)


def header(opcode, dtype, op, count, tag):
    return struct.pack("<HBBIQQII", opcode, dtype, op, 0, count, tag, 0, 0)


def response(qt):
    return dict(zip(("status", "detail", "peer", "generation"),
                    struct.unpack("<4I", qt.mem_read(RESP, 16))))


def post_allreduce(drv, values, tag):
    qt = drv.qt
    data = struct.pack(f"<{len(values)}f", *values)
    qt.mem_write(HDR, header(OPCODE_ALLREDUCE, DTYPE_F32, OP_SUM,
                             len(values), tag))
    qt.mem_write(INPUT, data)
    qt.mem_write(OUTPUT, bytes(len(data)))
    qt.mem_write(RESP, b"\xff" * 16)
    drv.post([(HDR, 32, False), (INPUT, len(data), False),
              (OUTPUT, len(data), True), (RESP, 16, True)])


def wait_allreduce(drv, count):
    _, written = drv.wait()
    out = struct.unpack(f"<{count}f", drv.qt.mem_read(OUTPUT, 4 * count))
    return response(drv.qt), written, list(out)


def allreduce(drv, values, tag):
    post_allreduce(drv, values, tag)
    return wait_allreduce(drv, len(values))


def start_backend(backend, sock, log, members=1):
    return subprocess.Popen(
        [backend, "--socket-path", sock, "--socket-count", str(members),
         "--queues", str(NUM_QUEUES), "--timeout-ms", "2000"],
        stdout=log, stderr=subprocess.STDOUT)


def wait_for(path, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise Failure(f"{path} did not appear")
        time.sleep(0.05)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    qemu, backend = sys.argv[1], sys.argv[2]
    work = tempfile.mkdtemp(prefix="dmlc-smoke-")
    logs = []
    procs = []
    passed = failed = 0
    firmware = []
    for d in filter(None, os.environ.get("DMLC_QEMU_FIRMWARE", "").split(":")):
        firmware += ["-L", d]

    def check(name, ok, detail=""):
        nonlocal passed, failed
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}",
              flush=True)
        if ok:
            passed += 1
        else:
            failed += 1

    def log_file(name):
        log = open(os.path.join(work, name), "w+")
        logs.append(log)
        return log

    def run_qemu(sock, name):
        proc = subprocess.Popen(
            [qemu, *firmware, "-machine", "q35,memory-backend=mem",
             "-m", "64M",
             "-object", "memory-backend-memfd,id=mem,size=64M,share=on",
             "-accel", "qtest", "-qtest", "stdio", "-qtest-log", "/dev/null",
             "-display", "none", "-nodefaults",
             "-chardev", f"socket,id=c0,path={sock},reconnect-ms=100",
             "-device",
             f"vhost-user-dmlc-pci,chardev=c0,num-queues={NUM_QUEUES}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log_file(name))
        procs.append(proc)
        return proc, Driver(QTest(proc))

    try:
        # One member: the device, its config space, requests, reconnect.
        sock = os.path.join(work, "solo.sock")
        blog = log_file("solo-backend.log")
        backend_proc = start_backend(backend, sock, blog)
        procs.append(backend_proc)
        wait_for(sock + "0")
        qemu_proc, drv = run_qemu(sock + "0", "solo-qemu.log")
        qt = drv.qt
        check("device 1af4:107f found", True, f"slot {drv.dev}")
        cfg = drv.config()
        check("config space from the backend",
              cfg["world_size"] == 1 and cfg["rank"] == 0
              and cfg["num_queues"] == NUM_QUEUES and cfg["generation"] >= 1,
              str(cfg))
        queues = drv.init()
        check("virtio-pci num_queues", queues == NUM_QUEUES, str(queues))

        resp, written, out = allreduce(drv, [1.5, -2.0, 3.25, 8.0], 7)
        check("allreduce f32 sum, world of 1",
              resp["status"] == STATUS_OK and out == [1.5, -2.0, 3.25, 8.0]
              and written == 32, f"{resp} used.len={written} out={out}")

        qt.mem_write(HDR, header(OPCODE_BARRIER, 0, 0, 0, 8))
        qt.mem_write(RESP, b"\xff" * 16)
        drv.submit([(HDR, 32, False), (RESP, 16, True)])
        resp = response(qt)
        check("barrier", resp["status"] == STATUS_OK, str(resp))

        # Backend restart: QEMU must survive and reconnect (reconnect-ms).
        backend_proc.send_signal(signal.SIGTERM)
        backend_proc.wait(timeout=10)
        time.sleep(0.5)
        check("QEMU survives the backend's exit", qemu_proc.poll() is None)
        if os.path.exists(sock + "0"):
            os.unlink(sock + "0")
        procs.append(start_backend(backend, sock, blog))
        wait_for(sock + "0")
        # The reconnect happens in QEMU's main loop; a request made before
        # it completes waits in the ring until the backend starts.
        resp, written, out = allreduce(drv, [4.0, 5.0], 9)
        check("allreduce after backend restart",
              resp["status"] == STATUS_OK and out == [4.0, 5.0],
              f"{resp} out={out} kicks={drv.kicks}")

        # Two members: one backend, two QEMUs, one allreduce across them.
        sock = os.path.join(work, "pair.sock")
        procs.append(start_backend(backend, sock, log_file("pair-backend.log"),
                                   members=2))
        wait_for(sock + "1")
        pair = [run_qemu(f"{sock}{r}", f"pair-qemu{r}.log") for r in (0, 1)]
        drvs = [d for _, d in pair]
        ranks = [d.config()["rank"] for d in drvs]
        check("ranks of a group of 2", ranks == [0, 1], str(ranks))
        inputs = ([1.0, 2.0, 3.0], [10.0, 20.0, 30.0])
        for d, values in zip(drvs, inputs):
            d.init()
            post_allreduce(d, values, 11)
        for r, d in enumerate(drvs):
            resp, _, out = wait_allreduce(d, 3)
            check(f"allreduce across 2 QEMUs, rank {r}",
                  resp["status"] == STATUS_OK and out == [11.0, 22.0, 33.0],
                  f"{resp} out={out}")

        # QEMU fetches the config space from the backend on every read, so
        # rank 0 sees the generation change when rank 1 goes away.
        before = drvs[0].config()["generation"]
        pair[1][0].kill()
        deadline = time.monotonic() + 10
        while (after := drvs[0].config()["generation"]) == before:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        check("generation changes when a member's QEMU dies", after > before,
              f"{before} -> {after}")
    except (Failure, OSError, subprocess.TimeoutExpired) as e:
        check("smoke test", False, str(e))
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            if failed:
                log.seek(0)
                print(f"--- {log.name}:\n{log.read()}", flush=True)
            log.close()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
