//! Least privilege on the wire, against nats-server running the shipped roles
//! (`deploy/nats/shotfleet-account.conf`, included as it is): each role can do its commands and
//! nothing more. Then TLS with client certificates, every credential kind, and no secret in
//! what the binaries print.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use shotfleet_schema::subject;
use shotfleet_testkit::nats::{NatsServer, ServerOptions};
use shotfleet_testkit::{TestCa, paths};
use shotfleet_tests::{Worker, WorkerSpec, binary};

/// A user of the shipped account, its password (set in the server's environment) and the
/// reply prefix its permissions allow.
#[derive(Debug, Clone, Copy)]
struct Login {
    user: &'static str,
    password: &'static str,
    variable: &'static str,
}

const WORKER: Login = Login { user: "worker", password: "worker-pw-7", variable: "SHOTFLEET_WORKER_PASSWORD" };
const OPERATOR: Login = Login { user: "operator", password: "operator-pw-7", variable: "SHOTFLEET_OPERATOR_PASSWORD" };
const TIDE: Login = Login { user: "producer-tide", password: "tide-pw-7", variable: "SHOTFLEET_PRODUCER_PASSWORD_TIDE" };
const MOTH: Login = Login { user: "producer-moth", password: "moth-pw-7", variable: "SHOTFLEET_PRODUCER_PASSWORD_MOTH" };

impl Login {
    fn inbox(self) -> String {
        format!("_INBOX_{}", self.user)
    }

    /// The environment the binaries read the login from (no secret on the command line).
    fn env(self) -> Vec<(String, String)> {
        vec![
            ("NATS_USER".into(), self.user.into()),
            ("NATS_PASSWORD".into(), self.password.into()),
            ("NATS_INBOX_PREFIX".into(), self.inbox()),
        ]
    }

    /// A client as this user that records what the server refuses, JetStream requests timing
    /// out after a second (a refused request gets no answer).
    async fn connect(self, url: &str) -> (jetstream::Context, Arc<Mutex<Vec<String>>>) {
        let refused = Arc::new(Mutex::new(Vec::new()));
        let seen = refused.clone();
        let client = async_nats::ConnectOptions::with_user_and_password(self.user.into(), self.password.into())
            .custom_inbox_prefix(self.inbox())
            .event_callback(move |event| {
                let seen = seen.clone();
                async move {
                    if let async_nats::Event::ServerError(e) = event {
                        seen.lock().unwrap().push(e.to_string().to_lowercase());
                    }
                }
            })
            .connect(url)
            .await
            .unwrap_or_else(|e| panic!("{} cannot connect: {e}", self.user));
        let mut js = jetstream::new(client);
        js.set_timeout(Duration::from_secs(1));
        (js, refused)
    }
}

/// nats-server with the shipped account file and every role's password.
fn roles_server() -> NatsServer {
    NatsServer::start_with(ServerOptions {
        include: vec![paths::repo_root().join("deploy/nats/shotfleet-account.conf")],
        env: [WORKER, OPERATOR, TIDE, MOTH].iter().map(|l| (l.variable.to_owned(), l.password.to_owned())).collect(),
        ..Default::default()
    })
}

/// Runs `shotfleet ARGS` with only the given environment for NATS.
async fn shotfleet(url: &str, env: &[(String, String)], args: &[&str]) -> Output {
    let mut command = tokio::process::Command::new(binary("shotfleet"));
    for (name, _) in std::env::vars().filter(|(name, _)| name.starts_with("NATS_")) {
        command.env_remove(name);
    }
    command.args(args).env("NATS_URL", url).envs(env.iter().cloned()).output().await.expect("run shotfleet")
}

fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

/// A one-shot storyboard of `project`.
fn storyboard(dir: &Path, project: &str) -> PathBuf {
    let path = dir.join(format!("{project}.jsonl"));
    let line = format!(
        r#"{{"job_id":"{project}-1","project":"{project}","shot_id":"s1","priority":"p0","prompt":"a paper boat, ink wash","width":64,"height":64,"steps":1,"guidance":5.0,"seed":3}}"#
    );
    std::fs::write(&path, line + "\n").unwrap();
    path
}

