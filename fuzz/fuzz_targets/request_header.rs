//! Fuzz target: the request header and limits through the backend's checks.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(
    init: {
        let (seeds, want) = dmlc_fuzz::request_header::seeds();
        dmlc_fuzz::init(&seeds, dmlc_fuzz::request_header::run, &want);
    },
    |data: &[u8]| {
        dmlc_fuzz::request_header::run(data);
    }
);
