//! The C ABI end to end: compiles tests/c/allreduce.c and tests/c/comms.c
//! against include/dmlc_guest.h and the built libdmlc_guest, checks that
//! the header's constants equal the device ABI's, and runs C ranks against
//! the backend (two for the collectives, four for communicators, send and
//! receive, all-to-all, gather and scatter).

use std::collections::HashMap;
use std::mem::{offset_of, size_of};
use std::time::Duration;

use dmlc_guest::ffi;
use dmlc_test_support::{build_c_program, c_command, serial, temp_dir, Backend, Proc};
use virtio_dmlc::comm::{self, CommOpcode};
use virtio_dmlc::{Dtype, Opcode, ReduceOp, Status};

#[test]
fn header_constants_match_the_device_abi() {
    let dir = temp_dir("cabi-const");
    let exe = c_program(&dir, "allreduce");
    let out = c_command(&exe)
        .arg("--constants")
        .output()
        .expect("run the C program");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let got: HashMap<String, i64> = text
        .lines()
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(k, v)| (k.to_string(), v.parse().expect("number")))
        .collect();
    let check = |name: String, want: i64| {
        assert_eq!(
            got.get(&name),
            Some(&want),
            "{name} in dmlc_guest.h differs from the device ABI or ffi.rs"
        );
    };
    for d in Dtype::ALL {
        check(
            format!("DMLC_DTYPE_{}", d.name().to_uppercase()),
            d.raw().into(),
        );
        check(format!("dmlc_dtype_size({})", d.raw()), d.size() as i64);
    }
    for o in ReduceOp::ALL {
        check(
            format!("DMLC_OP_{}", o.name().to_uppercase()),
            o.raw().into(),
        );
    }
    for c in Opcode::ALL {
        check(
            format!("DMLC_OPCODE_{}", c.name().to_uppercase()),
            c.raw().into(),
        );
    }
    for c in CommOpcode::ALL {
        check(
            format!("DMLC_OPCODE_{}", c.name().to_uppercase()),
            c.raw().into(),
        );
    }
    // Spec 5.X.6.13: the constants of communicators and their details.
    for (name, value) in [
        ("DMLC_COMM_WORLD", comm::COMM_WORLD),
        ("DMLC_ANY_SOURCE", comm::ANY_SOURCE),
        ("DMLC_UNDEFINED", comm::UNDEFINED),
        ("DMLC_FEATURE_COMM", 1 << comm::VIRTIO_DMLC_F_COMM),
        ("DMLC_FEATURE_P2P", 1 << comm::VIRTIO_DMLC_F_P2P),
        ("DMLC_FEATURE_BLOCKS", 1 << comm::VIRTIO_DMLC_F_BLOCKS),
        ("DMLC_BAD_COMM", comm::BAD_COMM),
        ("DMLC_BAD_PEER", comm::BAD_PEER),
        ("DMLC_BAD_TABLE", comm::BAD_TABLE),
        ("DMLC_BAD_IN_PLACE_OPCODE", comm::BAD_IN_PLACE_OPCODE),
        ("DMLC_MISMATCH_TABLE", comm::MISMATCH_TABLE),
        ("DMLC_TOO_BIG_COMMS", comm::TOO_BIG_COMMS),
    ] {
        check(name.into(), value.into());
    }
    for (name, value) in [
        ("DMLC_COMM_WORLD", ffi::DMLC_COMM_WORLD),
        ("DMLC_ANY_SOURCE", ffi::DMLC_ANY_SOURCE),
        ("DMLC_UNDEFINED", ffi::DMLC_UNDEFINED),
        ("DMLC_FEATURE_COMM", ffi::DMLC_FEATURE_COMM),
        ("DMLC_FEATURE_P2P", ffi::DMLC_FEATURE_P2P),
        ("DMLC_FEATURE_BLOCKS", ffi::DMLC_FEATURE_BLOCKS),
    ] {
        check(name.into(), value.into());
    }
    // The comm structs mirror the device's header and response: the
    // request's fixed part ends where the header's table starts, and the
    // completion is as long as the 40-byte response.
    check(
        "offsetof(dmlc_comm_request, table)".into(),
        comm::REQ_COMM_HEADER_SIZE as i64,
    );
    check(
        "sizeof(dmlc_comm_completion)".into(),
        comm::RESP_COMM_SIZE as i64,
    );
    for s in Status::ALL {
        let name = match s {
            Status::Ok => "DMLC_OK".to_string(),
            s => format!("DMLC_ERR_{}", s.name().to_uppercase()),
        };
        check(name, s.raw().into());
    }
    check(
        "DMLC_FLAG_IN_PLACE".into(),
        virtio_dmlc::FLAG_IN_PLACE.into(),
    );
    check("DMLC_NO_PEER".into(), virtio_dmlc::NO_PEER.into());
    check("DMLC_WAIT_HYBRID".into(), ffi::DMLC_WAIT_HYBRID.into());
    check("DMLC_WAIT_POLL".into(), 1);
    // The driver's own statuses, and the ABI version of header and library.
    for (name, code) in [
        ("INVALID_ARGUMENT", ffi::DMLC_ERR_INVALID_ARGUMENT),
        ("NO_STATUS", ffi::DMLC_ERR_NO_STATUS),
        ("UNKNOWN_STATUS", ffi::DMLC_ERR_UNKNOWN_STATUS),
        ("WAIT_TIMEOUT", ffi::DMLC_ERR_WAIT_TIMEOUT),
        ("QUEUE_FULL", ffi::DMLC_ERR_QUEUE_FULL),
        ("OUT_OF_MEMORY", ffi::DMLC_ERR_OUT_OF_MEMORY),
        ("UNKNOWN_HANDLE", ffi::DMLC_ERR_UNKNOWN_HANDLE),
        ("TRANSPORT", ffi::DMLC_ERR_TRANSPORT),
        ("DEVICE", ffi::DMLC_ERR_DEVICE),
        ("INTERNAL", ffi::DMLC_ERR_INTERNAL),
        ("UNANSWERED", ffi::DMLC_ERR_UNANSWERED),
        ("REQUEST_DROPPED", ffi::DMLC_ERR_REQUEST_DROPPED),
        ("BUFFER_BUSY", ffi::DMLC_ERR_BUFFER_BUSY),
        ("ENVIRONMENT", ffi::DMLC_ERR_ENVIRONMENT),
    ] {
        check(format!("DMLC_ERR_{name}"), code.into());
    }
    check("DMLC_ABI_VERSION".into(), ffi::DMLC_ABI_VERSION.into());
    check("dmlc_abi_version()".into(), ffi::DMLC_ABI_VERSION.into());
    check("DMLC_WAIT_INTERRUPT".into(), 0);
    check(
        "sizeof(dmlc_config)".into(),
        virtio_dmlc::CONFIG_SIZE as i64,
    );
    check(
        "sizeof(dmlc_request)".into(),
        virtio_dmlc::REQ_HEADER_SIZE as i64,
    );
    // The header's structs and the Rust side's #[repr(C)] twins agree,
    // field by field (offset and size).
    let mut layout = vec![
        (
            "sizeof(dmlc_config)".to_string(),
            size_of::<ffi::DmlcConfig>(),
        ),
        (
            "sizeof(dmlc_open_options)".to_string(),
            size_of::<ffi::DmlcOpenOptions>(),
        ),
        (
            "sizeof(dmlc_request)".to_string(),
            size_of::<ffi::DmlcRequest>(),
        ),
        (
            "sizeof(dmlc_segment)".to_string(),
            size_of::<ffi::DmlcSegment>(),
        ),
        (
            "sizeof(dmlc_completion)".to_string(),
            size_of::<ffi::DmlcCompletion>(),
        ),
        (
            "sizeof(dmlc_comm_info)".to_string(),
            size_of::<ffi::DmlcCommInfo>(),
        ),
        (
            "sizeof(dmlc_comm_request)".to_string(),
            size_of::<ffi::DmlcCommRequest>(),
        ),
        (
            "sizeof(dmlc_comm_completion)".to_string(),
            size_of::<ffi::DmlcCommCompletion>(),
        ),
    ];
    macro_rules! fields {
        ($c:literal, $t:ty, $($f:ident),*) => {$(
            layout.push((format!("offsetof({}, {})", $c, stringify!($f)), offset_of!($t, $f)));
            layout.push((format!("sizeof({}.{})", $c, stringify!($f)), field_size(|s: &$t| &s.$f)));
        )*};
    }
    fields!(
        "dmlc_config",
        ffi::DmlcConfig,
        rank,
        world_size,
        num_queues,
        max_segments,
        max_bytes,
        dtypes,
        ops,
        opcodes,
        generation,
        group_id
    );
    fields!(
        "dmlc_open_options",
        ffi::DmlcOpenOptions,
        poll,
        queue_size,
        event_idx,
        dma_bytes
    );
    fields!(
        "dmlc_request",
        ffi::DmlcRequest,
        opcode,
        dtype,
        op,
        root,
        count,
        tag,
        flags,
        timeout_ms
    );
    fields!("dmlc_segment", ffi::DmlcSegment, buf, offset, len);
    fields!(
        "dmlc_completion",
        ffi::DmlcCompletion,
        status,
        detail,
        peer,
        generation
    );
    fields!("dmlc_comm_info", ffi::DmlcCommInfo, id, rank, size);
    fields!(
        "dmlc_comm_request",
        ffi::DmlcCommRequest,
        opcode,
        dtype,
        op,
        root,
        count,
        tag,
        flags,
        timeout_ms,
        comm,
        peer,
        key,
        table_bytes,
        table
    );
    fields!(
        "dmlc_comm_completion",
        ffi::DmlcCommCompletion,
        status,
        detail,
        peer,
        generation,
        length,
        comm,
        comm_rank,
        comm_size,
        peer_world
    );
    for (name, rust) in layout {
        check(name, rust as i64);
    }
}