async fn submit_and_wait(url: &str, login: Login, file: &Path) {
    let out = shotfleet(url, &login.env(), &["submit", file.to_str().unwrap(), "--wait", "--timeout", "120s"]).await;
    assert!(out.status.success(), "{} submit --wait: {}", login.user, text(&out));
    assert!(text(&out).contains("1 done, 0 degraded, 0 failed"), "{}", text(&out));
}

fn was_refused(refused: &Mutex<Vec<String>>, subject: &str) -> bool {
    let wanted = format!("permissions violation for publish to \"{}\"", subject.to_lowercase());
    refused.lock().unwrap().iter().any(|e| e.contains(&wanted))
}

/// Waits (a few seconds at most) for the server's refusal of `subject` to reach the client.
async fn assert_refused(refused: &Mutex<Vec<String>>, subject: &str) {
    for _ in 0..50 {
        if was_refused(refused, subject) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no permissions violation for {subject}: {:?}", refused.lock().unwrap());
}

#[tokio::test]
async fn each_role_does_its_commands_and_nothing_more() {
    let server = roles_server();
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();

    // Operator: the topology.
    let out = shotfleet(&url, &OPERATOR.env(), &["setup"]).await;
    assert!(out.status.success() && text(&out).contains("22 created"), "operator setup: {}", text(&out));

    // Worker: starts (stream and consumer info, the advisory subscription) and renders.
    let store = dir.path().join("images");
    let mut spec = WorkerSpec::new("w-roles", &store);
    spec.env = WORKER.env();
    let worker = Worker::start(&url, spec);

    // Producers: submit --wait for their own project.
    submit_and_wait(&url, TIDE, &storyboard(dir.path(), "tide")).await;
    submit_and_wait(&url, MOTH, &storyboard(dir.path(), "moth")).await;
    // A job on `auto`: the worker routes it (a re-publish) before it renders it.
    let (js, _) = TIDE.connect(&url).await;
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", "tide-auto");
    headers.insert("Content-Type", "application/json");
    let auto = r#"{"v":1,"job_id":"tide-auto","project":"tide","shot_id":"s2","prompt":"a gull","width":64,"height":64,"steps":1,"guidance":5.0,"seed":2}"#;
    js.publish_with_headers("shots.p1.auto.tide", headers, auto.into()).await.unwrap().await.expect("queued");
    let awaited = [shotfleet_producer::wait::Awaited { project: "tide".into(), job_id: "tide-auto".into(), duplicate: false, queued_at: None }];
    let outcomes = shotfleet_producer::wait::wait(&js, &awaited, std::time::SystemTime::now(), Some(Duration::from_secs(120)), |_, _| {})
        .await
        .expect("the routed job's result, read as producer-tide");
    assert!(matches!(outcomes["tide/tide-auto"], shotfleet_producer::wait::Outcome::Done(_)), "{outcomes:?}");
    let out = shotfleet(&url, &TIDE.env(), &["status"]).await;
    assert!(out.status.success(), "producer status: {}", text(&out));
    assert!(text(&out).contains("render-p0-xs"), "{}", text(&out));

    // A producer reads its own results, and nothing of another project, and changes no stream.
    let (js, refused) = TIDE.connect(&url).await;
    let results = js.get_stream(subject::RESULTS_STREAM).await.expect("stream info is allowed");
    results.direct_get_last_for_subject(subject::result("tide", "tide-1")).await.expect("its own result");
    assert!(results.direct_get_last_for_subject(subject::result("moth", "moth-1")).await.is_err());
    assert_refused(&refused, "$JS.API.DIRECT.GET.SHOT_RESULTS.shots.done.moth.moth-1").await;
    assert!(js.delete_stream(subject::JOBS_STREAM).await.is_err());
    assert_refused(&refused, "$JS.API.STREAM.DELETE.SHOTS").await;
    let jobs = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    assert!(jobs.purge().await.is_err());
    assert_refused(&refused, "$JS.API.STREAM.PURGE.SHOTS").await;
    let published = js.publish(subject::job(subject::Priority::P1, subject::SubjectClass::Auto, "moth"), "{}".into()).await;
    assert!(published.is_err() || published.unwrap().await.is_err(), "a job of another project must not be queued");
    assert_refused(&refused, "shots.p1.auto.moth").await;
    assert!(jobs.get_raw_message(1).await.is_err(), "reading queued jobs (other projects' prompts)");
    assert_refused(&refused, "$JS.API.STREAM.MSG.GET.SHOTS").await;

    // A worker cannot delete or purge a stream, nor delete a consumer.
    let (js, refused) = WORKER.connect(&url).await;
    assert!(js.delete_stream(subject::RESULTS_STREAM).await.is_err());
    assert_refused(&refused, "$JS.API.STREAM.DELETE.SHOT_RESULTS").await;
    let jobs = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    assert!(jobs.delete_consumer("render-p0-xs").await.is_err());
    assert_refused(&refused, "$JS.API.CONSUMER.DELETE.SHOTS.render-p0-xs").await;

    // Operator: replay a failed record. A job tide's producer may publish but that fails
    // validation (an empty prompt) lands in the failed stream.
    let (js, _) = TIDE.connect(&url).await;
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", "tide-bad");
    headers.insert("Content-Type", "application/json");
    let bad = r#"{"v":1,"job_id":"tide-bad","project":"tide","shot_id":"s9","prompt":"","width":64,"height":64,"steps":1,"guidance":5.0,"seed":1}"#;
    js.publish_with_headers("shots.p1.xs.tide", headers, bad.into()).await.unwrap().await.expect("queued");
    let (js, _) = OPERATOR.connect(&url).await;
    let mut failed = js.get_stream(subject::FAILED_STREAM).await.unwrap();
    for _ in 0..300 {
        if failed.info().await.unwrap().state.messages > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let out = shotfleet(&url, &OPERATOR.env(), &["replay", "--job", "tide-bad"]).await;
    assert!(out.status.success() && text(&out).contains("summary: replayed 1"), "operator replay: {}", text(&out));
    let out = shotfleet(&url, &OPERATOR.env(), &["status"]).await;
    assert!(out.status.success(), "operator status: {}", text(&out));

    // A producer sees the live workers, cancels its own queued job (a class nobody serves) and
    // makes its project's contact sheet; another project's cancel subject is not its own.
    let out = shotfleet(&url, &TIDE.env(), &["status"]).await;
    assert!(text(&out).contains("w-roles"), "producer status lists the workers: {}", text(&out));
    let (js, refused) = TIDE.connect(&url).await;
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", "tide-xl");
    headers.insert("Content-Type", "application/json");
    let xl = r#"{"v":1,"job_id":"tide-xl","project":"tide","shot_id":"s3","prompt":"a wide bay","width":1600,"height":1600,"steps":1,"guidance":5.0,"seed":4}"#;
    js.publish_with_headers("shots.p1.xl.tide", headers, xl.into()).await.unwrap().await.expect("queued");
    let out = shotfleet(&url, &TIDE.env(), &["cancel", "--project", "tide", "tide-xl"]).await;
    assert!(out.status.success() && text(&out).contains("1 cancelled"), "producer cancel: {}", text(&out));
    let gallery = dir.path().join("gallery");
    let store_url = format!("file://{}", store.display());
    let out = shotfleet(&url, &TIDE.env(), &["gallery", "--project", "tide", "--store", &store_url, "--out", gallery.to_str().unwrap()]).await;
    assert!(out.status.success(), "producer gallery: {}", text(&out));
    js.client().publish("shots.cancel.moth.moth-1", "{}".into()).await.unwrap();
    assert_refused(&refused, "shots.cancel.moth.moth-1").await;

    // The server refused the binaries nothing: every refusal above was the test's own.
    let log = server.log();
    let theirs: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("Violation") && (l.contains("shotfleet-cli") || l.contains("shotfleet-consumer")))
        .collect();
    assert!(theirs.is_empty(), "a role was refused something its commands need: {theirs:#?}");
    drop(worker);
}

/// A plain server with `config` (TLS, authorization), without the roles.
fn server_with(config: String) -> NatsServer {
    NatsServer::start_with(ServerOptions { extra_config: config, ..Default::default() })
}

fn arg(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[tokio::test]
async fn a_whole_job_runs_over_mutual_tls_and_a_plain_client_is_told_tls_is_required() {
    let ca = TestCa::new();
    let server_cert = ca.server("nats");
    let client = ca.client("shotfleet");
    let server = server_with(format!(
        "tls {{ cert_file: {:?}, key_file: {:?}, ca_file: {:?}, verify: true, timeout: 2 }}\n",
        arg(&server_cert.cert),
        arg(&server_cert.key),
        arg(&ca.ca_file())
    ));
    let url = server.url();
    let ca_file = ca.ca_file();
    // The CLI by flags, the worker by the environment.
    let tls = ["--tls-ca", arg(&ca_file), "--tls-cert", arg(&client.cert), "--tls-key", arg(&client.key)];
    let out = shotfleet(&url, &[], &[&tls[..], &["setup"]].concat()).await;
    assert!(out.status.success(), "setup over mTLS: {}", text(&out));

    let dir = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("w-tls", &dir.path().join("images"));
    spec.env = vec![
        ("NATS_CA".into(), arg(&ca_file).into()),
        ("NATS_CERT".into(), arg(&client.cert).into()),
        ("NATS_KEY".into(), arg(&client.key).into()),
    ];
    let _worker = Worker::start(&url, spec);
    let board = storyboard(dir.path(), "tide");
    let out = shotfleet(&url, &[], &[&tls[..], &["submit", arg(&board), "--wait", "--timeout", "120s"]].concat()).await;
    assert!(out.status.success() && text(&out).contains("1 done"), "a job over mTLS: {}", text(&out));

    let out = shotfleet(&url, &[], &["status"]).await;
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(text(&out).contains("the server requires TLS"), "a plain client: {}", text(&out));

    let out = shotfleet(&url, &[], &["--tls-ca", arg(&ca_file), "status"]).await;
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(text(&out).contains("--tls-cert"), "a client without a certificate: {}", text(&out));

    let other_ca = TestCa::new();
    let stranger = other_ca.client("stranger");
    let out = shotfleet(&url, &[], &["--tls-ca", arg(&ca_file), "--tls-cert", arg(&stranger.cert), "--tls-key", arg(&stranger.key), "status"]).await;
    assert_eq!(out.status.code(), Some(3), "a certificate of another CA: {}", text(&out));
    assert!(text(&out).contains("TLS failed"), "a certificate of another CA: {}", text(&out));
}

#[tokio::test]
async fn every_credential_kind_connects() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, content: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, format!("{content}\n")).unwrap();
        path
    };
    let ok = |out: &Output, what: &str| assert!(out.status.success(), "{what}: {}", text(out));

    let server = server_with("authorization { token: \"tok-s3cret-9\" }\n".into());
    let token_file = file("token", "tok-s3cret-9");
    ok(&shotfleet(&server.url(), &[("NATS_TOKEN".into(), "tok-s3cret-9".into())], &["setup"]).await, "NATS_TOKEN");
    ok(&shotfleet(&server.url(), &[], &["--token-file", arg(&token_file), "status"]).await, "--token-file");
    let in_url = server.url().replace("nats://", "nats://tok-s3cret-9@");
    ok(&shotfleet(&in_url, &[], &["status"]).await, "a token in the URL");

    let user = nkeys::KeyPair::new_user();
    let seed = file("user.nk", &user.seed().unwrap());
    let server = server_with(format!("authorization {{ users: [ {{ nkey: {:?} }} ] }}\n", user.public_key()));
    ok(&shotfleet(&server.url(), &[], &["--nkey", arg(&seed), "setup"]).await, "--nkey");
    ok(&shotfleet(&server.url(), &[("NATS_NKEY".into(), arg(&seed).into())], &["status"]).await, "NATS_NKEY");

    let server = server_with("authorization { user: render, password: \"pw-file-9\" }\n".into());
    let password = file("password", "pw-file-9");
    ok(&shotfleet(&server.url(), &[], &["--user", "render", "--password-file", arg(&password), "setup"]).await, "--password-file");
    let env = [("NATS_USER".into(), "render".into()), ("NATS_PASSWORD_FILE".into(), arg(&password).into())];
    ok(&shotfleet(&server.url(), &env, &["status"]).await, "NATS_PASSWORD_FILE");
    let out = shotfleet(&server.url(), &[], &["--user", "render", "--password-file", arg(&password), "--nkey", arg(&seed), "status"]).await;
    assert_eq!(out.status.code(), Some(2), "bad settings: {}", text(&out));
    assert!(text(&out).contains("more than one kind of NATS credential"), "{}", text(&out));
    let out = shotfleet(&server.url(), &[], &["--user", "render", "--password-file", "/nonexistent/pw", "status"]).await;
    assert!(text(&out).contains("cannot read password file /nonexistent/pw"), "{}", text(&out));
}

