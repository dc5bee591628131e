//! The metrics and health port, over real HTTP on a free port.
//!
//! The tests of this binary share one process-wide recorder (as `install` is idempotent), so each
//! records under label values of its own.

use std::net::SocketAddr;
use std::time::Duration;

use shotfleet_consumer::telemetry::{self, Health, JobOutcome, TelemetryError, TelemetryServer};
use shotfleet_schema::{MemoryClass, Priority, SubjectClass};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// Starts the server on port 0; it stops when the returned sender is sent to or dropped.
async fn start(health: Health) -> (TelemetryServer, oneshot::Sender<()>) {
    let handle = telemetry::install().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = telemetry::serve(SocketAddr::from(([127, 0, 0, 1], 0)), handle, health, async {
        let _ = stopped.await;
    })
    .await
    .unwrap();
    assert_ne!(server.local_addr().port(), 0);
    (server, stop)
}

/// `GET path`: the status code and the body.
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_owned())
}

#[tokio::test]
async fn telemetry_metrics_show_what_the_helpers_recorded() {
    let (server, _stop) = start(Health::new()).await;
    let m = SubjectClass::Class(MemoryClass::M);
    telemetry::job_finished(JobOutcome::Done, Priority::P0, m);
    telemetry::job_finished(JobOutcome::Done, Priority::P0, m);
    telemetry::job_finished(JobOutcome::DuplicateSkip, Priority::P2, SubjectClass::Auto);
    telemetry::queue_wait(Priority::P1, Duration::from_millis(700));
    telemetry::render_time(m, Duration::from_millis(1500));
    telemetry::upload_time(Duration::from_millis(40));
    telemetry::budget(6 << 30, 2 << 30);
    telemetry::gpu_memory(10 << 30, 24 << 30);
    telemetry::gpu_utilization(1.7);
    telemetry::estimate_error(1000, 1100, true);
    let job = telemetry::in_flight();

    let (status, body) = get(server.local_addr(), "/metrics").await;
    assert_eq!(status, 200);
    for line in [
        r#"shotfleet_jobs_total{outcome="done",priority="p0",class="m"} 2"#,
        r#"shotfleet_jobs_total{outcome="duplicate_skip",priority="p2",class="auto"} 1"#,
        r#"shotfleet_queue_wait_seconds_bucket{priority="p1",le="1"} 1"#,
        r#"shotfleet_queue_wait_seconds_bucket{priority="p1",le="0.5"} 0"#,
        r#"shotfleet_render_seconds_bucket{class="m",le="2"} 1"#,
        r#"shotfleet_upload_seconds_bucket{le="0.05"} 1"#,
        "shotfleet_budget_free_bytes 6442450944",
        "shotfleet_budget_used_bytes 2147483648",
        "shotfleet_gpu_memory_used_bytes 10737418240",
        "shotfleet_gpu_memory_total_bytes 25769803776",
        "shotfleet_gpu_utilization_ratio 1",
        r#"shotfleet_estimate_error_ratio_bucket{start="cold",le="0.1"} 1"#,
        r#"shotfleet_estimate_error_ratio_bucket{start="cold",le="0.05"} 0"#,
        "shotfleet_in_flight_jobs 1",
        "# HELP shotfleet_jobs_total Jobs that left this worker",
        "# TYPE shotfleet_render_seconds histogram",
    ] {
        assert!(body.lines().any(|l| l.starts_with(line)), "missing {line:?} in\n{body}");
    }

    drop(job);
    let (_, body) = get(server.local_addr(), "/metrics").await;
    assert!(body.lines().any(|l| l == "shotfleet_in_flight_jobs 0"), "{body}");
}

#[tokio::test]
async fn telemetry_readyz_follows_health() {
    let health = Health::new();
    let (server, _stop) = start(health.clone()).await;
    let addr = server.local_addr();
    assert_eq!(get(addr, "/readyz").await, (503, "not ready: starting\n".into()));
    health.set_ready();
    assert_eq!(get(addr, "/readyz").await, (200, "ready\n".into()));
    health.set_not_ready("rebuilding sessions after a driver fault");
    assert_eq!(get(addr, "/readyz").await, (503, "not ready: rebuilding sessions after a driver fault\n".into()));
    // The classes' lines follow the first, ready or not.
    health.set_detail("xs: served\nm: not served (over budget)");
    assert_eq!(get(addr, "/readyz").await.1, "not ready: rebuilding sessions after a driver fault\nxs: served\nm: not served (over budget)\n");
    health.set_ready();
    assert_eq!(get(addr, "/readyz").await, (200, "ready\nxs: served\nm: not served (over budget)\n".into()));
    health.set_draining();
    assert!(get(addr, "/readyz").await.1.starts_with("draining: shutting down\n"));
}

#[tokio::test]
async fn telemetry_healthz_answers_whatever_the_readiness() {
    let health = Health::new();
    let (server, _stop) = start(health.clone()).await;
    assert_eq!(get(server.local_addr(), "/healthz").await, (200, "ok\n".into()));
    health.set_draining();
    assert_eq!(get(server.local_addr(), "/healthz").await, (200, "ok\n".into()));
    assert_eq!(get(server.local_addr(), "/nothing").await.0, 404);
}

#[tokio::test]
async fn telemetry_install_is_idempotent() {
    let first = telemetry::install().unwrap();
    let second = telemetry::install().unwrap();
    telemetry::job_finished(JobOutcome::Routed, Priority::P1, SubjectClass::Auto);
    let line = r#"shotfleet_jobs_total{outcome="routed",priority="p1",class="auto"} 1"#;
    assert!(first.render().contains(line));
    assert!(second.render().contains(line));
}

#[tokio::test]
async fn telemetry_server_stops_on_shutdown() {
    let (server, stop) = start(Health::new()).await;
    let addr = server.local_addr();
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), server.stopped()).await.unwrap().unwrap();
    assert!(TcpStream::connect(addr).await.is_err(), "still listening after shutdown");
}

#[tokio::test]
async fn telemetry_names_an_address_it_cannot_bind() {
    let (server, _stop) = start(Health::new()).await;
    let taken = server.local_addr();
    let err = telemetry::serve(taken, telemetry::install().unwrap(), Health::new(), std::future::pending())
        .await
        .unwrap_err();
    assert!(matches!(err, TelemetryError::Bind { addr, .. } if addr == taken), "{err:?}");
    assert!(err.to_string().contains(&taken.to_string()), "{err}");
}
