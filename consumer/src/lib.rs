//! The shotfleet worker: one process per GPU that takes only the work its memory can hold, in
//! priority order, renders it, stores it, reports it and only then acks.
//!
//! - [`config`]: the TOML file, environment and flags, validated at start.
//! - [`worker`]: the loop (admit, fetch, render, upload, publish, ack) and shutdown.
//! - [`pipeline`]: SDXL on ONNX Runtime; knows nothing of NATS or storage.
//! - [`budget`]: GPU memory: what fits now, calibrated and learned; knows nothing of NATS.
//! - [`store`]: object storage with content-addressed keys.
//! - [`library`]: the LoRA library: LoRA files by name from object storage, cached on disk.
//! - [`telemetry`]: Prometheus metrics, `/healthz` and `/readyz`.
//! - [`faults`]: explicit fault injection for tests.
//! - [`supervisor`]: `--gpus`: one worker process per GPU of a box, restarted and reported on.

pub mod budget;
pub mod config;
pub mod failure;
pub mod faults;
pub mod library;
pub mod pipeline;
pub mod store;
pub mod supervisor;
pub mod telemetry;
pub mod worker;

pub use config::WorkerConfig;
pub use worker::run;
