//! The producer side of shotfleet: what the `shotfleet` command does, as a library.
//!
//! - [`storyboard`]: reading a storyboard file (JSON Lines or CSV) into validated jobs.
//! - [`submit`]: publishing jobs with their `Nats-Msg-Id`, PubAcks pipelined and bounded.
//! - [`grouping`]: storyboard order for LoRA sets (one switch per character, not per shot).
//! - [`wait`]: following results and failed records until every submitted job has one.
//! - [`status`]: what is pending, in progress and failed, per priority and class.
//! - [`replay`]: failed records back to their original subjects, deleted only after the PubAck.
//! - [`lora`]: the LoRA library: checked uploads (`shotfleet lora push`) and listing.
//! - [`live`]: what `submit --wait` shows: a bar per shot in a worker's hands, queue positions.
//! - [`cancel`]: asking the fleet to cancel jobs.
//! - [`fleet`]: the workers (pings, progress events) and the classes no live worker serves.
//! - [`watch`]: `status --watch`.
//! - [`gallery`]: a project's contact sheet as one HTML page, written or served.
//!
//! The wire contract and the topology come from `shotfleet-schema`; this crate knows nothing of
//! the workers.

pub mod grouping;
pub mod lora;
pub mod cancel;
pub mod fleet;
pub mod gallery;
pub mod live;
pub mod replay;
pub mod status;
pub mod storyboard;
pub mod submit;
pub mod wait;
pub mod watch;

pub use storyboard::{LineError, Shot, Storyboard};
pub use submit::{SubmitOptions, SubmitSummary};
