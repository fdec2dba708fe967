//! `dmlc-guest info`: the device's configuration, decoded.

use dmlc_driver::device::Device;
use virtio_dmlc::comm::{CommOpcode, VIRTIO_DMLC_F_BLOCKS, VIRTIO_DMLC_F_COMM, VIRTIO_DMLC_F_P2P};
use virtio_dmlc::{Dtype, Opcode, ReduceOp, VIRTIO_DMLC_F_REQ_TIMEOUT, VIRTIO_RING_F_EVENT_IDX};

use super::util::{mask_names, show_size};
use super::Setup;

pub fn run(dev: &Device, setup: &Setup) {
    let c = dev.config();
    let feature = |bit: u32| (dev.features() >> bit) & 1 == 1;
    let mut features = Vec::new();
    for (bit, name) in [
        (VIRTIO_DMLC_F_REQ_TIMEOUT, "REQ_TIMEOUT"),
        (VIRTIO_DMLC_F_COMM, "COMM"),
        (VIRTIO_DMLC_F_P2P, "P2P"),
        (VIRTIO_DMLC_F_BLOCKS, "BLOCKS"),
        (VIRTIO_RING_F_EVENT_IDX, "EVENT_IDX"),
    ] {
        if feature(bit) {
            features.push(name);
        }
    }
    println!("transport     {}", setup.transport);
    println!("mode          {}", setup.mode);
    println!("rank          {}", c.rank.get());
    println!("world size    {}", c.world_size.get());
    if dev.is_kernel() {
        println!(
            "queues        {} (using {}, the kernel driver's rings)",
            c.num_queues.get(),
            dev.num_queues()
        );
    } else {
        println!(
            "queues        {} (using {}, {} descriptors each)",
            c.num_queues.get(),
            dev.num_queues(),
            dev.queue_size()
        );
    }
    println!("max segments  {}", c.max_segments.get());
    println!(
        "max bytes     {} ({})",
        c.max_bytes.get(),
        show_size(c.max_bytes.get())
    );
    println!(
        "dtypes        {}",
        mask_names(c.dtypes.get(), Dtype::ALL, |d| u32::from(d.raw()))
    );
    println!(
        "ops           {}",
        mask_names(c.ops.get(), ReduceOp::ALL, |o| u32::from(o.raw()))
    );
    let opcodes = c.opcodes.get();
    let base = opcodes & Opcode::all_mask();
    let mut names = mask_names(base, Opcode::ALL, |o| u32::from(o.raw()));
    if opcodes != base {
        // Those of feature bits 1 to 3 (spec 5.X.6.13), and any unknown.
        let more = mask_names(opcodes & !base, CommOpcode::ALL, |o| u32::from(o.raw()));
        names = format!("{names} {more}");
    }
    println!("opcodes       {names}");
    println!("generation    {}", c.generation.get());
    println!("group id      {:#018x}", c.group_id.get());
    println!(
        "features      {}",
        if features.is_empty() {
            "(none)".to_string()
        } else {
            features.join(" ")
        }
    );
}
