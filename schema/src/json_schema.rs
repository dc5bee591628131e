//! JSON Schema documents for producers in other languages, generated from the Rust types.
//!
//! The checked-in copies live in `schema/json/`; a test fails when they drift from the types.
//! Regenerate them with `SHOTFLEET_BLESS=1 cargo test -p shotfleet-schema json_schema`.

use crate::cancel::{CancelReply, CancelRequest};
use crate::job::ShotJob;
use crate::progress::{ShotProgress, WorkerState};
use crate::result::ShotResult;

/// `(file name, pretty JSON)` for every schema document.
pub fn documents() -> Vec<(&'static str, String)> {
    let render = |schema: schemars::Schema| {
        let mut text = serde_json::to_string_pretty(&schema).expect("schemas serialize");
        text.push('\n');
        text
    };
    vec![
        ("shot-job.schema.json", render(schemars::schema_for!(ShotJob))),
        ("shot-result.schema.json", render(schemars::schema_for!(ShotResult))),
        ("shot-progress.schema.json", render(schemars::schema_for!(ShotProgress))),
        ("worker-state.schema.json", render(schemars::schema_for!(WorkerState))),
        ("cancel-request.schema.json", render(schemars::schema_for!(CancelRequest))),
        ("cancel-reply.schema.json", render(schemars::schema_for!(CancelReply))),
    ]
}
