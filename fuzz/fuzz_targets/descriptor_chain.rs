//! Fuzz target: descriptor chains (direct, indirect, broken) over guest
//! memory of one or two regions through the backend's chain parser.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(
    init: {
        let (seeds, want) = dmlc_fuzz::descriptor_chain::seeds();
        dmlc_fuzz::init(&seeds, dmlc_fuzz::descriptor_chain::run, &want);
    },
    |data: &[u8]| {
        dmlc_fuzz::descriptor_chain::run(data);
    }
);
