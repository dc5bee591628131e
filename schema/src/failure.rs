//! Failed records: the headers that say why a job failed, and the reasons.
//!
//! A failed record is the job's original payload (byte for byte, with its `Content-Type`)
//! published to `shots.failed.<prio>.<project>`, so it can be replayed as it was sent. Its
//! headers are built here, by [`RecordHeaders`], from values that may come from a hostile
//! payload: every value is made header-safe first, and a job id is named only when it is a
//! valid id (the raw one stays in the payload).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::subject;
use crate::validate;

/// Why a job failed (`Shotfleet-Reason`).
pub const REASON: &str = "Shotfleet-Reason";
/// What exactly went wrong, for a person (`Shotfleet-Detail`), one line.
pub const DETAIL: &str = "Shotfleet-Detail";
/// The subject the job was taken from (`Shotfleet-Original-Subject`), where replay sends it.
pub const ORIGINAL_SUBJECT: &str = "Shotfleet-Original-Subject";
/// Attempts that failed (`Shotfleet-Attempts`): real failures, not give-backs for room or
/// shutdown.
pub const ATTEMPTS: &str = "Shotfleet-Attempts";
/// Times the server delivered the job (`Shotfleet-Deliveries`), give-backs included.
pub const DELIVERIES: &str = "Shotfleet-Deliveries";
/// The worker that gave up on it (`Shotfleet-Worker`).
pub const WORKER: &str = "Shotfleet-Worker";
/// The job's id, when the payload held a valid one (`Shotfleet-Job-Id`).
pub const JOB_ID: &str = "Shotfleet-Job-Id";
/// The payload's content type, as the producer sent it.
pub const CONTENT_TYPE: &str = "Content-Type";
/// The deduplication header.
pub const MSG_ID: &str = "Nats-Msg-Id";

/// Why a job ended in the failed stream.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    JsonSchema,
    strum::EnumString,
    strum::IntoStaticStr,
    strum::Display,
    strum::VariantArray,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case", parse_err_ty = String, parse_err_fn = crate::names::unknown::<FailureReason>)]
pub enum FailureReason {
    /// The payload cannot be decoded or breaks the contract; never retried.
    Invalid,
    /// Out of memory below the job's floor.
    Oom,
    /// Failed on each of its allowed attempts (upload, publish, render errors, the time limit).
    Attempts,
    /// Delivered the most times the consumer allows without any worker answering (workers
    /// died on it): the safety net for jobs that crash their worker.
    MaxDeliveries,
    /// Present at repeated driver faults.
    Driver,
}

crate::named!(FailureReason, "failure reason");

/// The longest header value written, bytes.
const MAX_HEADER_VALUE: usize = 1000;

/// Makes any text fit a header value: one line, bounded, no control characters (a CR or LF in a
/// header value ends the header block on the wire, and async-nats panics on one).
pub fn header_safe(text: &str) -> String {
    one_line(text, MAX_HEADER_VALUE)
}

/// `text` as one line of at most `max` bytes (cut on a character boundary, `…` added), control
/// characters replaced by spaces.
pub fn one_line(text: &str, max: usize) -> String {
    let mut line: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    if line.len() > max {
        let mut cut = max;
        while !line.is_char_boundary(cut) {
            cut -= 1;
        }
        line.truncate(cut);
        line.push('…');
    }
    line
}

/// Everything a failed record says about its job.
#[derive(Debug, Clone)]
pub struct RecordFacts<'a> {
    pub reason: FailureReason,
    pub detail: &'a str,
    /// The subject the job was taken from (the server's, so a valid subject).
    pub original_subject: &'a str,
    /// Attempts that failed.
    pub attempts: u64,
    /// Deliveries the job had.
    pub deliveries: u64,
    pub worker: &'a str,
    /// The job id the payload holds, valid or not; `None` when the payload was unreadable.
    pub job_id: Option<&'a str>,
    /// The payload's `Content-Type`, if it had one.
    pub content_type: Option<&'a str>,
    /// The job's sequence in the work stream: part of the record's message id.
    pub stream_sequence: u64,
}

