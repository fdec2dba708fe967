//! Fast tests of `dmlc-qemu`'s command line: help texts and the errors for
//! wrong flags. No VM is started: every case fails before QEMU is looked for.

use std::process::{Command, Output};

fn dmlc_qemu(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dmlc-qemu"))
        .args(args)
        // A backend that exists, so that only the case's own mistake fails.
        .env("DMLC_BACKEND", "/bin/true")
        .output()
        .expect("run dmlc-qemu")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn help_explains_every_flag() {
    let top = dmlc_qemu(&["--help"]);
    assert!(top.status.success());
    let top = text(&top.stdout);
    for needle in ["submit", "demo", "dmlc-qemu demo"] {
        assert!(top.contains(needle), "{needle:?} not in --help:\n{top}");
    }

    let out = dmlc_qemu(&["submit", "--help"]);
    assert!(out.status.success());
    let help = text(&out.stdout);
    for needle in [
        "--num-workers <N>",
        "--vcpus <C>",
        "--memory <M>",
        "--dma <SIZE>",
        "--accel <ACCEL>",
        "--transport <TRANSPORT>",
        "--files <HOST:GUEST>",
        "--timeout <SECS>",
        "--log-dir <DIR>",
        "--kernel-driver <KO>",
        "--backend <PATH>",
        "--backend-arg <ARG>",
        "--env <K=V>",
        "<PROGRAM>...",
        "DMLC_TASK_ID=i",
        "DMLC_TCP_PEERS",
        "--tracker <KIND>",
        "RabitTracker",
        "DMLC_TRACKER_URI=10.0.0.1 DMLC_TRACKER_PORT=9092",
        "--tracker-python <PATH>",
        "tcp with --tracker",
        "/usr/local/bin/NAME",
        "Exit status",
        "124 on timeout",
        "--hosts <A,B,...>",
        "--hostfile <FILE>",
        "--mpirun <PATH>",
        "--mpirun-arg <ARG>",
        "h*L .. h*L+L-1",
        "vhost-device-dmlc --mpi",
        "DIR/hostH",
    ] {
        assert!(
            help.contains(needle),
            "{needle:?} not in submit --help:\n{help}"
        );
    }

    let out = dmlc_qemu(&["demo", "--help"]);
    assert!(out.status.success());
    let help = text(&out.stdout);
    for needle in [
        "--steps <N>",
        "--num-workers <N>",
        "--trainer <PATH>",
        "--model <MODEL>",
        "[default: mlp]",
        "1,126,410",
        "softmax regression, 650",
        "cargo build",
    ] {
        assert!(
            help.contains(needle),
            "{needle:?} not in demo --help:\n{help}"
        );
    }
}

#[test]
fn wrong_flags_get_clear_errors() {
    let cases: &[(&[&str], &str)] = &[
        (&["submit", "--", "sh"], "--num-workers <N>"),
        (&["submit", "-n", "0", "--", "sh"], "0 is not in 1..=64"),
        (&["submit", "-n", "2"], "<PROGRAM>"),
        (
            &["submit", "-n", "2", "--memory", "12X", "--", "sh"],
            "unknown unit",
        ),
        (
            &["submit", "-n", "2", "--memory", "64M", "--", "sh"],
            "128M to 1024G",
        ),
        (
            &["submit", "-n", "2", "--vcpus", "0", "--", "sh"],
            "--vcpus <C>",
        ),
        (
            &["submit", "-n", "2", "--accel", "xen", "--", "sh"],
            "invalid value 'xen'",
        ),
        (
            &["submit", "-n", "2", "--transport", "udp", "--", "sh"],
            "invalid value 'udp'",
        ),
        (
            &["submit", "-n", "2", "--timeout", "soon", "--", "sh"],
            "invalid value 'soon'",
        ),
        (
            &["submit", "-n", "2", "--files", "/no/such:/x", "--", "sh"],
            "/no/such does not exist",
        ),
        (
            &["submit", "-n", "2", "--files", "Cargo.toml", "--", "sh"],
            "HOST:GUEST",
        ),
        (
            &["submit", "-n", "2", "--files", "Cargo.toml:/c", "sh"],
            "put '--' before PROGRAM",
        ),
        (
            &["submit", "-n", "2", "--env", "1X=y", "--", "sh"],
            "not a variable name",
        ),
        (
            &["submit", "-n", "2", "--env", "X", "--", "sh"],
            "expected KEY=VALUE",
        ),
        (
            &["submit", "-n", "2", "--", "./no/such/prog"],
            "PROGRAM ./no/such/prog",
        ),
        (
            &["submit", "-n", "2", "--backend", "/no/such", "--", "sh"],
            "backend /no/such",
        ),
        (
            &["submit", "-n", "2", "--tracker", "mpi", "--", "sh"],
            "invalid value 'mpi' for '--tracker <KIND>'",
        ),
        (
            &["submit", "-n", "2", "--tracker", "rabit", "--", "sh"],
            "--tracker rabit needs --host-root",
        ),
        (
            &["submit", "-n", "2", "--kernel-driver", "/k.ko", "--", "sh"],
            "--host-root",
        ),
        (
            &[
                "submit",
                "-n",
                "2",
                "--host-root",
                "--kernel-driver",
                "/no/such/virtio_dmlc.ko",
                "--",
                "sh",
            ],
            "--kernel-driver /no/such/virtio_dmlc.ko: no such file",
        ),
        (
            &[
                "submit",
                "-n",
                "2",
                "--tracker-python",
                "/bin/sh",
                "--",
                "sh",
            ],
            "--tracker <KIND>",
        ),
        (
            &[
                "submit",
                "-n",
                "2",
                "--tracker",
                "rabit",
                "--host-root",
                "--tracker-python",
                "/no/such/python",
                "--",
                "sh",
            ],
            "cannot run /no/such/python",
        ),
        (
            &[
                "submit",
                "-n",
                "3",
                "--hosts",
                "a,b",
                "--mpirun",
                "/bin/true",
                "sh",
            ],
            "--num-workers 3 does not divide among 2 hosts",
        ),
        (
            &[
                "submit",
                "-n",
                "2",
                "--hosts",
                "a,a",
                "--mpirun",
                "/bin/true",
                "sh",
            ],
            "host a is given twice",
        ),
        (
            &[
                "submit",
                "-n",
                "2",
                "--hosts",
                "a,b",
                "--mpirun",
                "/bin/true",
                "--transport",
                "tcp",
                "sh",
            ],
            "--transport tcp does not work across hosts",
        ),
        (
            &[
                "submit",
                "-n",
                "2",
                "--hosts",
                "a,b",
                "--mpirun",
                "/bin/true",
                "--backend-arg=--timing=t.toml",
                "sh",
            ],
            "--backend-arg --timing=t.toml does not work across hosts",
        ),
        (
            &[
                "submit", "-n", "2", "--hosts", "a,b", "--mpirun", "/no/such", "sh",
            ],
            "--mpirun /no/such",
        ),
        (
            &["submit", "-n", "2", "--mpirun-arg=-v", "sh"],
            "--mpirun and --mpirun-arg need --hosts or --hostfile",
        ),
        (
            &["submit", "-n", "2", "--hostfile", "/no/such", "sh"],
            "--hostfile /no/such",
        ),
        (
            &[
                "submit",
                "-n",
                "2",
                "--hosts",
                "a,b",
                "--hostfile",
                "f",
                "sh",
            ],
            "cannot be used with",
        ),
        (
            // DMLC_BACKEND is /bin/true, which is no vhost-device-dmlc.
            &[
                "submit",
                "-n",
                "2",
                "--hosts",
                "a,b",
                "--mpirun",
                "/bin/true",
                "sh",
            ],
            "does not look like vhost-device-dmlc",
        ),
        (&["submit", "--bogus"], "unexpected argument '--bogus'"),
        (&["frobnicate"], "unrecognized subcommand 'frobnicate'"),
        (&["demo", "--steps", "0"], "0 is not in 1.."),
        (&["demo", "--trainer", "/no/such"], "trainer /no/such"),
        (
            &["demo", "--model", "cnn"],
            "invalid value 'cnn' for '--model <MODEL>'",
        ),
    ];
    for (args, needle) in cases {
        let out = dmlc_qemu(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {needle:?} not in:\n{err}");
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?} printed on stdout");
    }
}

#[test]
fn a_tracker_python_without_xgboost_is_refused_before_any_vm() {
    // A "Python" that fails the import check the way one without xgboost
    // does.
    let fake = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("python-without-xgboost");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'xgboost'\" >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = dmlc_qemu(&[
        "submit",
        "-n",
        "2",
        "--tracker",
        "rabit",
        "--host-root",
        "--",
        fake.to_str().unwrap(),
        "train.py",
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let want = format!(
        "{} cannot import xgboost.tracker (ModuleNotFoundError: No module named 'xgboost')",
        fake.display()
    );
    // PROGRAM named python* is the tracker's Python too.
    assert!(err.contains(&want), "{err}");
    // Or --tracker-python names it.
    let out = dmlc_qemu(&[
        "submit",
        "-n",
        "2",
        "--tracker",
        "rabit",
        "--host-root",
        "--tracker-python",
        fake.to_str().unwrap(),
        "--",
        "sh",
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(&want), "{err}");
    assert!(err.contains("--tracker-python PATH"), "{err}");
}

#[test]
fn a_program_that_is_not_executable_is_refused() {
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("not-executable");
    std::fs::write(&path, "data").unwrap();
    let out = dmlc_qemu(&["submit", "-n", "2", "--", path.to_str().unwrap()]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("is not an executable file"), "{err}");
}

#[test]
fn program_arguments_are_not_parsed_as_flags() {
    // `--help` after PROGRAM belongs to the program: the launcher goes on
    // (and stops at the missing backend) instead of printing its help.
    let out = Command::new(env!("CARGO_BIN_EXE_dmlc-qemu"))
        .args(["submit", "-n", "1", "--backend", "/no/such", "sh", "--help"])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("backend /no/such"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn across_hosts_a_backend_without_mpi_is_refused_with_how_to_build_one() {
    // A "backend" that answers --mpi the way one built without the feature
    // does.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let fake = dir.join("backend-without-mpi");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho 'error: --mpi: this vhost-device-dmlc was built without MPI' >&2\nexit 2\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let hostfile = dir.join("hostfile-two");
    std::fs::write(&hostfile, "# two hosts\nnode-a slots=2\nnode-b\n").unwrap();
    let out = dmlc_qemu(&[
        "submit",
        "-n",
        "4",
        "--hostfile",
        hostfile.to_str().unwrap(),
        "--mpirun",
        "/bin/true",
        "--backend",
        fake.to_str().unwrap(),
        "--",
        "sh",
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("was built without MPI, which --hosts needs"),
        "{err}"
    );
    assert!(
        err.contains("cargo build --release -p vhost-device-dmlc --features mpi"),
        "{err}"
    );
}
