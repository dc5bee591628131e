//! One GPU's worker process: start it, pass its log on, restart it as the policy says, and stop
//! it with the box.
//!
//! A worker runs in a process group of its own, so a terminal's Ctrl-C reaches the supervisor
//! alone and the supervisor stops every worker in order (SIGTERM, then its grace period and the
//! drain). A worker also gets SIGTERM when the supervisor dies (`PR_SET_PDEATHSIG`), so a killed
//! supervisor leaves no worker taking jobs unsupervised.
//!
//! Its log lines (stderr) are passed on whole, each marked with its GPU: a JSON line gains a
//! `"gpu"` field, a plain one a `gpu0 | ` prefix.

use std::io::Write;
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStderr, Command};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::plan::WorkerCommand;
use super::policy::{Decision, Exit, RestartPolicy};
use super::status::BoxStatus;

/// After its grace period a worker still cancels its jobs (naked at once), flushes and drains
/// its NATS connection (at most 5 s): it is killed only after this much more.
pub const DRAIN_ALLOWANCE: Duration = Duration::from_secs(15);
/// The longest a log line kept for the status may be.
const KEPT_LINE: usize = 600;

/// One GPU's worker, as the supervisor runs it.
#[derive(Debug, Clone)]
pub struct Supervised {
    /// Its row in the box's status.
    pub index: usize,
    /// `gpuN`.
    pub label: String,
    pub command: WorkerCommand,
    /// Its `grace_period`.
    pub grace: Duration,
    /// How long after the grace period it is killed ([`DRAIN_ALLOWANCE`]).
    pub drain: Duration,
}

/// How supervising a worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The box stopped it.
    Stopped,
    /// It exited in a way a restart cannot mend.
    LeftStopped(Exit),
}

/// Runs `worker` until `stop` (then stops it within its grace period and the drain) or until it
/// exits in a way `policy` does not restart.
pub async fn supervise(worker: Supervised, policy: RestartPolicy, status: BoxStatus, stop: CancellationToken) -> Ended {
    let mut quick_exits = 0;
    loop {
        if stop.is_cancelled() {
            return Ended::Stopped;
        }
        let started = Instant::now();
        let (exit, last_line) = match spawn(&worker.command) {
            Ok(mut child) => {
                let pid = child.id();
                let log = child.stderr.take().map(|stderr| pass_on(stderr, worker.label.clone()));
                status.started(worker.index, pid);
                info!(gpu = %worker.label, pid, "worker started");
                let waited = tokio::select! {
                    waited = child.wait() => Some(waited),
                    () = stop.cancelled() => None,
                };
                let Some(waited) = waited else {
                    status.stopping(worker.index);
                    let exit = terminate(&mut child, worker.grace + worker.drain, &worker.label).await;
                    status.exited(worker.index, exit, last_line(log).await, None);
                    info!(gpu = %worker.label, %exit, "worker stopped");
                    return Ended::Stopped;
                };
                (waited.map_or(Exit::Code(-1), Exit::from), last_line(log).await)
            }
            // Exec failed (the binary replaced under us, say): as a crash, restarted with backoff.
            Err(e) => (Exit::Code(127), Some(format!("cannot start {}: {e}", worker.command.program.display()))),
        };
        if !policy.quick(started.elapsed()) {
            quick_exits = 0;
        }
        let decision = policy.decide(exit, quick_exits);
        status.exited(worker.index, exit, last_line.clone(), Some(decision));
        match decision {
            Decision::LeaveStopped { why } => {
                error!(gpu = %worker.label, %exit, why, last_line = last_line.as_deref().unwrap_or(""), "worker stopped for good: not restarting it");
                return Ended::LeftStopped(exit);
            }
            Decision::Restart { after } => {
                warn!(gpu = %worker.label, %exit, restart_in_s = after.as_secs_f64(), last_line = last_line.as_deref().unwrap_or(""), "worker exited: restarting it");
                quick_exits += 1;
                tokio::select! {
                    () = tokio::time::sleep(after) => {}
                    () = stop.cancelled() => return Ended::Stopped,
                }
            }
        }
    }
}

fn spawn(command: &WorkerCommand) -> std::io::Result<Child> {
    let mut process = Command::new(&command.program);
    process
        .args(&command.args)
        .envs(command.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    for name in &command.env_remove {
        process.env_remove(name);
    }
    let supervisor = nix::unistd::getpid();
    // SAFETY: between fork and exec only async-signal-safe calls run: prctl(2) and getppid(2).
    // The death signal follows the thread that forks; this runs on a runtime thread, which lives
    // as long as the supervisor (not a blocking-pool thread, which may end while idle).
    unsafe {
        process.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGTERM).map_err(std::io::Error::from)?;
            // The supervisor died before the signal was armed: nothing would stop this worker.
            if nix::unistd::getppid() != supervisor {
                return Err(std::io::Error::other("the supervisor is gone"));
            }
            Ok(())
        });
    }
    process.spawn()
}

