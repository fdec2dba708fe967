//! Two (or more) host processes allreduce through the daemon.
//!
//! ```text
//! vhost-device-dmlc --socket-path /tmp/dmlc.sock --socket-count 2 &
//! cargo run -p dmlc-driver --example allreduce -- /tmp/dmlc.sock0 &
//! cargo run -p dmlc-driver --example allreduce -- /tmp/dmlc.sock1
//! ```
//!
//! Arguments: SOCKET [COUNT [ITERATIONS [poll|irq]]]. Each rank checks the
//! result of every iteration and prints the mean latency.

use std::time::Instant;

use dmlc_driver::{Dtype, OpenOptions, ReduceOp};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let socket = args
        .first()
        .ok_or("usage: allreduce SOCKET [COUNT [ITERS [poll|irq]]]")?;
    let count: usize = args.get(1).map_or(Ok(1024), |s| s.parse())?;
    let iters: u32 = args.get(2).map_or(Ok(1000), |s| s.parse())?;
    let poll = args.get(3).is_none_or(|m| m != "irq");
    let opts = OpenOptions {
        poll,
        spin_cap: std::time::Duration::ZERO,
        ..Default::default()
    };
    let dev = dmlc_driver::host::open(socket.as_ref(), &opts)?;
    let (rank, world) = (dev.rank(), dev.world_size());
    println!(
        "rank {rank} of {world}, {} queues, generation {}, poll={poll}",
        dev.num_queues(),
        dev.config().generation.get()
    );
    let mut input = dev.alloc(count * 4)?;
    let output = dev.alloc(count * 4)?;
    let world_sum: u32 = (0..world).sum();
    let start = Instant::now();
    for it in 0..iters {
        // Element i of rank r is r + i + it, so the sum is known.
        for (i, x) in input.as_elems_mut::<u32>().iter_mut().enumerate() {
            *x = rank + i as u32 + it;
        }
        dev.allreduce(Dtype::U32, ReduceOp::Sum, &input, &output, count as u64)?;
        for (i, &x) in output.as_elems::<u32>().iter().enumerate() {
            let want = world_sum + world * (i as u32 + it);
            if x != want {
                return Err(format!("iteration {it}: element {i} is {x}, want {want}").into());
            }
        }
    }
    let per = start.elapsed() / iters.max(1);
    println!("rank {rank}: {iters} allreduces of {count} u32 correct, {per:?} each");
    dev.barrier()?;
    let mut v = vec![rank as f32 + 0.5; 5];
    dev.allreduce_slice(ReduceOp::Max, &mut v)?;
    println!("rank {rank}: max over ranks = {}", v[0]);
    Ok(())
}
