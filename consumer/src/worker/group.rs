//! Cross-job batching: compatible jobs (same size, steps and guidance, the same LoRA set) dealt
//! to one slot (reserve.rs) are rendered in shared UNet batches when the budget holds all their
//! images at once, the main throughput lever on large cards. Each job is still committed, and
//! acked, on its own. Should taking them tell them apart after all (a LoRA replaced in the
//! library meanwhile), they render as several groups, those whose set is on the device first:
//! the others may push it off.
//!
//! Anything unusual falls back to rendering the jobs one by one (each through its own degrade
//! ladder): no room for the whole group, its set not placed, or any error in the shared render.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use shotfleet_schema::ShotJob;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::pipeline::lora::SetKey;
use crate::pipeline::{CancelHandle, RenderControl, RenderRequest};
use crate::worker::Shared;
use crate::worker::delivery::Kept;
use crate::worker::Slot;
use crate::worker::job::{self, Next, Taken, commit_output, finish};
use crate::worker::progress::{self, Reporter};
use crate::worker::render::{AbortOnDrop, Rendered, render_request, stop_at};
use crate::worker::run_thread::on_run_thread;

/// What jobs sharing UNet batches need alike: one schedule, one guidance scale, one image size,
/// one LoRA set `S` (every render of a batch binds the same weights). The reserve deals by the
/// LoRAs a job names (`ShotJob::lora_set`), before the library is read; a taken job's set is
/// what those names resolved to ([`Compatible`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Batch<S> {
    pub width: u32,
    pub height: u32,
    pub steps: u32,
    pub guidance_bits: u32,
    pub set: S,
}

impl<S> Batch<S> {
    pub fn of(job: &ShotJob, set: S) -> Self {
        Self { width: job.width, height: job.height, steps: job.steps, guidance_bits: job.guidance.to_bits(), set }
    }
}

/// Taken jobs that can share UNet batches.
type Compatible = Batch<SetKey>;

impl Compatible {
    fn of_taken(taken: &Taken) -> Self {
        Self::of(taken.job(), taken.set.as_ref().map(|set| set.key.clone()).unwrap_or_default())
    }
}

/// The groups in the order they render: those whose set is on the device first (`resident`
/// asks of a group's first member), otherwise as given.
fn resident_first<T>(groups: impl IntoIterator<Item = Vec<T>>, resident: impl Fn(&T) -> bool) -> Vec<Vec<T>> {
    let mut groups: Vec<Vec<T>> = groups.into_iter().filter(|members| !members.is_empty()).collect();
    groups.sort_by_key(|members| !resident(&members[0]));
    groups
}

/// Handles deliveries dealt to one slot together: each to the end, compatible ones rendered as one group.
/// Every member is kept alive from its fetch until it is settled, also while it waits for the
/// others to be taken. What is rendered commits beside the renders that follow (as many
/// commits at once as renders), and the render `slot` is given back after the last render, not
/// after the last commit: the next jobs render while these upload, as a job alone does
/// ([`job::render_and_commit`]).
pub(crate) async fn handle(shared: Arc<Shared>, deliveries: Vec<Kept>, slot: Slot) {
    let mut groups: BTreeMap<Compatible, Vec<Taken>> = BTreeMap::new();
    for kept in deliveries {
        let (taken, next) = job::take(&shared, kept).await;
        match next {
            Next::Render => groups.entry(Compatible::of_taken(&taken)).or_default().push(taken),
            Next::Settle(handled) => finish(&shared, &taken, handled).await,
        }
    }
    let mut commits = Vec::new();
    for members in resident_first(groups.into_values(), |taken: &Taken| shared.loras.is_resident(taken.set.as_ref())) {
        let members = match members.len() {
            1 => members,
            _ => match render_together(&shared, members).await {
                Ok(rendered) => {
                    commits.push(committing(&shared, rendered).await);
                    continue;
                }
                Err(members) => members,
            },
        };
        for taken in members {
            match job::render_taken(&shared, &taken).await {
                Ok(rendered) => commits.push(committing(&shared, vec![(taken, rendered)]).await),
                Err(handled) => finish(&shared, &taken, handled).await,
            }
        }
    }
    drop(slot);
    for commit in commits {
        if let Err(e) = commit.await {
            warn!(error = %e, "a commit task of the group ended abnormally");
        }
    }
}

