//! The HTTP port: `/metrics`, `/healthz`, `/readyz`.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tracing::info;

use super::{Health, TelemetryError};

/// How often histograms are drained into their buckets when nobody scrapes (the recorder
/// otherwise keeps every sample until the next render).
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// The running server: its bound address, and its task, which ends after `shutdown` resolves.
#[derive(Debug)]
pub struct TelemetryServer {
    addr: SocketAddr,
    task: JoinHandle<Result<(), TelemetryError>>,
}

impl TelemetryServer {
    /// The bound address (the actual port when port 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits for the server to stop (after the shutdown future resolved and open requests ended).
    ///
    /// # Errors
    ///
    /// [`TelemetryError::Serve`] when accepting connections failed.
    pub async fn stopped(self) -> Result<(), TelemetryError> {
        self.task.await.map_err(|e| TelemetryError::Serve(std::io::Error::other(e)))?
    }
}

#[derive(Clone)]
struct AppState {
    metrics: PrometheusHandle,
    health: Health,
}

/// Binds `addr` and serves metrics and health on it until `shutdown` resolves. Port 0 picks a
/// free port: see [`TelemetryServer::local_addr`].
///
/// Pass a `shutdown` that resolves after the worker has drained, not at SIGTERM: while in-flight
/// jobs finish, `/readyz` should say `draining` and the last metrics should still be scraped.
///
/// # Errors
///
/// [`TelemetryError::Bind`] when the address cannot be bound (in use, not local).
pub async fn serve(
    addr: SocketAddr,
    metrics: PrometheusHandle,
    health: Health,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<TelemetryServer, TelemetryError> {
    let listener = TcpListener::bind(addr).await.map_err(|source| TelemetryError::Bind { addr, source })?;
    let addr = listener.local_addr().map_err(|source| TelemetryError::Bind { addr, source })?;
    let upkeep = tokio::spawn({
        let metrics = metrics.clone();
        async move {
            let mut every = tokio::time::interval(UPKEEP_EVERY);
            loop {
                every.tick().await;
                metrics.run_upkeep();
            }
        }
    });
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState { metrics, health });
    info!(%addr, "serving metrics and health");
    let task = tokio::spawn(async move {
        let served = axum::serve(listener, app).with_graceful_shutdown(shutdown).await;
        upkeep.abort();
        served.map_err(TelemetryError::Serve)
    });
    Ok(TelemetryServer { addr, task })
}

async fn render_metrics(State(state): State<AppState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], state.metrics.render())
}

/// Liveness: answering at all means the process and its runtime are alive.
async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(state): State<AppState>) -> (StatusCode, String) {
    let (status, first) = match state.health.readiness() {
        Ok(()) => (StatusCode::OK, "ready".to_owned()),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason),
    };
    let detail = state.health.detail();
    if detail.is_empty() { (status, format!("{first}\n")) } else { (status, format!("{first}\n{detail}\n")) }
}