/// SIGTERM, then up to `limit` (its grace period and the drain); SIGKILL after that.
async fn terminate(child: &mut Child, limit: Duration, label: &str) -> Exit {
    if let Some(pid) = child.id().and_then(|pid| i32::try_from(pid).ok()) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
    }
    match tokio::time::timeout(limit, child.wait()).await {
        Ok(Ok(status)) => Exit::from(status),
        _ => {
            warn!(gpu = label, waited_s = limit.as_secs_f64(), "worker still running after its grace period and drain: killing it");
            let _ = child.start_kill();
            child.wait().await.map_or(Exit::Signal(9), Exit::from)
        }
    }
}

/// Passes the worker's log lines on to the supervisor's stderr, each marked with `label`; ends
/// with the worker's stderr, returning what it said last of why it stopped ([`LastWords`]).
fn pass_on(stderr: ChildStderr, label: String) -> JoinHandle<Option<String>> {
    tokio::spawn(async move {
        let mut lines = BufReader::new(stderr).split(b'\n');
        let mut last = LastWords::default();
        while let Ok(Some(line)) = lines.next_segment().await {
            let marked = mark(&line, &label);
            // One write per line under the lock: lines of several workers never interleave.
            let _ = std::io::stderr().lock().write_all(&marked);
            last.hear(&String::from_utf8_lossy(&line));
        }
        last.best()
    })
}

/// The worker's last words: its exit message (the program's `shotfleet-consumer: ...`, printed
/// as it exits), else its last error line, else its last line. Library threads may still log
/// after the exit message (the NATS client's "event: closed"), so the last line alone is not it.
#[derive(Debug, Default)]
struct LastWords {
    exit: Option<String>,
    error: Option<String>,
    line: Option<String>,
}

impl LastWords {
    fn hear(&mut self, line: &str) {
        let line = line.trim();
        if line.is_empty() {
            return;
        }
        let kept = match line.char_indices().nth(KEPT_LINE) {
            Some((cut, _)) => format!("{}...", &line[..cut]),
            None => line.to_owned(),
        };
        if let Some(message) = kept.strip_prefix("shotfleet-consumer: ") {
            self.exit = Some(message.to_owned());
        } else if line.contains("\"level\":\"ERROR\"") || (!line.starts_with('{') && line.contains("ERROR")) {
            self.error = Some(kept.clone());
        }
        self.line = Some(kept);
    }

    fn best(self) -> Option<String> {
        self.exit.or(self.error).or(self.line)
    }
}

/// The last line the worker logged, once its stderr closed (a process that outlived it holding
/// the pipe open is not waited for).
async fn last_line(log: Option<JoinHandle<Option<String>>>) -> Option<String> {
    let log = log?;
    tokio::time::timeout(Duration::from_secs(2), log).await.ok()?.ok()?
}