/// The headers of a failed record, every value safe to put on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordHeaders {
    pub pairs: Vec<(&'static str, String)>,
}

impl RecordHeaders {
    /// Builds the headers. A job id that is not a valid id (it may hold anything: a CR, a
    /// subject wildcard, 10 KiB) is left out of `Shotfleet-Job-Id` and the message id, which
    /// then uses the stream sequence; the detail says what was wrong with it.
    pub fn new(facts: &RecordFacts<'_>) -> Self {
        let job_id = facts.job_id.filter(|id| validate::id_problem(id, validate::MAX_ID_BYTES).is_none());
        let mut pairs = Vec::with_capacity(9);
        if let Some(ct) = facts.content_type {
            pairs.push((CONTENT_TYPE, header_safe(ct)));
        }
        pairs.push((REASON, facts.reason.to_string()));
        pairs.push((DETAIL, header_safe(facts.detail)));
        pairs.push((ORIGINAL_SUBJECT, header_safe(facts.original_subject)));
        pairs.push((ATTEMPTS, facts.attempts.to_string()));
        pairs.push((DELIVERIES, facts.deliveries.to_string()));
        pairs.push((WORKER, header_safe(facts.worker)));
        if let Some(id) = job_id {
            pairs.push((JOB_ID, id.to_owned()));
        }
        let msg_id = match job_id {
            Some(id) => subject::msg_id::failed(id, facts.stream_sequence),
            None => subject::msg_id::failed_unnamed(facts.stream_sequence),
        };
        pairs.push((MSG_ID, msg_id));
        Self { pairs }
    }

    /// The value of header `name`, if set.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts<'a>(job_id: Option<&'a str>, detail: &'a str) -> RecordFacts<'a> {
        RecordFacts {
            reason: FailureReason::Invalid,
            detail,
            original_subject: "shots.p1.m.acme",
            attempts: 0,
            deliveries: 1,
            worker: "host/gpu0",
            job_id,
            content_type: Some("application/json"),
            stream_sequence: 7,
        }
    }

    #[test]
    fn a_hostile_job_id_never_reaches_a_header() {
        let headers = RecordHeaders::new(&facts(Some("evil\r\nNats-Msg-Id: x"), "job_id: contains '\\r'\r\nmore"));
        assert_eq!(headers.get(JOB_ID), None);
        assert_eq!(headers.get(MSG_ID), Some("seq-7:failed"));
        for (_, value) in &headers.pairs {
            assert!(!value.contains(['\r', '\n']), "{value:?}");
        }
    }

    #[test]
    fn a_valid_job_id_names_the_record() {
        let headers = RecordHeaders::new(&facts(Some("ep1-s1"), "x"));
        assert_eq!(headers.get(JOB_ID), Some("ep1-s1"));
        assert_eq!(headers.get(MSG_ID), Some("ep1-s1:failed:7"));
        assert_eq!(headers.get(REASON), Some("invalid"));
    }

    #[test]
    fn long_details_are_cut_on_a_character_boundary() {
        let long = "é".repeat(2000);
        let safe = header_safe(&long);
        assert!(safe.len() <= MAX_HEADER_VALUE + '…'.len_utf8());
        assert!(safe.ends_with('…'));
    }

    #[test]
    fn reasons_parse_and_name_themselves() {
        for reason in FailureReason::ALL {
            assert_eq!(reason.to_string().parse::<FailureReason>().unwrap(), *reason);
        }
        assert_eq!(FailureReason::MaxDeliveries.to_string(), "max_deliveries");
        let err = "bogus".parse::<FailureReason>().unwrap_err();
        assert!(err.contains("invalid, oom, attempts, max_deliveries or driver"), "{err}");
    }
}
