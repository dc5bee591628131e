//! Graph runs go through the pipeline's own threads, never tokio's blocking pool.
//!
//! ONNX Runtime's CUDA provider keeps memory per calling thread for as long as the session
//! lives. On the H200 (2026-12-02, deploy/gpu/RESULTS.md, "588 MiB a thread") each worker's
//! memory outside its arenas rose by 586-602 MiB every time a render ran on a thread no render
//! had run on before: four times in each of three workers over 333 jobs, on tokio's blocking
//! pool, whose idle threads exit after ten seconds and come back as new ones. On the
//! pipeline's fixed threads ([`Pipeline::spawn_run`]) that memory is paid once per thread, while
//! the model loads (each thread runs one tiny render then), so the floor the budget plans with
//! and the leak guard's baseline already hold it.

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::pipeline::Pipeline;

/// Runs `work` on one of `pipeline`'s run threads and waits for it without holding up the
/// async threads. A panic in `work` comes back as the error, with its message.
pub(crate) async fn on_run_thread<T: Send + 'static>(pipeline: &Pipeline, work: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    let (done, result) = tokio::sync::oneshot::channel();
    pipeline.spawn_run(move || {
        // Nobody waits any more when the caller was dropped: the result goes nowhere.
        let _ = done.send(catch_unwind(AssertUnwindSafe(work)));
    });
    match result.await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(panic)) => Err(panic_message(panic.as_ref())),
        Err(_) => Err("the run thread ended before the work did".to_owned()),
    }
}

/// Runs `work`, which waits for graph runs it hands to the run threads itself
/// ([`Pipeline::shrink_arenas`]), on tokio's blocking pool: the waiting happens there, out of the
/// run threads' way, and the runs on them. A panic in `work` comes back as the error.
pub(crate) async fn waiting_on_run_threads<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    match tokio::task::spawn_blocking(move || catch_unwind(AssertUnwindSafe(work))).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(panic)) => Err(panic_message(panic.as_ref())),
        Err(e) => Err(format!("the waiting task ended before the work did: {e}")),
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic.downcast_ref::<&str>().copied().or_else(|| panic.downcast_ref::<String>().map(String::as_str));
    format!("panicked: {}", text.unwrap_or("(no message)"))
}

#[cfg(test)]
mod tests {
    use super::panic_message;

    #[test]
    fn a_panics_message_is_kept() {
        let panic = std::panic::catch_unwind(|| panic!("boom {}", 7)).unwrap_err();
        assert_eq!(panic_message(panic.as_ref()), "panicked: boom 7");
        let panic = std::panic::catch_unwind(|| std::panic::panic_any(3_u8)).unwrap_err();
        assert_eq!(panic_message(panic.as_ref()), "panicked: (no message)");
    }
}
