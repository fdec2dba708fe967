//! Fuzz target: requests with feature bit 1 (communicators, send and
//! receive, block collectives) through the backend's checks.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(
    init: {
        let (seeds, want) = dmlc_fuzz::comm_header::seeds();
        dmlc_fuzz::init(&seeds, dmlc_fuzz::comm_header::run, &want);
    },
    |data: &[u8]| {
        dmlc_fuzz::comm_header::run(data);
    }
);
