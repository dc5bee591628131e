//! The chaos accounting: after a storm, every job has exactly one result or one failed record,
//! every image a result names exists with its sha256, and no image stays under a job that has no
//! result (or that its result does not name). `chaos.rs` and `gpu_box.rs` print and assert it.

use std::collections::{HashMap, HashSet};

use async_nats::jetstream;
use sha2::{Digest, Sha256};
use shotfleet_consumer::store::{Store, StoreConfig};
use shotfleet_producer::storyboard::Shot;
use shotfleet_schema::encoding::{self, ContentType};
use shotfleet_schema::{failure, subject, ShotResult};

/// What one scenario left behind.
#[derive(Debug, Default)]
pub struct Accounting {
    pub scenario: &'static str,
    pub jobs: usize,
    pub results: usize,
    pub failed: usize,
    pub degraded: usize,
    pub duplicate_renders: usize,
    pub missing_images: usize,
    pub stray_objects: usize,
    pub jobs_without_one_outcome: usize,
}

impl Accounting {
    pub fn print(&self) {
        println!(
            "| {:<22} | {:>4} | {:>7} | {:>6} | {:>8} | {:>10} | {:>7} | {:>6} | {:>9} |",
            self.scenario, self.jobs, self.results, self.failed, self.degraded, self.duplicate_renders,
            self.missing_images, self.stray_objects, self.jobs_without_one_outcome
        );
    }

    pub fn assert_clean(&self) {
        assert_eq!(self.jobs_without_one_outcome, 0, "{self:?}");
        assert_eq!(self.results + self.failed, self.jobs, "{self:?}");
        assert_eq!(self.missing_images, 0, "{self:?}");
        assert_eq!(self.stray_objects, 0, "{self:?}");
    }
}

pub fn print_header() {
    println!("| scenario               | jobs | results | failed | degraded | dup renders | missing | strays | not 1 end |");
    println!("| ---------------------- | ---: | ------: | -----: | -------: | ----------: | ------: | -----: | --------: |");
}

/// Counts, for every job: results, failed records, images and objects.
pub async fn account(scenario: &'static str, js: &jetstream::Context, store: &Store, shots: &[Shot], logs: &[String]) -> Accounting {
    let mut acc = Accounting { scenario, jobs: shots.len(), ..Default::default() };
    // Results: every message in SHOT_RESULTS, by job.
    let mut results: HashMap<String, Vec<ShotResult>> = HashMap::new();
    for message in all_messages(js, subject::RESULTS_STREAM).await {
        let ct = message.headers.get(encoding::HEADER).map(|v| v.as_str().to_owned());
        let ct = ContentType::from_header(ct.as_deref()).unwrap();
        let result: ShotResult = encoding::decode(ct, &message.payload).unwrap();
        results.entry(result.job_id.clone()).or_default().push(result);
    }
    let mut failed: HashMap<String, usize> = HashMap::new();
    for message in all_messages(js, subject::FAILED_STREAM).await {
        let job = message.headers.get(failure::JOB_ID).map(|v| v.as_str().to_owned()).unwrap_or_default();
        *failed.entry(job).or_default() += 1;
    }
    for s in shots {
        let id = &s.job.job_id;
        let r = results.get(id).map_or(0, Vec::len);
        let f = failed.get(id).copied().unwrap_or(0);
        if !((r == 1 && f == 0) || (r == 0 && f == 1)) {
            acc.jobs_without_one_outcome += 1;
        }
        acc.failed += usize::from(r == 0 && f > 0);
        let keys: HashSet<String> = store.list_job(&s.job.project, id).await.unwrap().into_iter().collect();
        match results.get(id).and_then(|rs| rs.first()) {
            Some(result) => {
                acc.results += 1;
                acc.degraded += usize::from(result.degrade.is_some());
                let named: HashSet<String> = result.images.iter().map(|i| i.key.clone()).collect();
                for image in &result.images {
                    match store.get(&image.key).await {
                        Ok(bytes) if hex::encode(Sha256::digest(&bytes)) == image.sha256 => {}
                        _ => acc.missing_images += 1,
                    }
                }
                acc.stray_objects += keys.difference(&named).count();
            }
            None => acc.stray_objects += keys.len(),
        }
    }
    // A render that ended in a published or a lost result, per worker log line.
    let renders = logs
        .iter()
        .flat_map(|log| log.lines())
        .filter(|l| l.contains("job done") || l.contains("another worker committed this job first"))
        .count();
    acc.duplicate_renders = renders.saturating_sub(acc.results);
    acc
}

pub async fn all_messages(js: &jetstream::Context, stream_name: &str) -> Vec<jetstream::message::StreamMessage> {
    let mut stream = js.get_stream(stream_name).await.unwrap();
    let state = stream.info().await.unwrap().state.clone();
    let mut out = Vec::new();
    for seq in state.first_sequence..=state.last_sequence {
        if let Ok(m) = stream.get_raw_message(seq).await {
            out.push(m);
        }
    }
    out
}

pub fn local_store(dir: &std::path::Path) -> Store {
    let config = StoreConfig { url: format!("file://{}", dir.display()), ..Default::default() };
    Store::open(&config, Vec::<(String, String)>::new()).unwrap()
}
