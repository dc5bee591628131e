//! Asking every worker for its state: a request on [`PING_SUBJECT`] whose answers
//! ([`WorkerState`]) arrive on one inbox. `shotfleet status` uses it to show the fleet, a worker
//! to learn which classes any live worker serves.

use std::time::Duration;

use futures::StreamExt;

use crate::progress::{PING_SUBJECT, WorkerState};

/// The answers that arrive within `wait`.
///
/// # Errors
/// The NATS client's failure to subscribe or publish.
pub async fn ping(client: &async_nats::Client, wait: Duration) -> Result<Vec<WorkerState>, String> {
    let inbox = client.new_inbox();
    let mut answers = client.subscribe(inbox.clone()).await.map_err(|e| e.to_string())?;
    client.publish_with_reply(PING_SUBJECT, inbox, Default::default()).await.map_err(|e| e.to_string())?;
    let mut states = Vec::new();
    let deadline = tokio::time::Instant::now() + wait;
    while let Ok(Some(message)) = tokio::time::timeout_at(deadline, answers.next()).await {
        if let Ok(state) = serde_json::from_slice::<WorkerState>(&message.payload) {
            states.push(state);
        }
    }
    Ok(states)
}
