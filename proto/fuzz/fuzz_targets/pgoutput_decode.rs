//! Fuzzes the pgoutput decoder. Input: a context selector byte, then one
//! message (the format of `corpus-seed/`). The properties checked live in
//! `mm_proto::pgoutput::oracle` so `cargo test` runs the same checks on the
//! seed corpus: no panic under any of the 16 contexts, and whatever decodes
//! re-encodes to the identical bytes and decodes to the same message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mm_proto::pgoutput::oracle;

fuzz_target!(|data: &[u8]| {
    if let Err(violation) = oracle::check(data) {
        panic!("{violation}");
    }
});
