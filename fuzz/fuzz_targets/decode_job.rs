//! Decode + validate any bytes under either content type: it must return, never panic.
//!
//!     cargo fuzz run decode_job -- -max_total_time=300
#![no_main]

use libfuzzer_sys::fuzz_target;
use shotfleet_schema::encoding::parse_job;
use shotfleet_schema::Limits;

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    // The first byte picks the header, so the fuzzer explores both decoders and the default.
    let (content_type, payload) = match data.split_first() {
        Some((0, rest)) => (Some("application/msgpack"), rest),
        Some((1, rest)) => (Some("application/json"), rest),
        Some((_, rest)) => (None, rest),
        None => (None, data),
    };
    if let Ok(job) = parse_job(content_type, payload, &limits) {
        // What validates must round-trip and stay valid.
        for ct in [shotfleet_schema::ContentType::Json, shotfleet_schema::ContentType::MessagePack] {
            let bytes = shotfleet_schema::encoding::encode(ct, &job);
            let again = parse_job(Some(ct.as_str()), &bytes, &limits).expect("a valid job re-decodes");
            assert_eq!(again.job_id, job.job_id);
        }
    }
});
