//! `shotfleet gallery`: a project's contact sheet, one self-contained HTML page.
//!
//! - [`store`]: reading the images from the workers' store (same URL they take);
//! - [`thumb`]: thumbnails as JPEG data URIs, and the parameters each PNG carries;
//! - [`page`]: the HTML;
//! - [`serve`]: the page on localhost, rebuilt as results arrive.
//!
//! Each job's last outcome comes from `SHOT_RESULTS`; what an outcome does not say (the prompt,
//! steps, LoRAs of a failed or cancelled job) comes from the storyboard when one is given, from
//! the failed record's payload, or from the PNG's text.

pub mod page;
pub mod serve;
pub mod store;
pub mod thumb;

use std::cmp::Ordering;
use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use shotfleet_schema::encoding::{self, ContentType};
use shotfleet_schema::{ResultStatus, ShotJob, ShotResult, failure, subject};

use crate::storyboard::Storyboard;
use crate::wait;
use store::ImageStore;
use thumb::Thumb;

/// How long to wait for the next message of a stream being read to its end.
const READ_PATIENCE: Duration = Duration::from_secs(10);

/// Where one shot stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Done,
    Degraded,
    Failed,
    Cancelled,
    /// On the storyboard, no outcome yet.
    Waiting,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Done => "done",
            Self::Degraded => "degraded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::Waiting => "waiting",
        }
    }
}

/// One shot of the sheet.
#[derive(Debug, Clone)]
pub struct Card {
    pub job_id: String,
    pub shot_id: String,
    pub status: Status,
    pub result: Option<ShotResult>,
    /// The job as submitted (storyboard line or failed record), when known.
    pub job: Option<ShotJob>,
    /// One per image: the thumbnail, or why it cannot be shown.
    pub thumbs: Vec<Result<Thumb, String>>,
}

/// Builds a project's sheet; keeps thumbnails between builds (`--serve` rebuilds often).
pub struct Gallery {
    js: jetstream::Context,
    store: ImageStore,
    project: String,
    board: Option<Storyboard>,
    thumbs: HashMap<String, Result<Thumb, String>>,
}

impl Gallery {
    /// A gallery of `project`; `board` orders the sheet and fills in what outcomes do not say.
    pub fn new(js: jetstream::Context, store: ImageStore, project: &str, board: Option<Storyboard>) -> Self {
        Self { js, store, project: project.to_owned(), board, thumbs: HashMap::new() }
    }

    pub fn project(&self) -> &str {
        &self.project
    }

    pub fn js(&self) -> &jetstream::Context {
        &self.js
    }

    /// Reads every outcome and failed record of the project and the images the outcomes name.
    ///
    /// # Errors
    /// A stream could not be read.
    pub async fn cards(&mut self) -> Result<Vec<Card>, String> {
        let results = self.results().await?;
        let failed = self.failed_jobs().await?;
        // This project's shots of the board, and their order: another project's may hold the
        // same ids.
        let (mut board, mut order) = (HashMap::new(), HashMap::new());
        let shots = self.board.iter().flat_map(|b| b.shots.iter()).map(|s| &s.job).filter(|j| j.project == self.project);
        for (i, job) in shots.enumerate() {
            order.insert(job.job_id.clone(), i);
            board.insert(job.job_id.clone(), job.clone());
        }
        let mut cards = Vec::new();
        for result in results.into_values() {
            let job = board.get(&result.job_id).cloned().or_else(|| failed.get(&result.job_id).cloned());
            let mut thumbs = Vec::new();
            for image in &result.images {
                thumbs.push(self.thumb(&image.key).await);
            }
            let status = match result.status {
                ResultStatus::Done => Status::Done,
                ResultStatus::Degraded => Status::Degraded,
                ResultStatus::Failed => Status::Failed,
                ResultStatus::Cancelled => Status::Cancelled,
            };
            cards.push(Card { job_id: result.job_id.clone(), shot_id: result.shot_id.clone(), status, result: Some(result), job, thumbs });
        }
        for (job_id, job) in board {
            if !cards.iter().any(|c| c.job_id == job_id) {
                let card = Card { job_id, shot_id: job.shot_id.clone(), status: Status::Waiting, result: None, job: Some(job), thumbs: Vec::new() };
                cards.push(card);
            }
        }
        cards.sort_by(|a, b| match (order.get(&a.job_id), order.get(&b.job_id)) {
            (Some(x), Some(y)) => x.cmp(y),
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (None, None) => natural(&a.shot_id, &b.shot_id).then_with(|| natural(&a.job_id, &b.job_id)),
        });
        Ok(cards)
    }

    async fn thumb(&mut self, key: &str) -> Result<Thumb, String> {
        if let Some(thumb) = self.thumbs.get(key) {
            return thumb.clone();
        }
        let made = match self.store.get(key).await {
            Ok(png) => tokio::task::spawn_blocking(move || thumb::thumbnail(&png)).await.map_err(|e| e.to_string()).and_then(|t| t),
            Err(e) => Err(e),
        };
        // A read that failed is tried again at the next build; a bad image is not.
        if made.is_ok() || !made.as_ref().is_err_and(|e| e.starts_with("cannot read")) {
            self.thumbs.insert(key.to_owned(), made.clone());
        }
        made
    }

