//! The shotfleet wire contract, version 1.
//!
//! Everything a producer (in any language) and a worker must agree on lives here, and nothing
//! else: this crate depends on no other shotfleet crate and knows nothing of NATS clients.
//!
//! - [`job`]: [`ShotJob`], what a producer publishes.
//! - [`result`]: [`ShotResult`], what a worker publishes when a job is rendered.
//! - [`encoding`]: MessagePack or JSON, chosen by the `Content-Type` header.
//! - [`validate`]: bounds a job must respect, with messages a person can act on.
//! - [`class`]: the memory class of a job, computed from one image's size.
//! - [`subject`]: subject names, stream and consumer names.
//! - [`failure`]: the headers and reasons of a failed record.
//! - [`progress`]: progress events of jobs in a worker's hands, and a worker's state.
//! - [`cancel`]: cancel requests and their replies.
//! - [`names`]: wire enums' names, lists and parse messages.
//! - `wire`: how a job's numbers and `null`s are read from what other languages send.
//! - [`json_schema`]: the JSON Schema other languages can validate against.
//! - [`store`]: a `file://` store's folder, as the workers and the CLI open it.
//! - `nats` (feature `nats`): connecting, and creating the streams and consumers both sides use.
//! - `lora` (feature `lora`): LoRA files (formats, checks) and the LoRA library's layout, which
//!   `shotfleet lora push` and the workers share.

pub mod cancel;
pub mod class;
pub mod encoding;
pub mod failure;
pub mod job;
pub mod progress;
pub mod json_schema;
pub mod names;
#[cfg(feature = "lora")]
pub mod lora;
#[cfg(feature = "nats")]
pub mod nats;
pub mod result;
pub mod store;
pub mod subject;
mod shallow;
pub mod validate;
mod wire;

pub use class::MemoryClass;
pub use encoding::{ContentType, DecodeError, InvalidJob};
pub use failure::FailureReason;
pub use cancel::{CancelReply, CancelRequest, CancelResult, CancelledJob};
pub use job::{Degrade, Floor, JobIds, Lora, Original, ShotJob};
pub use progress::{GpuMemory, ProgressEvent, ShotProgress, WorkerState};
pub use result::{Failure, ImageRef, ResultStatus, ShotResult, Timing};
pub use subject::{Priority, SubjectClass};
pub use validate::{Limits, ValidationError};

/// The contract version this crate speaks. Payloads with another `v` are rejected.
pub const VERSION: u32 = 1;