/// Size of the field that `get` borrows.
fn field_size<T, F>(_get: impl Fn(&T) -> &F) -> usize {
    size_of::<F>()
}

fn run_ranks(mode: &str) {
    let _g = serial();
    let dir = temp_dir("cabi-run");
    let exe = c_program(&dir, "allreduce");
    let backend = Backend::start("cabi", 2, &["--log-level", "warn"]);
    let mut ranks: Vec<Proc> = (0..2)
        .map(|r| {
            Proc::spawn(
                &format!("c rank {r}"),
                c_command(&exe).arg(backend.socket(r)).arg(mode),
            )
        })
        .collect();
    for (r, p) in ranks.iter_mut().enumerate() {
        let st = p.finish(Duration::from_secs(120));
        assert!(st.success(), "C rank {r} failed ({st}):\n{}", p.dump());
        assert!(
            p.stdout().contains(&format!("PASS rank {r} of 2")),
            "{}",
            p.dump()
        );
    }
}

#[test]
fn c_program_runs_every_collective_polling() {
    run_ranks("poll");
}

#[test]
fn c_program_runs_every_collective_with_interrupts() {
    run_ranks("interrupt");
}

/// Communicators, send and receive, all-to-all, gather and scatter, from
/// C on four ranks; a `max_bytes` that is no multiple of 8 makes messages
/// and block collectives several requests.
#[test]
fn c_program_runs_communicators_send_receive_and_block_collectives() {
    let _g = serial();
    let dir = temp_dir("cabi-comms");
    let exe = c_program(&dir, "comms");
    let backend = Backend::start(
        "cabi-comms",
        4,
        &[
            "--log-level",
            "warn",
            "--max-bytes",
            "65540",
            "--timeout-ms",
            "20000",
        ],
    );
    let mut ranks: Vec<Proc> = (0..4)
        .map(|r| {
            Proc::spawn(
                &format!("c rank {r}"),
                c_command(&exe).arg(backend.socket(r)),
            )
        })
        .collect();
    for (r, p) in ranks.iter_mut().enumerate() {
        let st = p.finish(Duration::from_secs(120));
        assert!(st.success(), "C rank {r} failed ({st}):\n{}", p.dump());
        assert!(
            p.stdout().contains(&format!("PASS rank {r} of 4")),
            "{}",
            p.dump()
        );
    }
}

/// Builds `tests/c/{name}.c` of this crate against its headers.
fn c_program(dir: &dmlc_test_support::TempDir, name: &str) -> std::path::PathBuf {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    build_c_program(
        dir.path(),
        &here.join("include"),
        &here.join("tests/c"),
        name,
    )
}
