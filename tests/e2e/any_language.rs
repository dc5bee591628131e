//! Producers in other languages: Python (nats-py) publishes JSON and MessagePack jobs, to class
//! subjects and to `auto`, and the Rust side decodes and validates every one.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use futures::StreamExt;
use shotfleet_schema::encoding::parse_job;
use shotfleet_schema::nats::Topology;
use shotfleet_schema::{subject, Limits, SubjectClass};
use shotfleet_testkit::{paths, NatsServer};

#[tokio::test]
async fn python_jobs_decode_and_validate_in_rust() {
    let server = NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = jetstream::new(client);
    Topology::default().ensure(&js, false).await.unwrap();

    let script = paths::repo_root().join("tests/python/publish_jobs.py");
    let out = std::process::Command::new(paths::require(paths::python(), "the venv's python"))
        .arg(&script)
        .arg(server.url())
        .output()
        .unwrap();
    assert!(out.status.success(), "python failed: {}", String::from_utf8_lossy(&out.stderr));
    let sent: Vec<(String, String)> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(sent.len(), 4);

    let stream = js.get_stream(subject::JOBS_STREAM).await.unwrap();
    for (subject_name, job_id) in sent {
        let parsed = subject::parse_job(&subject_name).unwrap();
        let (consumer_name, _) = subject::consumer(parsed.priority, parsed.class);
        let consumer: PullConsumer = stream.get_consumer(&consumer_name).await.unwrap();
        let mut batch = consumer.fetch().max_messages(1).expires(Duration::from_secs(2)).messages().await.unwrap();
        let message = batch.next().await.expect("a job on the consumer").unwrap();
        let content_type = message.headers.as_ref().and_then(|h| h.get("Content-Type")).map(|v| v.as_str().to_owned());
        let job = parse_job(content_type.as_deref(), &message.payload, &Limits::default())
            .unwrap_or_else(|e| panic!("{job_id}: {e}"));
        assert_eq!(job.job_id, job_id);
        assert_eq!(job.prompt, "a paper boat on a puddle, 水彩");
        // Python computed the same class as Rust, or left it to the workers.
        match parsed.class {
            SubjectClass::Class(class) => assert_eq!(class, job.class(), "{job_id}"),
            SubjectClass::Auto => assert!(job.job_id.starts_with("py-auto")),
        }
        message.ack().await.unwrap();
    }
}
