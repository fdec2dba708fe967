//! Non-finite origin (spec 5.X.6.14, feature bit 4) through the driver over
//! the host transport, against the real daemon: the check negotiated and
//! turned on per device, `Error::NonFinite` naming the lowest rank and
//! element, counted in the caller's whole buffer when the slice forms cut
//! it into several requests, with the outputs written all the same.

use std::thread;

use dmlc_driver::bounce::Bounce;
use dmlc_driver::{Device, Dtype, Error, OpenOptions, ReduceOp};
use dmlc_test_support::Backend;
use virtio_dmlc::VIRTIO_DMLC_F_NONFINITE;

/// Runs `f(device)` on every rank at once, each on its own thread.
fn on_every_rank(n: u32, tag: &str, f: impl Fn(&Device) + Sync) {
    let backend = Backend::start(tag, n, &["--timeout-ms", "20000"]);
    thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (backend, f) = (&backend, &f);
                s.spawn(move || {
                    let dev = dmlc_driver::host::open(&backend.socket(r), &OpenOptions::default())
                        .unwrap_or_else(|e| panic!("cannot open rank {r}: {e}"));
                    f(&dev)
                })
            })
            .collect();
        for h in handles {
            h.join().expect("a rank failed");
        }
    });
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// 3 ranks, 1000 f32 cut into requests of 64 elements: a NaN of rank 2 in
/// the first request, an infinity of rank 1 in the ninth and a NaN of rank
/// 1 in the last: rank 1's lowest, element 520, wins; every rank sees it,
/// and every output is the whole sum (NaN where a NaN was). Off, the same
/// data reduces without an error; in place, the same error.
#[test]
fn the_check_names_rank_and_element_in_the_whole_buffer() {
    on_every_rank(3, "nonfinite", |dev| {
        assert_ne!(dev.features() & (1 << VIRTIO_DMLC_F_NONFINITE), 0);
        let r = dev.rank();
        let mut input: Vec<f32> = (0..1000).map(|i| (i % 5) as f32).collect();
        match r {
            2 => input[3] = f32::NAN,
            1 => {
                input[520] = f32::INFINITY;
                input[999] = f32::NAN;
            }
            _ => {}
        }
        let input = f32s(&input);
        let mut b = Bounce::new(dev);
        b.set_chunk_bytes(256);
        let mut out = vec![0u8; input.len()];
        b.allreduce(dev, Dtype::F32, ReduceOp::Sum, &input, &mut out)
            .expect("the check is off by default");
        dev.set_check_finite(true).unwrap();
        let mut checked = vec![0u8; input.len()];
        match b.allreduce(dev, Dtype::F32, ReduceOp::Sum, &input, &mut checked) {
            Err(Error::NonFinite { rank, index }) => assert_eq!((rank, index), (1, 520)),
            other => panic!("rank {r}: {other:?}"),
        }
        // The whole output was written, as without the check.
        assert_eq!(checked, out);
        let mut data = input.clone();
        let e = b
            .allreduce_in_place(dev, Dtype::F32, ReduceOp::Max, &mut data)
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::NonFinite {
                    rank: 1,
                    index: 520
                }
            ),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "non-finite input: rank 1's input holds a NaN or an infinity at element 520"
        );
        // Integers are not checked; the check goes off again.
        let mut ints = vec![0xffu8; 64];
        b.allreduce_in_place(dev, Dtype::U32, ReduceOp::Sum, &mut ints)
            .unwrap();
        dev.set_check_finite(false).unwrap();
        b.allreduce_in_place(dev, Dtype::F32, ReduceOp::Sum, &mut data)
            .unwrap();
    });
}