    /// The last outcome of every job of the project.
    async fn results(&self) -> Result<HashMap<String, ShotResult>, String> {
        let filter = format!("{}.done.{}.*", subject::ROOT, self.project);
        let messages = read_all(&self.js, subject::RESULTS_STREAM, filter, consumer::DeliverPolicy::LastPerSubject).await?;
        let mut results = HashMap::new();
        for message in messages {
            let content_type = message.headers.as_ref().and_then(|h| h.get(encoding::HEADER)).map(|v| v.as_str().to_owned());
            let Ok(content_type) = ContentType::from_header(content_type.as_deref()) else { continue };
            if let Ok(result) = encoding::decode::<ShotResult>(content_type, &message.payload) {
                results.insert(result.job_id.clone(), result);
            }
        }
        Ok(results)
    }

    /// The jobs of the project's failed records, by job id.
    async fn failed_jobs(&self) -> Result<HashMap<String, ShotJob>, String> {
        let filter = format!("{}.failed.*.{}", subject::ROOT, self.project);
        let messages = read_all(&self.js, subject::FAILED_STREAM, filter, consumer::DeliverPolicy::All).await?;
        let mut jobs = HashMap::new();
        for message in messages {
            let header = |name: &str| message.headers.as_ref().and_then(|h| h.get(name)).map(|v| v.as_str().to_owned());
            if let Ok(job) = encoding::decode_job(header(failure::CONTENT_TYPE).as_deref(), &message.payload) {
                jobs.insert(job.job_id.clone(), job);
            }
        }
        Ok(jobs)
    }
}

/// Every message of `stream` under `filter` as `deliver` picks them, read to the end.
async fn read_all(
    js: &jetstream::Context,
    stream: &str,
    filter: String,
    deliver: consumer::DeliverPolicy,
) -> Result<Vec<jetstream::Message>, String> {
    let info = js.get_stream(stream).await.map_err(|e| format!("cannot open {stream}: {e}"))?;
    let subjects = info.info_with_subjects(filter.clone()).await.map_err(|e| format!("cannot read {stream}: {e}"))?;
    let counts: Vec<usize> = subjects.filter_map(|s| async move { s.ok().map(|(_, n)| n) }).collect().await;
    let expected = match deliver {
        consumer::DeliverPolicy::LastPerSubject => counts.len(),
        _ => counts.iter().sum(),
    };
    if expected == 0 {
        return Ok(Vec::new());
    }
    let mut messages = wait::follow(js, stream, filter, deliver).await.map_err(|e| e.to_string())?;
    let mut read = Vec::with_capacity(expected);
    while read.len() < expected {
        match tokio::time::timeout(READ_PATIENCE, messages.next()).await {
            Ok(Some(Ok(message))) => {
                let last = message.info().map(|i| i.pending == 0).unwrap_or(false);
                read.push(message);
                if last {
                    break;
                }
            }
            Ok(Some(Err(e))) => return Err(format!("cannot read {stream}: {e}")),
            Ok(None) | Err(_) => break,
        }
    }
    Ok(read)
}

/// Orders `s2` before `s10`: digit runs compare as numbers.
pub fn natural(a: &str, b: &str) -> Ordering {
    let (mut a, mut b) = (a.as_bytes(), b.as_bytes());
    loop {
        match (a.first(), b.first()) {
            (None, None) => return Ordering::Equal,
            (None, _) => return Ordering::Less,
            (_, None) => return Ordering::Greater,
            (Some(x), Some(y)) if x.is_ascii_digit() && y.is_ascii_digit() => {
                let run = |s: &[u8]| s.iter().take_while(|c| c.is_ascii_digit()).count();
                let (n, m) = (run(a), run(b));
                let (da, db) = (trim_zeros(&a[..n]), trim_zeros(&b[..m]));
                let by_number = da.len().cmp(&db.len()).then_with(|| da.cmp(db));
                if by_number != Ordering::Equal {
                    return by_number;
                }
                (a, b) = (&a[n..], &b[m..]);
            }
            (Some(x), Some(y)) if x != y => return x.cmp(y),
            _ => (a, b) = (&a[1..], &b[1..]),
        }
    }
}

fn trim_zeros(digits: &[u8]) -> &[u8] {
    let zeros = digits.iter().take_while(|c| **c == b'0').count();
    &digits[zeros..]
}

#[cfg(test)]
mod tests {
    use super::natural;
    use std::cmp::Ordering;

    #[test]
    fn shots_sort_as_a_storyboard_reads() {
        let mut shots = vec!["s10", "s2", "s1", "s02b", "ep2-s1", "ep10-s1", "s002"];
        shots.sort_by(|a, b| natural(a, b));
        assert_eq!(shots, ["ep2-s1", "ep10-s1", "s1", "s2", "s002", "s02b", "s10"]);
        assert_eq!(natural("a", "a"), Ordering::Equal);
    }
}
