//! The box's HTTP port (`[supervisor] listen`, 127.0.0.1:9399 by default).
//!
//! | path | answer |
//! | --- | --- |
//! | `/healthz` | 200 while the supervisor runs (liveness: a card down is not a reason to restart the box's other workers) |
//! | `/readyz` | 200 while at least one GPU's worker takes jobs, else 503; then one line per GPU: its worker's readiness, or its restart (in how long, after which exit, and the worker's last log line), or why it stays stopped; each worker's class lines indented under it |
//! | `/status` | the same as JSON, one object per GPU (`status.rs`, [`GpuStatus`](super::status::GpuStatus)) |
//! | `/metrics` | the box's metrics (`status.rs`); each worker serves its own on its own port |

use std::net::SocketAddr;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::BoxError;
use super::status::BoxStatus;

#[derive(Clone)]
struct AppState {
    status: BoxStatus,
    metrics: PrometheusHandle,
}

/// Binds `addr` and serves until `stop`; returns the bound address and the server's task.
///
/// # Errors
/// [`BoxError::Start`] when the address cannot be bound.
pub async fn serve(
    addr: SocketAddr,
    status: BoxStatus,
    metrics: PrometheusHandle,
    stop: CancellationToken,
) -> Result<(SocketAddr, JoinHandle<()>), BoxError> {
    let listener = TcpListener::bind(addr).await.map_err(|e| BoxError::start(&format!("listen on {addr} (supervisor.listen)"), e))?;
    let bound = listener.local_addr().map_err(|e| BoxError::start("read the box's address", e))?;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/status", get(status_json))
        .route("/metrics", get(render_metrics))
        .with_state(AppState { status, metrics });
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned()).await {
            tracing::warn!(error = %e, "the box's health port failed");
        }
    });
    Ok((bound, task))
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(state): State<AppState>) -> (StatusCode, String) {
    let (ready, text) = state.status.readyz();
    (if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, text)
}

async fn status_json(State(state): State<AppState>) -> impl IntoResponse {
    let json = serde_json::to_string(&state.status.snapshot()).expect("plain fields serialize");
    ([(header::CONTENT_TYPE, "application/json")], json)
}

async fn render_metrics(State(state): State<AppState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], state.metrics.render())
}
