//! Decode + validate any bytes under either content type, and build the failed record a worker
//! would write for what decodes: it must return, never panic.
//!
//!     cargo fuzz run decode_job -- -max_total_time=300
#![no_main]

use libfuzzer_sys::fuzz_target;
use shotfleet_schema::Limits;
use shotfleet_schema::encoding::{decode_job, parse_job};
use shotfleet_schema::failure::{FailureReason, RecordFacts, RecordHeaders};

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
    // What decodes, valid or not, is what a worker names in a failed record: every header value
    // built from it must be one async-nats accepts as it is (its `insert` panics on a CR or LF).
    if let Ok(job) = decode_job(content_type, payload) {
        let detail = job.validate(&limits).err().map(|e| e.to_string()).unwrap_or_default();
        let facts = RecordFacts {
            reason: FailureReason::Invalid,
            detail: &detail,
            original_subject: "shots.p1.xs.acme",
            attempts: 1,
            deliveries: 1,
            worker: "fuzz/cpu",
            job_id: Some(&job.job_id),
            content_type,
            stream_sequence: 1,
        };
        let headers = RecordHeaders::new(&facts);
        for (name, value) in &headers.pairs {
            assert!(value.parse::<async_nats::HeaderValue>().is_ok(), "{name}: {value:?}");
        }
        let mut map = async_nats::HeaderMap::new();
        for (name, value) in &headers.pairs {
            map.insert(*name, value.as_str());
        }
    }
});
