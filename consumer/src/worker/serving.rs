//! Which classes this worker serves, once calibrated: logged, on `/readyz`, as the metric
//! `shotfleet_class_servable`, and as the worker's `classes` from then on (admission fetches
//! only those). A worker that can hold none of them stops with [`WorkerError::NothingFits`]
//! (exit 78: restarting will not help until its card, share or classes change).

use tracing::{info, warn};

use crate::budget::{ClassReport, Classes, Hold};
use crate::config::WorkerConfig;
use crate::telemetry::{self, Health};
use crate::worker::WorkerError;

/// `config` narrowed to the classes `report` says the card holds, with the report shown on
/// `health` and the metric.
///
/// # Errors
/// [`WorkerError::NothingFits`] when it holds none.
pub fn serve(config: WorkerConfig, report: &ClassReport, health: &Health) -> Result<WorkerConfig, WorkerError> {
    for hold in &report.holds {
        telemetry::class_servable(hold.class, matches!(hold.hold, Hold::Serves { .. }), hold.hold.reason());
        let (class, reason) = (hold.class.as_str(), hold.hold.reason());
        match hold.hold {
            Hold::Serves { .. } => info!(class, reason, detail = %hold, "class served"),
            Hold::NotConfigured => info!(class, reason, detail = %hold, "class not served"),
            Hold::OutOfMemory { .. } | Hold::OverBudget { .. } => warn!(class, reason, detail = %hold, "class not served"),
        }
    }
    health.set_detail(report.lines());
    let served = report.served();
    if served.is_empty() {
        // One line: the error goes to a log line and the supervisor's status.
        return Err(WorkerError::NothingFits(format!("`classes = {}`: {}", config.classes, report.lines().replace('\n', "; "))));
    }
    let classes = Classes::List(served);
    info!(configured = %config.classes, serving = %classes, "classes");
    Ok(WorkerConfig { classes, ..config })
}
