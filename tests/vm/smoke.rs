//! Smoke tests of the guest image and the VM harness, with no dmlc device:
//! the job runs and reports its status and output, the guest is set up
//! (hugepages, sysfs PCI, modules, a dynamically linked Rust binary), long
//! jobs go through fw_cfg, two VMs talk over virtio-net, failures (a VM
//! that dies, a job that hangs) are reported and every VM is killed, and a
//! job runs the host's own Python in the host's root shared over virtio-fs.
//!
//! Needs QEMU (see vm-harness/README.md) and, for the host-root test,
//! virtiofsd (vm-harness/build-virtiofsd.sh; the test runs it when there
//! is none, as the harness builds QEMU); boots eight TCG VMs in all.

use dmlc_vm::{run_ok, Cluster, Error, Image, ImageOptions, Options, Qemu, Virtiofsd, VmSpec};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The default options, with the VMs' logs under target/.
fn options() -> Options {
    Options {
        tmp_dir: Some(env!("CARGO_TARGET_TMPDIR").into()),
        ..Options::default()
    }
}

/// QEMU and an image holding this test binary as /usr/bin/vm-smoke (a
/// dynamically linked Rust program: proves the ldd copy).
fn setup() -> (Qemu, Image) {
    let qemu = Qemu::from_env().unwrap_or_else(|e| panic!("qemu: {e}"));
    let exe = std::env::current_exe().expect("current_exe");
    let opts = ImageOptions {
        strip: true,
        ..ImageOptions::default()
    };
    let image = Image::build(&[(exe.as_path(), "/usr/bin/vm-smoke")], &opts)
        .unwrap_or_else(|e| panic!("image: {e}"));
    (qemu, image)
}

/// Processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(raw) = fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&raw).replace('\0', " ");
        if cmd.contains(needle) {
            found.push(cmd);
        }
    }
    found
}

#[test]
fn job_runs_in_a_set_up_guest_and_reports_its_status() {
    let (qemu, image) = setup();
    let job = "echo hello; echo \"R=$RANK W=$WORDS\"; \
               vm-smoke --list 2>&1 | grep -c '^job_runs_in_a_set_up_guest.*: test$'; \
               grep HugePages_Total /proc/meminfo; mount | grep -c hugetlbfs; \
               ls /sys/bus/pci/devices; \
               for m in virtio_pci virtio_net uio_pci_generic qemu_fw_cfg; do \
               grep -q \"^$m \" /proc/modules && echo \"mod $m\"; done; exit 3";
    let spec = VmSpec::new(job).env("RANK", "7").env("WORDS", "two words");
    let mut cluster = Cluster::start(&qemu, &image, &[spec], &options()).unwrap();
    let out = cluster.wait().unwrap().remove(0);
    eprintln!("boot {:?}, exit {:?}", out.boot, out.total);
    eprint!("{}", out.output);
    assert_eq!(out.status, 3);
    let lines: Vec<&str> = out.output.lines().collect();
    assert_eq!(lines[0], "hello");
    assert_eq!(lines[1], "R=7 W=two words");
    assert_eq!(lines[2], "1", "vm-smoke --list should list this test");
    assert_eq!(lines[3], "HugePages_Total:      16");
    assert_eq!(lines[4], "1", "hugetlbfs mounted once");
    assert!(out.output.contains("0000:00:00.0"), "sysfs PCI devices");
    for m in ["virtio_pci", "virtio_net", "uio_pci_generic", "qemu_fw_cfg"] {
        assert!(out.output.contains(&format!("mod {m}\n")), "module {m}");
    }
    assert!(out.boot <= out.total);
}

#[test]
fn long_job_goes_through_fw_cfg() {
    let (qemu, image) = setup();
    // Far beyond the kernel command line's 2048 bytes.
    let filler = "x".repeat(4000);
    let spec = VmSpec::new(format!(
        "f={filler}; echo \"len=${{#f}} env=${{#BIG}}\"; \
         test -r /sys/firmware/qemu_fw_cfg/by_name/opt/dmlc/cmd/raw"
    ))
    .env("BIG", "y".repeat(1000));
    let out = run_ok(&qemu, &image, &[spec], &options()).unwrap();
    assert_eq!(out[0].output, "len=4000 env=1000\n");
}

#[test]
fn two_vms_talk_over_virtio_net() {
    let (qemu, image) = setup();
    let server = VmSpec::new("nc -l -p 5000 >/tmp/got; cat /tmp/got");
    // The server may not listen yet: retry.
    let client = VmSpec::new(
        "for i in $(seq 150); do echo hello-over-net | nc 10.0.0.1 5000 && exit 0; \
         sleep 0.2; done; exit 1",
    );
    let opts = Options {
        net: true,
        timeout: Duration::from_secs(180),
        ..options()
    };
    let out = run_ok(&qemu, &image, &[server, client], &opts).unwrap();
    assert_eq!(out[0].output, "hello-over-net\n");
}

