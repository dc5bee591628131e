//! Subjects, streams and consumer names: the topology's vocabulary.
//!
//! | what | subject |
//! | --- | --- |
//! | a job | `shots.<p0\|p1\|p2>.<xs\|s\|m\|l\|xl\|auto>.<project>` |
//! | a result | `shots.done.<project>.<job_id>` |
//! | a failed record | `shots.failed.<prio>.<project>` |
//!
//! `auto` is for clients that do not compute the memory class; a worker re-publishes such a job
//! to its class subject before anyone renders it.

use std::fmt;
use std::str::FromStr;

use crate::class::MemoryClass;

/// The work-queue stream holding jobs.
pub const JOBS_STREAM: &str = "SHOTS";
/// The stream holding results, one per job (the commit point).
pub const RESULTS_STREAM: &str = "SHOT_RESULTS";
/// The stream holding failed records, replayable.
pub const FAILED_STREAM: &str = "SHOTS_FAILED";

/// Root of every subject.
pub const ROOT: &str = "shots";

/// A job's urgency: `p0` (urgent, anchor shots) before `p1` (normal) before `p2` (backfill).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    strum::EnumString,
    strum::IntoStaticStr,
    strum::Display,
    strum::VariantArray,
)]
#[strum(serialize_all = "lowercase", parse_err_ty = String, parse_err_fn = crate::names::unknown::<Priority>)]
pub enum Priority {
    P0,
    P1,
    P2,
}

crate::named!(Priority, "priority");

impl Priority {
    /// 0 for `p0`, the most urgent.
    pub const fn rank(self) -> usize {
        self as usize
    }
}

/// The class token of a job subject: a memory class, or `auto` (a worker routes it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SubjectClass {
    Class(MemoryClass),
    Auto,
}

impl SubjectClass {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Class(class) => class.as_str(),
            Self::Auto => "auto",
        }
    }
}

impl fmt::Display for SubjectClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SubjectClass {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "auto" {
            return Ok(Self::Auto);
        }
        s.parse::<MemoryClass>()
            .map(Self::Class)
            .map_err(|_| format!("unknown class `{s}`; expected xs, s, m, l, xl or auto"))
    }
}

/// Where a job is published: `shots.<prio>.<class>.<project>`.
pub fn job(priority: Priority, class: SubjectClass, project: &str) -> String {
    format!("{ROOT}.{priority}.{class}.{project}")
}

/// Where a job's result is published: `shots.done.<project>.<job_id>`.
pub fn result(project: &str, job_id: &str) -> String {
    format!("{ROOT}.done.{project}.{job_id}")
}

/// Where a failed record is published: `shots.failed.<prio>.<project>`.
pub fn failed(priority: Priority, project: &str) -> String {
    format!("{ROOT}.failed.{priority}.{project}")
}

/// The subjects the jobs stream captures: exactly the render consumers' filters, so a job
/// published to any other subject (`shots.p0.bogus.acme`, a typo'd class) is refused by the
/// server at publish time instead of waiting in the stream for a consumer that never comes.
pub fn jobs_stream_subjects() -> Vec<String> {
    Priority::ALL.iter().flat_map(|p| job_classes().map(move |c| consumer(*p, c).1)).collect()
}

/// Every class token of a job subject: the memory classes and `auto`.
pub fn job_classes() -> impl Iterator<Item = SubjectClass> {
    MemoryClass::ALL.iter().copied().map(SubjectClass::Class).chain([SubjectClass::Auto])
}

/// The subjects the results stream captures.
pub fn results_stream_subjects() -> Vec<String> {
    vec![format!("{ROOT}.done.>")]
}

/// The subjects the failed stream captures.
pub fn failed_stream_subjects() -> Vec<String> {
    vec![format!("{ROOT}.failed.>")]
}

/// The durable pull consumer serving one (priority, class), and its one filter subject.
///
/// One filter per consumer: nats-server 2.9 silently ignores `filter_subjects`, and a work-queue
/// stream needs the filters of its consumers not to overlap.
pub fn consumer(priority: Priority, class: SubjectClass) -> (String, String) {
    (format!("render-{priority}-{class}"), format!("{ROOT}.{priority}.{class}.*"))
}

/// A job subject taken apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobSubject {
    pub priority: Priority,
    pub class: SubjectClass,
    pub project: String,
}

/// Parses `shots.<prio>.<class>.<project>`.
///
/// # Errors
/// A message naming the part that is wrong.
pub fn parse_job(subject: &str) -> Result<JobSubject, String> {
    let parts: Vec<&str> = subject.split('.').collect();
    let [root, priority, class, project] = parts[..] else {
        return Err(format!(
            "job subject `{subject}` must have four parts: shots.<prio>.<class>.<project>"
        ));
    };
    if root != ROOT {
        return Err(format!("job subject `{subject}` must start with `{ROOT}.`"));
    }
    Ok(JobSubject {
        priority: priority.parse()?,
        class: class.parse()?,
        project: project.to_owned(),
    })
}

/// Parses `shots.failed.<prio>.<project>` into its priority and project.
///
/// # Errors
/// A message naming the part that is wrong.
pub fn parse_failed(subject: &str) -> Result<(Priority, String), String> {
    match subject.split('.').collect::<Vec<_>>()[..] {
        [ROOT, "failed", priority, project] => Ok((priority.parse()?, project.to_owned())),
        _ => Err(format!("`{subject}` is not a failed subject: shots.failed.<prio>.<project>")),
    }
}

