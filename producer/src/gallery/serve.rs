//! `gallery --serve`: the sheet on localhost, rebuilt whenever an outcome of the project
//! arrives; open pages reload themselves (server-sent events).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer;
use axum::Router;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse};
use axum::routing::get;
use futures::StreamExt;
use shotfleet_schema::subject;
use tokio::sync::watch;

use super::{Gallery, page};
use crate::wait;

/// Outcomes that arrive this close together make one rebuild.
const SETTLE: Duration = Duration::from_millis(300);

/// A served gallery: where it listens.
pub struct Served {
    pub addr: SocketAddr,
    pub done: tokio::task::JoinHandle<Result<(), String>>,
}

/// Serves `gallery` on `addr` (loopback) until `shutdown`, rebuilding it as outcomes arrive.
///
/// # Errors
/// The first build, following the results, or binding the address failed.
pub async fn serve(mut gallery: Gallery, addr: SocketAddr, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<Served, String> {
    let filter = format!("{}.done.{}.*", subject::ROOT, gallery.project());
    let mut arrivals = wait::follow(gallery.js(), subject::RESULTS_STREAM, filter, consumer::DeliverPolicy::New).await.map_err(|e| e.to_string())?;
    let cards = gallery.cards().await?;
    let first = page::render(gallery.project(), &cards, true);
    let (pages, current) = watch::channel(Arc::new(first));
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let rebuild = tokio::spawn(async move {
        while arrivals.next().await.is_some() {
            tokio::time::sleep(SETTLE).await;
            match gallery.cards().await {
                Ok(cards) => {
                    pages.send_replace(Arc::new(page::render(gallery.project(), &cards, true)));
                }
                Err(e) => tracing::warn!(error = %e, "cannot rebuild the gallery"),
            }
        }
    });
    let app = Router::new().route("/", get(index)).route("/events", get(events)).with_state(current);
    let done = tokio::spawn(async move {
        let served = axum::serve(listener, app).with_graceful_shutdown(shutdown).await.map_err(|e| e.to_string());
        rebuild.abort();
        served
    });
    Ok(Served { addr, done })
}

async fn index(State(page): State<watch::Receiver<Arc<String>>>) -> impl IntoResponse {
    Html(page.borrow().to_string())
}

/// One event per rebuilt page after the client connected.
async fn events(State(mut page): State<watch::Receiver<Arc<String>>>) -> impl IntoResponse {
    page.mark_unchanged();
    let changes = futures::stream::unfold(page, |mut page| async move {
        page.changed().await.ok()?;
        Some((Ok::<_, std::convert::Infallible>(Event::default().data("refresh")), page))
    });
    Sse::new(changes).keep_alive(KeepAlive::default())
}