#[test]
fn vm_that_dies_early_is_reported() {
    let (qemu, image) = setup();
    let spec = VmSpec::new("echo bye; poweroff -f");
    let mut cluster = Cluster::start(&qemu, &image, &[spec], &options()).unwrap();
    let err = cluster.wait().unwrap_err();
    assert!(matches!(err, Error::EarlyExit { vm: 0, .. }), "{err}");
}

#[test]
fn timeout_is_reported_and_kills_every_vm() {
    let (qemu, image) = setup();
    let specs = [VmSpec::new("sleep 1000"), VmSpec::new("true")];
    let opts = Options {
        timeout: Duration::from_secs(30),
        ..options()
    };
    let mut cluster = Cluster::start(&qemu, &image, &specs, &opts).unwrap();
    let dir = cluster.dir().to_string_lossy().into_owned();
    let err = cluster.wait().unwrap_err();
    // VM 1 finishes unless the machine is very slow; VM 0 never does.
    assert!(
        matches!(&err, Error::Timeout { vms, .. } if vms.first() == Some(&0)),
        "{err}"
    );
    assert!(processes_mentioning(&dir).is_empty(), "VMs left running");
    drop(cluster);
    assert!(Path::new(&dir).exists(), "logs of a failed run are kept");
    let _ = fs::remove_dir_all(&dir);
}

/// The host's python3, found where the guest's PATH looks (the guest's job
/// has PATH=/usr/sbin:/usr/bin:/sbin:/bin, not the host user's shims).
fn host_python() -> PathBuf {
    ["/usr/local/bin/python3", "/usr/bin/python3", "/bin/python3"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .expect(
            "the host-root test runs the host's python3; none in /usr/local/bin, /usr/bin, /bin",
        )
}

#[test]
fn job_runs_the_hosts_python_in_the_shared_host_root() {
    let (qemu, image) = setup();
    // Built once into the cache, where Cluster::start looks (as setup()
    // builds QEMU when there is none).
    if let Err(missing) = Virtiofsd::from_env() {
        eprintln!("{missing}; building it");
        Virtiofsd::build().unwrap_or_else(|e| panic!("virtiofsd: {e}"));
    }
    let python = host_python();
    let version = r#"import sys; print(sys.version)"#;
    let host = Command::new(&python)
        .args(["-c", version])
        .output()
        .unwrap();
    assert!(host.status.success());
    let expected = String::from_utf8(host.stdout).unwrap();
    // Written through the guest's RAM overlay on /root: must not reach the host.
    let marker = format!(".dmlc-vm-smoke-{}", std::process::id());
    let job = format!(
        "{py} -c '{version}'; pwd; \
         touch /etc/{marker} 2>/dev/null && echo etc writable || echo etc read-only; \
         echo t >/tmp/t && echo t >/var/tmp/t && echo t >/run/t && echo tmp writable; \
         echo r >/root/{marker} && cat /root/{marker}; \
         test -e /dev/hugepages && grep -c hugetlbfs /proc/mounts; \
         grep -m1 '^flags' /proc/cpuinfo | grep -ow -e sse4_2 -e popcnt | sort",
        py = python.display()
    );
    let spec = VmSpec::new(job).host_root().cwd("/usr");
    let opts = Options {
        timeout: Duration::from_secs(180),
        ..options()
    };
    let mut cluster =
        Cluster::start(&qemu, &image, &[spec], &opts).unwrap_or_else(|e| panic!("{e}"));
    let dir = cluster.dir().to_string_lossy().into_owned();
    let out = cluster.wait_ok().unwrap().remove(0);
    eprintln!("boot {:?}, exit {:?}", out.boot, out.total);
    eprint!("{}", out.output);
    let lines: Vec<&str> = out.output.lines().collect();
    assert_eq!(lines[0], expected.trim_end(), "the host's Python version");
    assert_eq!(lines[1], "/usr", "dmlc.cwd");
    assert_eq!(lines[2], "etc read-only");
    assert_eq!(lines[3], "tmp writable");
    assert_eq!(lines[4], "r", "/root is writable (overlay)");
    assert_eq!(lines[5], "1", "hugetlbfs bound into the new root");
    assert_eq!(
        lines[6..],
        ["popcnt", "sse4_2"],
        "-cpu max: x86-64-v2 programs run"
    );
    assert!(
        !Path::new("/root").join(&marker).exists(),
        "guest write reached the host"
    );
    drop(cluster);
    assert!(
        processes_mentioning(&dir).is_empty(),
        "virtiofsd or QEMU left running"
    );
}