#[tokio::test]
async fn no_secret_reaches_the_output_of_a_failing_connect() {
    const SECRET: &str = "hunter2-zq7";
    let loud = [("RUST_LOG".to_owned(), "trace".to_owned())];
    let nobody = format!("nats://render:{SECRET}@127.0.0.1:{}", shotfleet_testkit::ports::free_port());
    let out = shotfleet(&nobody, &loud, &["status"]).await;
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(text(&out).contains("nats://render:***@127.0.0.1"), "{}", text(&out));
    assert!(!text(&out).contains(SECRET), "the CLI printed the password: {}", text(&out));

    let server = server_with("authorization { user: render, password: \"right-pw\" }\n".into());
    let wrong = server.url().replace("nats://", &format!("nats://render:{SECRET}@"));
    let out = shotfleet(&wrong, &loud, &["status"]).await;
    assert!(text(&out).contains("authorization violation"), "{}", text(&out));
    assert!(!text(&out).contains(SECRET), "the CLI printed the password: {}", text(&out));

    // The worker, with a debug log of the NATS client: the password never reached it.
    let dir = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("w-secret", &dir.path().join("images"));
    spec.env = vec![("RUST_LOG".into(), "trace,ort=warn".into()), ("AWS_SECRET_ACCESS_KEY".into(), SECRET.into())];
    let mut worker = Worker::spawn(&wrong, spec);
    let status = worker.wait_exit(Duration::from_secs(60)).expect("the worker exits");
    assert_eq!(status.code(), Some(3), "{}", worker.log());
    assert!(worker.log().contains("render:***@127.0.0.1"), "{}", worker.log());
    assert!(!worker.log().contains(SECRET), "the worker printed a secret: {}", worker.log());
}

#[tokio::test]
async fn a_worker_without_a_store_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = WorkerSpec::new("w-nostore", dir.path());
    spec.store_url = String::new();
    let mut worker = Worker::spawn("nats://127.0.0.1:4222", spec);
    let status = worker.wait_exit(Duration::from_secs(30)).expect("the worker exits");
    assert_eq!(status.code(), Some(2), "{}", worker.log());
    assert!(worker.log().contains("store.url (SHOTFLEET_STORE, --store): no store for the images"), "{}", worker.log());
}
