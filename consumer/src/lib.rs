//! The shotfleet worker.
pub mod budget;
pub mod pipeline;
pub mod store;
pub mod telemetry;