/// `line` marked with its GPU, newline-terminated: `{"gpu":"gpu0",...}` for a JSON object's
/// line, `gpu0 | ...` for any other.
fn mark(line: &[u8], label: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(line.len() + label.len() + 12);
    match line.strip_prefix(b"{") {
        Some(rest) if rest.first() == Some(&b'"') => {
            out.extend_from_slice(format!("{{\"gpu\":\"{label}\",").as_bytes());
            out.extend_from_slice(rest);
        }
        _ => {
            out.extend_from_slice(format!("{label} | ").as_bytes());
            out.extend_from_slice(line);
        }
    }
    out.push(b'\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::status::Phase;

    /// A "worker" that is a shell script: real processes, real exits and signals.
    fn shell(script: &str, dir: &std::path::Path) -> Supervised {
        let command = WorkerCommand {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            env: vec![("STATE".into(), dir.display().to_string())],
            env_remove: vec![],
        };
        Supervised { index: 0, label: "gpu0".into(), command, grace: Duration::from_millis(300), drain: Duration::from_millis(200) }
    }

    fn quick_policy() -> RestartPolicy {
        RestartPolicy {
            backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(80),
            store_backoff: Duration::from_millis(50),
            stable_after: Duration::from_secs(60),
        }
    }

    #[tokio::test]
    async fn driver_faults_are_restarted_and_bad_configuration_is_left_stopped() {
        let dir = tempfile::tempdir().unwrap();
        // Exits 75 twice (a driver fault), then 2 (bad configuration).
        let script = r#"n=$(cat "$STATE/runs" 2>/dev/null || echo 0); echo $((n + 1)) > "$STATE/runs"
            if [ "$n" -ge 2 ]; then echo "configuration: model: no model folder given" >&2; exit 2; fi
            echo "driver fault: CUDA failure 999" >&2; exit 75"#;
        let status = BoxStatus::for_tests(1);
        let ended = supervise(shell(script, dir.path()), quick_policy(), status.clone(), CancellationToken::new()).await;
        assert_eq!(ended, Ended::LeftStopped(Exit::Code(2)));
        assert_eq!(std::fs::read_to_string(dir.path().join("runs")).unwrap().trim(), "3");
        let gpu = &status.snapshot()[0];
        assert_eq!((gpu.phase, gpu.restarts, gpu.pid), (Phase::LeftStopped, 2, None));
        assert_eq!(gpu.last_exit.as_deref(), Some("exit 2 (bad config)"));
        assert_eq!(gpu.last_error.as_deref(), Some("configuration: model: no model folder given"));
        let (ready, text) = status.readyz();
        assert!(!ready);
        assert!(text.contains("stopped, not restarted (bad configuration: fix it, then restart the box) after exit 2"), "{text}");
    }

    /// Runs `script` (which touches `$STATE/up` once it is up), then stops the box: the status,
    /// and how long the stop took.
    async fn stopped_once_up(script: &str) -> (BoxStatus, Duration) {
        let dir = tempfile::tempdir().unwrap();
        let status = BoxStatus::for_tests(1);
        let stop = CancellationToken::new();
        let task = tokio::spawn(supervise(shell(script, dir.path()), quick_policy(), status.clone(), stop.clone()));
        while !dir.path().join("up").exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let asked = Instant::now();
        stop.cancel();
        assert_eq!(task.await.unwrap(), Ended::Stopped);
        (status, asked.elapsed())
    }

    #[tokio::test]
    async fn the_stop_reaches_the_worker_as_sigterm_and_its_exit_is_waited_for() {
        let script = r#"trap 'echo "got SIGTERM" >&2; kill $!; exit 0' TERM; sleep 30 & touch "$STATE/up"; wait"#;
        let (status, took) = stopped_once_up(script).await;
        assert!(took < Duration::from_millis(400), "it exited by itself, inside its grace period: {took:?}");
        let gpu = &status.snapshot()[0];
        assert_eq!((gpu.phase, gpu.restarts), (Phase::Stopping, 0));
        assert_eq!((gpu.last_exit.as_deref(), gpu.last_error.as_deref()), (Some("exit 0 (stopped)"), Some("got SIGTERM")));
    }

    #[tokio::test]
    async fn a_worker_still_running_after_its_grace_period_and_drain_is_killed() {
        let (status, took) = stopped_once_up(r#"trap '' TERM; touch "$STATE/up"; while :; do sleep 0.05; done"#).await;
        assert!(took >= Duration::from_millis(500) && took < Duration::from_secs(3), "grace 300 ms + drain 200 ms, then SIGKILL: {took:?}");
        assert_eq!(status.snapshot()[0].last_exit.as_deref(), Some("killed by signal 9"));
    }

    #[test]
    fn the_last_words_are_the_exit_message_then_the_last_error() {
        let mut words = LastWords::default();
        for line in [
            r#"{"level":"INFO","fields":{"message":"probe render"}}"#,
            r#"{"level":"ERROR","fields":{"message":"worker stopped","error":"this card holds nothing"}}"#,
            "shotfleet-consumer: this card holds nothing this worker may serve",
            r#"{"level":"INFO","fields":{"message":"event: closed"},"target":"async_nats"}"#,
            "",
        ] {
            words.hear(line);
        }
        assert_eq!(words.best().as_deref(), Some("this card holds nothing this worker may serve"));
        let mut crashed = LastWords::default();
        crashed.hear(r#"{"level":"ERROR","fields":{"message":"render failed"}}"#);
        crashed.hear(r#"{"level":"INFO","fields":{"message":"event: closed"}}"#);
        assert_eq!(crashed.best().as_deref(), Some(r#"{"level":"ERROR","fields":{"message":"render failed"}}"#));
        let mut plain = LastWords::default();
        plain.hear("thread 'main' panicked at src/x.rs:1:1");
        assert_eq!(plain.best().as_deref(), Some("thread 'main' panicked at src/x.rs:1:1"));
    }

    #[test]
    fn log_lines_are_marked_with_their_gpu() {
        let json = mark(br#"{"timestamp":"t","level":"INFO","fields":{"message":"taking jobs"}}"#, "gpu1");
        let parsed: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(parsed["gpu"], "gpu1");
        assert_eq!(parsed["fields"]["message"], "taking jobs");
        assert_eq!(mark(b"shotfleet-consumer: driver fault", "gpu0"), b"gpu0 | shotfleet-consumer: driver fault\n");
        assert_eq!(mark(b"{}", "gpu0"), b"gpu0 | {}\n");
    }
}
