//! `shotfleet gallery` in a real browser: the written page loads in headless Chromium (the
//! Debian package `scripts/setup.sh` installs), every thumbnail decodes, the degraded shot and
//! the failed one are marked, the cancelled one greyed; `--serve` shows a result that arrives
//! after it started.

#[path = "seeing.rs"]
mod seeing;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use seeing::{OneWorker, shotfleet, shotfleet_with, text};
use shotfleet_schema::{Degrade, Lora, Original, Priority, ShotJob};
use shotfleet_testkit::S3Server;
use shotfleet_testkit::ports::free_port;
use shotfleet_testkit::process::{Guarded, http_get};
use shotfleet_tests::{Worker, WorkerSpec, binary, job, jetstream_with, outcomes, shot, submit};

/// The distribution's Chromium, if installed.
fn chromium() -> Option<PathBuf> {
    ["chromium", "chromium-browser"]
        .into_iter()
        .flat_map(|name| std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()).map(move |dir| dir.join(name)).collect::<Vec<_>>())
        .find(|path| path.is_file())
}

/// Loads `page` in headless Chromium inside a harness that reports, once everything loaded,
/// how many images there are, how many decoded, and the marks of each card.
fn inspect(page: &Path, browser: &Path) -> serde_json::Value {
    let harness = page.with_file_name("harness.html");
    std::fs::write(
        &harness,
        r#"<!doctype html><html><body><pre id="verdict">pending</pre>
<iframe id="sheet" src="index.html" style="width:1200px;height:900px"></iframe>
<script>
document.getElementById('sheet').addEventListener('load', () => {
  const doc = document.getElementById('sheet').contentDocument;
  const images = [...doc.images];
  const cards = [...doc.querySelectorAll('article.card')].map(card => ({
    job: card.dataset.job, status: card.dataset.status,
    mark: (card.querySelector('.mark') || {}).textContent || null,
    opacity: getComputedStyle(card).opacity,
  }));
  document.getElementById('verdict').textContent = JSON.stringify({
    title: doc.title, images: images.length,
    decoded: images.filter(i => i.complete && i.naturalWidth > 0).length, cards });
});
</script></body></html>"#,
    )
    .unwrap();
    let out = std::process::Command::new(browser)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files", "--virtual-time-budget=10000", "--dump-dom"])
        .arg(format!("file://{}", harness.display()))
        .output()
        .expect("run chromium");
    let dom = String::from_utf8_lossy(&out.stdout);
    let verdict = dom
        .split("<pre id=\"verdict\">")
        .nth(1)
        .and_then(|rest| rest.split("</pre>").next())
        .unwrap_or_else(|| panic!("no verdict in the DOM:\n{dom}\n{}", String::from_utf8_lossy(&out.stderr)));
    let verdict = verdict.replace("&quot;", "\"").replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">");
    serde_json::from_str(&verdict).unwrap_or_else(|e| panic!("{e}: {verdict}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn the_contact_sheet_loads_in_a_browser_with_every_image_and_mark() {
    let Some(browser) = chromium() else {
        eprintln!("SKIPPED: no chromium on this machine (scripts/setup.sh installs Debian's `chromium` where apt-get runs as root)");
        return;
    };
    let fleet = OneWorker::start().await;
    let (js, store) = (&fleet.js, &fleet.store);

    let mut degraded = job("gy-s03", "gy", (64, 64), 2, 1);
    degraded.degrade = Some(Degrade { level: 1, from: Original { width: 128, height: 128, steps: 2 } });
    let mut failed = job("gy-s04", "gy", (64, 64), 2, 1);
    failed.loras = vec![Lora { name: "ink-wash".into(), weight: 0.8 }];
    let stuck = job("gy-s05", "gy", (1600, 1600), 1, 1);
    let shots = vec![
        shot(Priority::P1, job("gy-s01", "gy", (64, 64), 2, 2)),
        shot(Priority::P1, job("gy-s02", "gy", (128, 96), 2, 1)),
        shot(Priority::P1, degraded),
        shot(Priority::P1, failed),
        shot(Priority::P1, stuck),
    ];
    submit(js, &shots).await;
    let out = shotfleet(&fleet.url(), &["cancel", "--project", "gy", "gy-s05"]).await;
    assert!(out.status.success(), "{}", text(&out));
    outcomes(js, &shots, Duration::from_secs(60)).await;

    let out_dir = tempfile::tempdir().unwrap();
    let store_url = format!("file://{}", store.path().display());
    let out = shotfleet(&fleet.url(), &["gallery", "--project", "gy", "--store", &store_url, "--out", out_dir.path().to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", text(&out));
    let page = out_dir.path().join("index.html");
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(!html.contains("src=\"http") && !html.contains("src=\"file"), "the page is self-contained");

    let verdict = inspect(&page, &browser);
    assert_eq!(verdict["title"], "gy · shotfleet", "{verdict}");
    assert_eq!(verdict["images"], 4, "2 + 1 + 1 images: {verdict}");
    assert_eq!(verdict["decoded"], verdict["images"], "every image decodes: {verdict}");
    let cards = verdict["cards"].as_array().unwrap();
    let jobs: Vec<&str> = cards.iter().map(|c| c["job"].as_str().unwrap()).collect();
    assert_eq!(jobs, ["gy-s01", "gy-s02", "gy-s03", "gy-s04", "gy-s05"], "storyboard order");
    let card = |job: &str| cards.iter().find(|c| c["job"] == job).unwrap();
    assert_eq!(card("gy-s03")["status"], "degraded");
    assert!(card("gy-s03")["mark"].as_str().unwrap().contains("degraded"), "{verdict}");
    assert!(card("gy-s04")["mark"].as_str().unwrap().contains("failed (invalid)"), "{verdict}");
    assert!(card("gy-s05")["mark"].as_str().unwrap().contains("cancelled by"), "{verdict}");
    assert_eq!(card("gy-s05")["opacity"], "0.45", "greyed: {verdict}");
    assert!(card("gy-s01")["mark"].is_null(), "{verdict}");
    assert!(html.contains("ink-wash (0.8)"), "the failed shot's LoRAs come from its failed record");

    // A board that also holds another project's shots of the same ids, in the other order: the
    // sheet follows its own project's lines.
    let line = |project: &str, job: &ShotJob| serde_json::to_string(&ShotJob { project: project.into(), degrade: None, ..job.clone() }).unwrap();
    let mut lines: Vec<String> = shots.iter().map(|s| line("gy", &s.job)).collect();
    lines.extend(shots.iter().rev().map(|s| line("gz", &s.job)));
    let board = out_dir.path().join("board.jsonl");
    std::fs::write(&board, lines.join("\n")).unwrap();
    let with_board = out_dir.path().join("with-board");
    let out = shotfleet(
        &fleet.url(),
        &["gallery", "--project", "gy", "--board", board.to_str().unwrap(), "--store", &store_url, "--out", with_board.to_str().unwrap()],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out));
    let html = std::fs::read_to_string(with_board.join("index.html")).unwrap();
    let order: Vec<&str> = html.split("data-job=\"").skip(1).filter_map(|rest| rest.split('"').next()).collect();
    assert_eq!(order, ["gy-s01", "gy-s02", "gy-s03", "gy-s04", "gy-s05"], "the board's order of gy's lines");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_served_sheet_shows_results_that_arrive_later() {
    let fleet = OneWorker::start().await;
    let (js, store) = (&fleet.js, &fleet.store);
    let first = vec![shot(Priority::P1, job("gs-s01", "gs", (64, 64), 2, 1))];
    submit(js, &first).await;
    outcomes(js, &first, Duration::from_secs(60)).await;

    let port = free_port();
    let mut command = std::process::Command::new(binary("shotfleet"));
    command
        .args(["gallery", "--project", "gs", "--serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--store", &format!("file://{}", store.path().display())])
        .env("NATS_URL", fleet.url());
    let _serving = Guarded::spawn(command).unwrap();
    let page = |deadline: Instant, wanted: &str| loop {
        if let Some((200, body)) = http_get(port, "/")
            && body.contains(wanted)
        {
            return body;
        }
        assert!(Instant::now() < deadline, "the served page never showed {wanted}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let body = page(Instant::now() + Duration::from_secs(30), "gs-s01");
    assert!(body.contains("EventSource('events')"), "a served page reloads itself");
    let later = vec![shot(Priority::P1, job("gs-s02", "gs", (64, 64), 2, 1))];
    submit(js, &later).await;
    outcomes(js, &later, Duration::from_secs(60)).await;
    let body = page(Instant::now() + Duration::from_secs(30), "gs-s02");
    assert_eq!(body.matches("<img ").count(), 2, "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_sheet_reads_images_from_an_s3_store_with_the_workers_url() {
    let s3 = S3Server::start();
    s3.create_bucket("sheets");
    let server = shotfleet_testkit::NatsServer::start();
    let js = jetstream_with(&server.url(), &Default::default()).await;
    let mut env: Vec<(String, String)> = S3Server::credentials().iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    env.push(("AWS_ENDPOINT_URL".into(), s3.endpoint()));
    let dir = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("w-s3", dir.path());
    spec.store_url = "s3://sheets/renders".into();
    spec.env = env.clone();
    let _worker = Worker::start(&server.url(), spec);
    let shots = vec![shot(Priority::P1, job("s3-s01", "s3p", (64, 64), 2, 2))];
    submit(&js, &shots).await;
    outcomes(&js, &shots, Duration::from_secs(60)).await;

    env.push(("AWS_ALLOW_HTTP".into(), "true".into()));
    let out_dir = dir.path().join("sheet");
    let args = ["gallery", "--project", "s3p", "--store", "s3://sheets/renders", "--out", out_dir.to_str().unwrap()];
    let out = shotfleet_with(&server.url(), &env, &args).await;
    assert!(out.status.success(), "{}", text(&out));
    let html = std::fs::read_to_string(out_dir.join("index.html")).unwrap();
    assert_eq!(html.matches("src=\"data:image/jpeg;base64,").count(), 2, "{html}");
    // A URL with credentials in it is refused, naming where they go instead.
    let out = shotfleet_with(&server.url(), &env, &["gallery", "--project", "s3p", "--store", "s3://key:secret@sheets/renders"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("AWS_ACCESS_KEY_ID") && !text(&out).contains("secret@"), "{}", text(&out));
    // A project that is no project name writes no folder (`gallery-a/b` was made) and says why.
    let out = shotfleet_with(&server.url(), &env, &["gallery", "--project", "a/b", "--store", "s3://sheets/renders"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("a project name contains '/'"), "{}", text(&out));
}
