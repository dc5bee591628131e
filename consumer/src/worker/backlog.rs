//! The backlog of the render consumers this worker serves, as the metric
//! `shotfleet_backlog_jobs`: read from the server every [`EVERY`], not per job (the server
//! recomputes a consumer's pending count on every info request, NATS-NOTES.md).

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer;
use shotfleet_schema::subject::{self, Priority, SubjectClass};
use tracing::debug;

use crate::telemetry;
use crate::worker::Shared;

/// How often the backlog is read.
pub const EVERY: Duration = Duration::from_secs(15);

/// Exports the backlog until the worker stops fetching.
pub fn export(shared: Arc<Shared>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let classes: Vec<SubjectClass> =
            shared.config.classes.iter().copied().map(SubjectClass::Class).chain([SubjectClass::Auto]).collect();
        loop {
            if let Ok(stream) = shared.js.get_stream_no_info(subject::JOBS_STREAM).await {
                for &priority in Priority::ALL {
                    for class in &classes {
                        let (name, _) = subject::consumer(priority, *class);
                        match stream.get_consumer::<consumer::pull::Config>(&name).await {
                            Ok(mut consumer) => match consumer.info().await {
                                Ok(info) => telemetry::backlog(&name, info.num_pending, info.num_ack_pending as u64),
                                Err(e) => debug!(consumer = %name, error = %e, "cannot read the backlog"),
                            },
                            Err(e) => debug!(consumer = %name, error = %e, "cannot read the backlog"),
                        }
                    }
                }
            }
            tokio::select! {
                () = shared.stop.cancelled() => return,
                () = tokio::time::sleep(EVERY) => {}
            }
        }
    })
}
