//! Readiness as the worker declares it, read by `/readyz`.

use std::sync::{Arc, PoisonError, RwLock};

/// Whether this worker should be sent work. Cheap to clone; every clone shares one state.
///
/// Starts not ready (`starting`). The worker calls [`set_ready`](Self::set_ready) once its models
/// are loaded and a probe render passed, [`set_not_ready`](Self::set_not_ready) when it stops
/// fetching for a while (a driver fault, a session rebuild), and [`set_draining`](Self::set_draining)
/// on shutdown. Draining is final: a late `set_ready` from a task still finishing must not put a
/// stopping worker back in rotation.
#[derive(Debug, Clone)]
pub struct Health {
    state: Arc<RwLock<State>>,
    /// Shown after the state: which classes the worker serves, and why not the others.
    detail: Arc<RwLock<String>>,
    /// The worker's NATS connection once it has one: a ready worker cut off from the server
    /// takes no jobs and commits none, so it is not ready until the client reconnects.
    nats: Arc<RwLock<Option<async_nats::Client>>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    NotReady(String),
    Ready,
    Draining,
}

impl Default for Health {
    fn default() -> Self {
        Self::new()
    }
}

impl Health {
    pub fn new() -> Self {
        Self { state: Arc::new(RwLock::new(State::NotReady("starting".into()))), detail: Arc::default(), nats: Arc::default() }
    }

    /// Readiness follows `client`'s connection from now on.
    pub fn watch_connection(&self, client: async_nats::Client) {
        *self.nats.write().unwrap_or_else(PoisonError::into_inner) = Some(client);
    }

    /// Lines `/readyz` shows after its first, ready or not (`m: not served (...)`).
    pub fn set_detail(&self, detail: impl Into<String>) {
        *self.detail.write().unwrap_or_else(PoisonError::into_inner) = detail.into();
    }

    pub fn detail(&self) -> String {
        self.detail.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub fn set_ready(&self) {
        self.update(State::Ready);
    }

    /// `reason` is shown by `/readyz`: say what is missing, e.g. `loading models`.
    pub fn set_not_ready(&self, reason: impl Into<String>) {
        self.update(State::NotReady(reason.into()));
    }

    pub fn set_draining(&self) {
        self.update(State::Draining);
    }

    /// `Ok` when ready, else why not.
    pub fn readiness(&self) -> Result<(), String> {
        let connected = || {
            let nats = self.nats.read().unwrap_or_else(PoisonError::into_inner);
            nats.as_ref().is_none_or(|client| client.connection_state() == async_nats::connection::State::Connected)
        };
        match &*self.state.read().unwrap_or_else(PoisonError::into_inner) {
            State::Ready if !connected() => Err("not ready: disconnected from NATS; reconnecting".into()),
            State::Ready => Ok(()),
            State::NotReady(reason) => Err(format!("not ready: {reason}")),
            State::Draining => Err("draining: shutting down".into()),
        }
    }

    fn update(&self, next: State) {
        // A panic elsewhere while holding the lock leaves a valid state; keep serving it.
        let mut state = self.state.write().unwrap_or_else(PoisonError::into_inner);
        if *state != State::Draining {
            *state = next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_not_ready_then_follows_the_worker() {
        let health = Health::new();
        assert_eq!(health.readiness(), Err("not ready: starting".into()));
        let clone = health.clone();
        clone.set_ready();
        assert_eq!(health.readiness(), Ok(()));
        clone.set_not_ready("rebuilding sessions");
        assert_eq!(health.readiness(), Err("not ready: rebuilding sessions".into()));
    }

    #[test]
    fn the_detail_is_kept_whatever_the_state() {
        let health = Health::new();
        assert_eq!(health.detail(), "");
        health.set_detail("xs: served\nm: not served (over budget)");
        health.set_ready();
        assert_eq!(health.detail(), "xs: served\nm: not served (over budget)");
    }

    #[test]
    fn draining_is_final() {
        let health = Health::new();
        health.set_ready();
        health.set_draining();
        health.set_ready();
        health.set_not_ready("x");
        assert_eq!(health.readiness(), Err("draining: shutting down".into()));
    }
}