/// Commits and settles rendered jobs in order, in a task of their own once a commit permit is
/// free (the permit bounds what waits rendered, as in [`job::render_and_commit`]).
async fn committing(shared: &Arc<Shared>, rendered: Vec<(Taken, Rendered)>) -> tokio::task::JoinHandle<()> {
    let permit = shared.commits.clone().acquire_owned().await;
    let shared = shared.clone();
    tokio::spawn(async move {
        let _committing = permit;
        for (taken, Rendered { output, elapsed }) in rendered {
            let handled = commit_output(&shared, &taken, output, elapsed).await;
            finish(&shared, &taken, handled).await;
        }
    })
}

/// Renders the members in shared batches with their set, each member with its own output. The
/// members back when nothing was rendered (no room for the group, its set not placed, or the
/// shared render failed): the caller renders them one by one, each settling its own error.
async fn render_together(shared: &Arc<Shared>, members: Vec<Taken>) -> Result<Vec<(Taken, Rendered)>, Vec<Taken>> {
    let first = members[0].job();
    let images: u32 = members.iter().map(|taken| taken.job().images).sum();
    let Ok(pending) = shared.loras.pending(shared, members[0].set.as_ref()).await else {
        return Err(members);
    };
    let Ok(Some(mut reservation)) = shared.budget.reserve(first.width, first.height, images, pending.bytes()) else {
        return Err(members);
    };
    let Ok(set) = shared.loras.place(shared, pending, &mut reservation).await else {
        return Err(members);
    };
    let requests: Vec<RenderRequest> = members.iter().map(|taken| render_request(taken.job(), images)).collect();
    let control = RenderControl { cancel: CancelHandle::new(), ..RenderControl::default() };
    let timed_out = Arc::new(AtomicBool::new(false));
    let (any_settled, _watching) = any_settled(&members);
    let stopper = stop_at(shared, Instant::now() + shared.config.job_time_limit, &control.cancel, &timed_out, &any_settled);
    let mut offset = 0;
    let (steps, _publishers): (Vec<_>, Vec<_>) = members
        .iter()
        .filter_map(|taken| {
            let images = taken.job().images;
            offset += images;
            let (steps, publisher) = taken.reporter.as_ref().map(Reporter::steps)?;
            Some((steps.in_group(offset - images, images), publisher))
        })
        .unzip();
    let pipeline = shared.pipeline();
    let started = Instant::now();
    let runs = pipeline.clone();
    let rendered = on_run_thread(&runs, move || {
        pipeline.render_with_loras(&requests, set.as_deref(), &control, &mut progress::callback(&steps))
    })
    .await;
    drop(stopper);
    drop(reservation);
    let outputs = match rendered {
        Ok(Ok(outputs)) => outputs,
        Ok(Err(e)) if !timed_out.load(Ordering::Relaxed) && !shared.abort.is_cancelled() => {
            warn!(jobs = members.len(), error = %e, "rendering the group failed; rendering its jobs one by one");
            return Err(members);
        }
        _ => return Err(members),
    };
    let elapsed = started.elapsed();
    info!(jobs = members.len(), images, width = first.width, height = first.height, elapsed_ms = elapsed.as_millis() as u64, "rendered a group");
    Ok(members.into_iter().zip(outputs).map(|(taken, output)| (taken, Rendered { output, elapsed })).collect())
}

/// A token that fires when any member is settled elsewhere (a cancellation): the shared render
/// stops, and the members left are rendered one by one (the settled one is not).
fn any_settled(members: &[Taken]) -> (CancellationToken, AbortOnDrop) {
    let any = CancellationToken::new();
    let watched: Vec<_> = members.iter().map(|taken| taken.watch.settled.clone()).collect();
    let fire = any.clone();
    let task = tokio::spawn(async move {
        futures::future::select_all(watched.iter().map(|token| Box::pin(token.cancelled()))).await;
        fire.cancel();
    });
    (any, AbortOnDrop::new(task))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_whose_set_is_on_the_device_go_first_in_their_order() {
        // Members named by whether their set is resident, and a number for the order.
        let groups = vec![vec![(false, 1)], vec![(true, 2), (true, 3)], vec![(false, 4)], vec![(true, 5)]];
        let order: Vec<Vec<u32>> =
            resident_first(groups, |member| member.0).into_iter().map(|g| g.into_iter().map(|m| m.1).collect()).collect();
        assert_eq!(order, [vec![2, 3], vec![5], vec![1], vec![4]]);
    }
}
