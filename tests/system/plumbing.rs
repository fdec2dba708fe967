//! The plumbing under every other test: QEMU plugs the device into each
//! guest and connects to the backend's socket for its rank, and the driver
//! reads the backend's config space over PCI.

use std::time::{Duration, Instant};

use dmlc_vm::VmSpec;

use crate::common::{guest, progress, setup, vm, Backend, Vms};

#[test]
fn two_vms_see_the_device_and_the_backend_sees_both() {
    let Some(env) = setup("two_vms_see_the_device_and_the_backend_sees_both") else {
        return;
    };
    let group = "0x00d1c0ffee";
    let backend = Backend::start(&env, "plumb", 2, &["--group-id", group]);
    // Vendor, device and class of every PCI function, one line each, before
    // any driver touches the device; then the driver's view of it.
    let job = format!(
        "cd /sys/bus/pci/devices && for d in *; do \
         echo \"pci $d $(cat $d/vendor) $(cat $d/device) $(cat $d/class) \
         override=$(cat $d/driver_override)\"; done; {}",
        guest("info")
    );
    let specs: Vec<VmSpec> = (0..2).map(|r| vm(&job, &backend.socket(r))).collect();
    let t = Instant::now();
    let mut vms = Vms::start(&env, &specs, &env.opts);
    let out = vms.wait_ok("2 VMs");
    progress(&format!("plumbing: 2 VMs in {:.1?}", t.elapsed()));
    for (i, o) in out.iter().enumerate() {
        let dev: Vec<&str> = o
            .output
            .lines()
            .filter(|l| l.starts_with("pci ") && l.contains(" 0x1af4 0x107f "))
            .collect();
        assert_eq!(
            dev.len(),
            1,
            "vm {i}: one virtio-dmlc function:\n{}",
            o.output
        );
        // Class "other" (0x00ff00), and no kernel driver may claim it.
        assert!(dev[0].contains(" 0x00ff00 "), "vm {i}: class: {}", dev[0]);
        assert!(dev[0].ends_with("override=none"), "vm {i}: {}", dev[0]);
        for want in [
            "transport     virtio-pci".to_owned(),
            format!("rank          {i}\n"),
            "world size    2\n".to_owned(),
            "group id      0x00000000d1c0ffee\n".to_owned(),
        ] {
            assert!(
                o.output.contains(&want),
                "vm {i}: no {want:?}:\n{}",
                o.output
            );
        }
    }
    for r in 0..2 {
        let line = format!(
            "rank {r}: frontend connected on {}",
            backend.socket(r).display()
        );
        assert!(
            backend.wait_log(&line, 1, Duration::from_secs(5)),
            "backend log lacks {line:?}:\n{}",
            backend.log_text()
        );
    }
}

/// QEMU's device model clears FEATURES_OK for the feature sets that spec
/// 5.X.8.1 says the device must refuse (qemu-patches 0006: no
/// VIRTIO_F_VERSION_1, a bit it never offered), keeps it for valid ones,
/// and the device opens normally afterwards.
#[test]
fn the_device_refuses_the_feature_sets_the_spec_forbids() {
    let test = "the_device_refuses_the_feature_sets_the_spec_forbids";
    let Some(env) = setup(test) else {
        return;
    };
    let backend = Backend::start(&env, "feat", 1, &[]);
    let job = format!("pci_probe --features-check && {}", guest("info"));
    let t = Instant::now();
    let mut vms = Vms::start(&env, &[vm(&job, &backend.socket(0))], &env.opts);
    let out = vms.wait_ok("1 VM");
    let text = &out[0].output;
    for want in [
        "features-check: without VIRTIO_F_VERSION_1",
        "features-check: with a bit never offered",
    ] {
        let line = text.lines().find(|l| l.starts_with(want));
        assert!(
            line.is_some_and(|l| l.ends_with(": refused (ok)")),
            "{want}: {line:?}:\n{text}"
        );
    }
    for want in [
        "features-check: VIRTIO_F_VERSION_1 alone",
        "features-check: everything offered",
    ] {
        let line = text.lines().find(|l| l.starts_with(want));
        assert!(
            line.is_some_and(|l| l.ends_with(": kept (ok)")),
            "{want}: {line:?}:\n{text}"
        );
    }
    assert!(text.contains("PCI-PROBE OK"), "{text}");
    assert!(
        text.contains("world size    1\n"),
        "info after the refusals:\n{text}"
    );
    progress(&format!("{test}: 1 VM in {:.1?}", t.elapsed()));
}