/// The key-value bucket counting each job message's failed attempts and out-of-memory errors
/// (a failure counter outside the delivery count: giving a job back for room or at shutdown
/// is not a failure).
pub const ATTEMPTS_BUCKET: &str = "SHOT_ATTEMPTS";

/// A job message's key in [`ATTEMPTS_BUCKET`]: its job id and stream sequence, so a replay or a
/// degraded copy (a new message) starts from no failures.
pub fn attempts_key(job_id: &str, stream_sequence: u64) -> String {
    format!("{job_id}.{stream_sequence}")
}

/// Message ids (`Nats-Msg-Id`) beside the job's own id: one per kind of publish, so the
/// server's duplicate window makes each publish idempotent.
pub mod msg_id {
    /// A job as submitted: its [`key`](crate::job::key), so two projects' jobs of one id are
    /// two jobs to the duplicate window.
    pub fn job(project: &str, job_id: &str) -> String {
        crate::job::key(project, job_id)
    }
    /// The outcome (result, failure, cancellation) that settles the job message at
    /// `stream_sequence`.
    pub fn outcome(job_id: &str, stream_sequence: u64) -> String {
        format!("{job_id}:outcome:{stream_sequence}")
    }
    /// The job message's stream sequence an [`outcome`] id names; `None` for another id.
    pub fn outcome_sequence(message_id: &str) -> Option<u64> {
        message_id.rsplit_once(":outcome:").and_then(|(_, sequence)| sequence.parse().ok())
    }
    /// A job's cancellation, claimed over the outcome at sequence `after` (0: none), so a
    /// later request of the job can be cancelled again inside the duplicate window.
    pub fn cancel(project: &str, job_id: &str, after: u64) -> String {
        format!("{}:cancel:{after}", job(project, job_id))
    }
    /// A job submitted again (`shotfleet submit --again`) after its outcome at sequence
    /// `after` failed or cancelled it: once per such outcome, however often it is asked.
    pub fn again(project: &str, job_id: &str, after: u64) -> String {
        format!("{}:again:{after}", job(project, job_id))
    }
    /// A job re-published by a worker from `auto` (or a wrong class) to its class subject, from
    /// its message at `from` (the stream sequence): a redelivery of that message publishes
    /// nothing twice, and a later request of the job (a replay, `submit --again`) is a copy of
    /// its own, not a duplicate dropped with the job in it.
    pub fn route(project: &str, job_id: &str, from: u64) -> String {
        format!("{}:route:{from}", job(project, job_id))
    }
    /// A job re-published one rung down the degrade ladder from its message at `from`, as
    /// [`route`].
    pub fn degrade(project: &str, job_id: &str, level: u32, from: u64) -> String {
        format!("{}:deg:{level}:{from}", job(project, job_id))
    }
    /// A failed record of the job message at `stream_sequence`.
    pub fn failed(job_id: &str, stream_sequence: u64) -> String {
        format!("{job_id}:failed:{stream_sequence}")
    }
    /// A failed record of a payload without a valid job id.
    pub fn failed_unnamed(stream_sequence: u64) -> String {
        format!("seq-{stream_sequence}:failed")
    }
    /// A job replayed from the failed stream, the `n`th time.
    pub fn replay(job_id: &str, n: u64) -> String {
        format!("{job_id}:replay:{n}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_subjects_round_trip() {
        let s = job(Priority::P1, SubjectClass::Class(MemoryClass::M), "acme");
        assert_eq!(s, "shots.p1.m.acme");
        let parsed = parse_job(&s).unwrap();
        assert_eq!(parsed.priority, Priority::P1);
        assert_eq!(parsed.class, SubjectClass::Class(MemoryClass::M));
        assert_eq!(parsed.project, "acme");
        assert_eq!(parse_job("shots.p2.auto.x").unwrap().class, SubjectClass::Auto);
    }

    #[test]
    fn an_outcome_id_names_the_message_it_settles() {
        assert_eq!(msg_id::outcome_sequence(&msg_id::outcome("ep1-s1", 42)), Some(42));
        assert_eq!(msg_id::outcome_sequence(&msg_id::cancel("acme", "ep1-s1", 42)), None);
    }

    #[test]
    fn bad_job_subjects_name_the_part() {
        assert!(parse_job("shots.p3.m.acme").unwrap_err().contains("p3"));
        assert!(parse_job("shots.p0.huge.acme").unwrap_err().contains("huge"));
        assert!(parse_job("shots.p0.m").unwrap_err().contains("four parts"));
        assert!(parse_job("jobs.p0.m.acme").unwrap_err().contains("start with"));
    }

    #[test]
    fn stream_subjects_do_not_overlap() {
        // `shots.done.a.b` has four tokens like a job subject: the jobs stream must not take it.
        for s in jobs_stream_subjects() {
            assert!(!s.starts_with("shots.done") && !s.starts_with("shots.failed"));
        }
        // One subject per render consumer: 3 priorities x (5 classes + auto).
        let subjects = jobs_stream_subjects();
        assert_eq!(subjects.len(), 18);
        assert!(subjects.contains(&"shots.p0.auto.*".to_owned()));
        assert!(!subjects.iter().any(|s| s.ends_with('>')));
        assert_eq!(parse_failed(&failed(Priority::P2, "acme")).unwrap(), (Priority::P2, "acme".into()));
    }
}
