//! `shotfleet`: set up the topology, submit storyboards, wait for them, show the queues, replay
//! failed jobs, cancel jobs, and make a project's contact sheet.
//!
//! Exit codes: 0 success; 1 some jobs failed (with `--wait`), some failed records could not be
//! replayed, or some jobs to cancel are unknown or could not be cancelled; 2 bad input (the file,
//! flags, connection settings); 3 NATS unreachable, the server refused, or no worker answered;
//! 124 `submit --wait --timeout` ran out with jobs still waiting (as `timeout(1)` exits).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use shotfleet_producer::wait::{Awaited, Outcome};
use shotfleet_producer::{cancel, fleet, gallery, grouping, live, lora, replay, status, storyboard, submit, wait, watch};
use shotfleet_schema::cancel::Selection;
use shotfleet_schema::encoding::ContentType;
use shotfleet_schema::failure::FailureReason;
use shotfleet_schema::nats::{NatsArgs, NatsOptions, Topology};
use shotfleet_schema::Limits;

#[derive(Parser)]
#[command(name = "shotfleet", version, about = "Render storyboard shots on a fleet of GPU workers")]
struct Cli {
    #[command(flatten)]
    nats: NatsArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create the streams and consumers (idempotent; reports differences, never clobbers).
    Setup(SetupArgs),
    /// Publish a storyboard (JSON Lines or CSV), one job a line.
    Submit(SubmitArgs),
    /// Pending, in-progress and oldest job per priority and class; failed records; live workers.
    Status(StatusArgs),
    /// Cancel jobs: queued ones are removed, running ones stop at their next step.
    #[command(after_long_help = CANCEL_HELP)]
    Cancel(CancelArgs),
    /// A project's contact sheet: one HTML page of its shots (thumbnails, parameters, outcome).
    Gallery(GalleryArgs),
    /// Republish failed jobs from SHOTS_FAILED to their original subjects (--dry-run lists them).
    #[command(after_long_help = REPLAY_HELP)]
    Replay(ReplayArgs),
    /// The LoRA library the workers read: check and upload a LoRA file, list what is there.
    #[command(subcommand)]
    Lora(LoraCommand),
}

#[derive(Subcommand)]
enum LoraCommand {
    /// Check a LoRA file (safetensors, made for SDXL, within the size cap) and upload it as NAME.
    Push(LoraPushArgs),
    /// The library's LoRAs: name, format, rank, layers, size, sha256, age.
    List(LibraryArgs),
}

#[derive(Args)]
struct LibraryArgs {
    /// The image store the workers use: file:///folder or s3://bucket/prefix (S3 endpoint,
    /// region and credentials from AWS_*; AWS_ALLOW_HTTP=true for a plain-HTTP endpoint).
    #[arg(long, env = "SHOTFLEET_STORE")]
    store: String,
    /// The library's folder under the store (the workers' `[lora] prefix`).
    #[arg(long, env = "SHOTFLEET_LORA_PREFIX", default_value = shotfleet_schema::lora::library::DEFAULT_PREFIX)]
    prefix: String,
}

#[derive(Args)]
struct LoraPushArgs {
    /// The LoRA file (.safetensors; kohya/A1111/ComfyUI or diffusers/PEFT keys).
    file: PathBuf,
    /// The name jobs give in `loras[].name`: letters, digits, `_`, `-`, `.`.
    #[arg(long)]
    name: String,
    /// Replace a different LoRA already pushed under NAME (jobs naming it change look).
    #[arg(long)]
    replace: bool,
    /// Refuse larger files, MiB (the workers' `[lora] max_file_mib`).
    #[arg(long, default_value_t = shotfleet_schema::lora::DEFAULT_MAX_BYTES >> 20)]
    max_mib: u64,
    #[command(flatten)]
    library: LibraryArgs,
}

const REPLAY_HELP: &str = "\
Each matching record's payload goes back, byte for byte and with its Content-Type (but for the
kinds of record below), to the subject it was taken from (Shotfleet-Original-Subject), with
Nats-Msg-Id <job>:replay:<seq> (seq: the record's sequence in SHOTS_FAILED). The failed copy is
deleted only after the server acknowledged the publish. Interrupting a replay is safe: rerun it. A job the interrupted run had queued is a
duplicate inside the duplicate window (20 min by default): it is not queued twice, only its failed
copy is deleted. (Rerun later than that and the job is queued a second time; a worker that finds
its result already published skips it.)

Each record's job's last outcome is read first (a warning says so when it cannot be):
- a job rendered since is not replayed (a worker would settle its replay without rendering it),
  and its record is deleted, as a worker deletes the record of a job another one finished;
- a job cancelled after it failed is skipped: `submit --again` renders it anew;
- a job that failed after the degrade ladder lowered it goes back at the size and steps its
  producer asked for, to that size's subject (a line after the table says so): a replay is a new
  try, and the ladder lowers it again if it must.

Records without a job id (their payload could not be decoded; reason invalid) are kept unless
their reason is asked for with --reason (e.g. --reason invalid): then they are published as they
are, with Nats-Msg-Id seq-<seq>:replay:<seq>; a worker decodes them again, and an unchanged
payload fails again as invalid.

A record whose original subject is missing or not a job subject (shots.<prio>.<class>.<project>)
is kept and reported. Exit code 1 when any matching record could not be replayed.";

const CANCEL_HELP: &str = "\
Every job named (or, with no JOB, every unfinished job of the project, or of --shot) ends with one
outcome of status `cancelled` on shots.done.<project>.<job>, so `submit --wait` and every other
client see it end. A worker of the fleet answers the request: it claims that outcome, removes the
job's queued copies from SHOTS, and the worker rendering it stops at its next step and deletes what
it uploaded. A job that already finished is left as it is, and said so; a job named here that
failed is cancelled over its failure (its record stays in SHOT_FAILED), so `shotfleet replay` skips it.";

#[derive(Args)]
struct StatusArgs {
    /// Redraw every second until q or Ctrl-C, with the workers heard of in the last minute.
    #[arg(long)]
    watch: bool,
    /// Follow this project's progress events (a producer may read no other's): its jobs'
    /// steps. Without it `--watch` follows every project's, and one status none.
    #[arg(long, env = "SHOTFLEET_PROJECT", value_parser = parse_project)]
    project: Option<String>,
}

#[derive(Args)]
struct CancelArgs {
    /// The project of the jobs.
    #[arg(long, env = "SHOTFLEET_PROJECT", value_parser = parse_project)]
    project: String,
    /// Jobs to cancel: ids, or `<project>/<id>` as `submit --wait` names the jobs of a board of
    /// several projects.
    #[arg(value_name = "JOB")]
    jobs: Vec<String>,
    /// Instead of jobs: the unfinished jobs of this shot.
    #[arg(long, conflicts_with_all = ["jobs", "all"])]
    shot: Option<String>,
    /// Instead of jobs: every unfinished job of the project (never implied by naming none, so
    /// that a list that came out empty cancels nothing).
    #[arg(long, conflicts_with = "jobs")]
    all: bool,
    /// Who cancels, as the outcome will say (neither given nor in USER: "shotfleet cancel").
    #[arg(long, env = "USER")]
    by: Option<String>,
    /// How long to wait for the fleet's answer.
    #[arg(long, default_value = "15s", value_parser = parse_wait)]
    timeout: Duration,
}

#[derive(Args)]
struct GalleryArgs {
    /// The project.
    #[arg(long, env = "SHOTFLEET_PROJECT", value_parser = parse_project)]
    project: String,
    /// Folder for index.html [default: gallery-<project>].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Where the workers store images: file:///folder or s3://bucket/prefix (S3 settings from
    /// the AWS_* environment).
    #[arg(long, env = "SHOTFLEET_STORE")]
    store: String,
    /// The storyboard: its order, and shots without an outcome yet.
    #[arg(long)]
    board: Option<PathBuf>,
    /// With --board: a column of your own to leave out (as `submit --ignore-column`).
    #[arg(long = "ignore-column", value_name = "NAME", value_delimiter = ',', requires = "board")]
    ignore_columns: Vec<String>,
    /// Serve the page on localhost and refresh it as results arrive (Ctrl-C stops).
    #[arg(long)]
    serve: bool,
    /// With --serve: the address (loopback; port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:8470")]
    listen: std::net::SocketAddr,
}

/// `setup`'s settings; each left out takes the topology's default (`Topology::default()`).
#[derive(Args)]
struct SetupArgs {
    /// Stream replicas (3 on a 3-node cluster) [default: 1].
    #[arg(long)]
    replicas: Option<usize>,
    /// How long job ids are remembered (re-submits inside it queue nothing) [default: 20m].
    #[arg(long, value_parser = parse_duration)]
    duplicate_window: Option<Duration>,
    /// How long results are kept [default: 14d].
    #[arg(long, value_parser = parse_duration)]
    results_max_age: Option<Duration>,
    /// How long failed records are kept for replay [default: 30d].
    #[arg(long, value_parser = parse_duration)]
    failed_max_age: Option<Duration>,
    /// How long a queued job may wait before the server drops it [default: 7d].
    #[arg(long, value_parser = parse_duration)]
    jobs_max_age: Option<Duration>,
    /// The most the job queue holds, bytes; when full, submitting is refused [default: 1 GiB].
    #[arg(long)]
    jobs_max_bytes: Option<i64>,
    /// Redeliver a job not acked or progressed for this long [default: 60s].
    #[arg(long, value_parser = parse_duration)]
    ack_wait: Option<Duration>,
    /// Deliveries after which a job no worker answered for goes to the failed stream (a
    /// backstop for jobs that kill their worker; workers fail a job after their own count of
    /// failed attempts) [default: 20].
    #[arg(long)]
    max_deliver: Option<i64>,
    /// Change existing streams and consumers whose settings differ.
    #[arg(long)]
    update: bool,
}

impl SetupArgs {
    fn topology(&self) -> Topology {
        let default = Topology::default();
        Topology {
            replicas: self.replicas.unwrap_or(default.replicas),
            duplicate_window: self.duplicate_window.unwrap_or(default.duplicate_window),
            results_max_age: self.results_max_age.unwrap_or(default.results_max_age),
            failed_max_age: self.failed_max_age.unwrap_or(default.failed_max_age),
            jobs_max_age: self.jobs_max_age.unwrap_or(default.jobs_max_age),
            jobs_max_bytes: self.jobs_max_bytes.unwrap_or(default.jobs_max_bytes),
            ack_wait: self.ack_wait.unwrap_or(default.ack_wait),
            max_deliver: self.max_deliver.unwrap_or(default.max_deliver),
            ..default
        }
    }
}

#[derive(Args)]
struct SubmitArgs {
    /// The storyboard: .jsonl / .csv (or sniffed from the first character).
    file: PathBuf,
    /// Publish the valid lines of a file that has bad ones (by default nothing is published).
    #[arg(long)]
    skip_invalid: bool,
    /// A column (or JSON field) of your own to leave out, such as notes or dialogue; repeatable
    /// or comma-separated. Any other unknown column is refused, never dropped.
    #[arg(long = "ignore-column", value_name = "NAME", value_delimiter = ',')]
    ignore_columns: Vec<String>,
    /// Wait until every job has an outcome; exit 1 if any failed (cancelled ones do not count).
    #[arg(long)]
    wait: bool,
    /// With --wait: give up after this long (e.g. 30m); exit 124 then, after the table so far.
    #[arg(long, requires = "wait", value_parser = parse_wait)]
    timeout: Option<Duration>,
    /// Queue again the jobs the stream already has whose last outcome is failed or cancelled
    /// (inside the duplicate window a re-submission is otherwise dropped as a copy).
    #[arg(long)]
    again: bool,
    /// Encode payloads as JSON instead of MessagePack.
    #[arg(long)]
    json: bool,
    /// Unacknowledged publishes at most.
    #[arg(long, default_value_t = 256)]
    max_in_flight: usize,
    /// Publish in the file's order. By default shots sharing a LoRA set are published together
    /// inside each priority, so workers switch sets once per character, not once per shot.
    #[arg(long)]
    no_group: bool,
}

#[derive(Args)]
struct ReplayArgs {
    /// Only records failed for this reason: invalid, oom, attempts, max_deliveries, driver (repeatable).
    #[arg(long = "reason", value_name = "REASON")]
    reasons: Vec<FailureReason>,
    /// Only records of this project (repeatable).
    #[arg(long = "project", value_name = "PROJECT", value_parser = parse_project)]
    projects: Vec<String>,
    /// Only the records of this job, by id or `<project>/<job_id>` (repeatable).
    #[arg(long = "job", value_name = "JOB_ID")]
    jobs: Vec<String>,
    /// Only records failed at or after this: a duration ago (2h, 30m, 1d) or an RFC 3339 time.
    #[arg(long, value_name = "WHEN")]
    since: Option<replay::When>,
    /// Only records failed at or before this: a duration ago (2h, 30m, 1d) or an RFC 3339 time.
    #[arg(long, value_name = "WHEN")]
    until: Option<replay::When>,
    /// List what would be replayed; change nothing.
    #[arg(long)]
    dry_run: bool,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    shotfleet_schema::nats::topology::parse_duration(text)
}

/// A time to wait: a zero one would give up before anything could answer.
fn parse_wait(text: &str) -> Result<Duration, String> {
    match parse_duration(text)? {
        Duration::ZERO => Err("a wait of 0 gives up at once; give a positive duration, e.g. 30s or 30m".into()),
        wait => Ok(wait),
    }
}

/// A project as jobs name it: it becomes subject tokens, object keys and, for `gallery`, a
/// folder name, so `a/b` or `*` is refused here rather than matching or writing elsewhere.
fn parse_project(text: &str) -> Result<String, String> {
    use shotfleet_schema::validate::{MAX_PROJECT_BYTES, id_problem};
    match id_problem(text, MAX_PROJECT_BYTES) {
        Some(problem) => Err(format!("a project name {problem}")),
        None => Ok(text.to_owned()),
    }
}

/// A failure and the exit code it maps to.
struct Failure(u8, anyhow::Error);

fn bad_input(e: impl Into<anyhow::Error>) -> Failure {
    Failure(2, e.into())
}
fn server(e: impl Into<anyhow::Error>) -> Failure {
    Failure(3, e.into())
}
/// `submit --wait --timeout` ran out with jobs still waiting: `timeout(1)`'s code.
const TIMED_OUT: u8 = 124;

/// Lets a closed pipe end the command quietly, as `head` or `grep -q` expect of any Unix tool
/// (exit 141 in the shell). Rust starts with SIGPIPE ignored, so the first `println!` after
/// the reader left would panic (exit 101, "failed printing to stdout").
fn end_quietly_on_closed_pipes() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    // SAFETY: the default disposition installs no handler that could run at an unsafe moment.
    // Sockets are unaffected: Rust writes to them with MSG_NOSIGNAL, so a NATS or store
    // connection that drops still gives an error, not the signal.
    if let Err(e) = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) } {
        tracing::debug!(error = %e, "SIGPIPE keeps Rust's disposition");
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    end_quietly_on_closed_pipes();
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli).await {
        Ok(code) => ExitCode::from(code),
        Err(Failure(code, e)) => {
            eprintln!("shotfleet: {}", error_chain(&e));
            ExitCode::from(code)
        }
    }
}

/// The error and its causes, `: ` between them, leaving out a cause whose text the message
/// before it already holds (errors that name their source in their own message).
fn error_chain(error: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in error.chain().map(ToString::to_string) {
        if !out.contains(&cause) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&cause);
        }
    }
    out
}

async fn run(cli: Cli) -> Result<u8, Failure> {
    let mut options = NatsOptions { name: "shotfleet-cli".into(), ..NatsOptions::default() };
    cli.nats.apply(&mut options, |name| std::env::var(name).ok());
    match cli.command {
        Command::Setup(args) => setup(&options, args).await,
        Command::Submit(args) => submit_file(&options, args).await,
        Command::Status(args) => show_status(&options, args).await,
        Command::Cancel(args) => cancel_jobs(&options, args).await,
        Command::Gallery(args) => make_gallery(&options, args).await,
        Command::Replay(args) => replay_failed(&options, args).await,
        Command::Lora(command) => lora_command(command).await,
    }
}

async fn lora_command(command: LoraCommand) -> Result<u8, Failure> {
    let failure = |e: lora::LibraryError| if e.is_bad_input() { bad_input(e) } else { server(e) };
    match command {
        LoraCommand::Push(args) => {
            let library = lora::Library::open(&args.library.store, &args.library.prefix, std::env::vars()).map_err(failure)?;
            let limits = shotfleet_schema::lora::FileLimits { max_bytes: args.max_mib << 20 };
            let path = args.file.display().to_string();
            let size = std::fs::metadata(&args.file).with_context(|| format!("cannot read {path}")).map_err(bad_input)?.len();
            if size > limits.max_bytes {
                let source = shotfleet_schema::lora::LoraFileError::TooLarge { bytes: size, limit: limits.max_bytes };
                return Err(failure(lora::LibraryError::Refused { path, source }));
            }
            let bytes = std::fs::read(&args.file).with_context(|| format!("cannot read {path}")).map_err(bad_input)?;
            let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            let pushed = library.push(&args.name, &path, &bytes, &limits, args.replace, now).await.map_err(failure)?;
            let (verb, entry) = match &pushed {
                lora::Pushed::Uploaded { entry, replaced: false } => ("pushed", entry),
                lora::Pushed::Uploaded { entry, replaced: true } => ("replaced", entry),
                lora::Pushed::Unchanged { entry } => ("unchanged (already there)", entry),
            };
            let parts: Vec<String> = entry.parts.iter().map(|(part, n)| format!("{part} {n}")).collect();
            println!(
                "{verb} {}: {}, rank {}, {} layers ({}), {:.2} MiB, sha256 {} -> {}",
                entry.name,
                entry.format,
                entry.rank,
                entry.targets,
                parts.join(", "),
                entry.bytes as f64 / (1 << 20) as f64,
                &entry.sha256[..12],
                library.location()
            );
            Ok(0)
        }
        LoraCommand::List(args) => {
            let library = lora::Library::open(&args.store, &args.prefix, std::env::vars()).map_err(failure)?;
            let listed = library.list().await.map_err(failure)?;
            println!("{:<32} {:<6} {:>5} {:>7} {:>9} {:<12} {:>6}", "name", "format", "rank", "layers", "MiB", "sha256", "age");
            let now = SystemTime::now();
            for item in &listed {
                match item {
                    lora::Listed::Entry(e) => {
                        let pushed = SystemTime::UNIX_EPOCH + Duration::from_secs(e.pushed_unix);
                        let age = now.duration_since(pushed).unwrap_or_default();
                        println!(
                            "{:<32} {:<6} {:>5} {:>7} {:>9.2} {:<12} {:>6}",
                            e.name,
                            e.format.to_string(),
                            e.rank,
                            e.targets,
                            e.bytes as f64 / (1 << 20) as f64,
                            &e.sha256[..12],
                            replay::format_age(age)
                        );
                    }
                    lora::Listed::Unreadable { key, detail } => eprintln!("{key}: unreadable sidecar ({detail}); push that LoRA again"),
                }
            }
            println!("{} LoRA(s) in {}", listed.iter().filter(|l| matches!(l, lora::Listed::Entry(_))).count(), library.location());
            Ok(0)
        }
    }
}

async fn connect(options: &NatsOptions) -> Result<async_nats::jetstream::Context, Failure> {
    let client = options.connect().await.map_err(|e| if e.is_setting() { bad_input(e) } else { server(e) })?;
    Ok(async_nats::jetstream::new(client))
}

async fn setup(options: &NatsOptions, args: SetupArgs) -> Result<u8, Failure> {
    let topology = args.topology();
    let js = connect(options).await?;
    let report = topology.ensure(&js, args.update).await.map_err(server)?;
    for what in &report.created {
        println!("created   {what}");
    }
    for what in &report.updated {
        println!("updated   {what}");
    }
    println!(
        "topology ready: {} created, {} updated, {} already as wanted",
        report.created.len(),
        report.updated.len(),
        report.unchanged.len()
    );
    Ok(0)
}

async fn submit_file(options: &NatsOptions, args: SubmitArgs) -> Result<u8, Failure> {
    let mut board = storyboard::read(&args.file, &Limits::default(), &args.ignore_columns)
        .with_context(|| format!("cannot read {}", args.file.display()))
        .map_err(bad_input)?;
    for error in &board.errors {
        eprintln!("{}: {error}", args.file.display());
    }
    if !board.errors.is_empty() && !args.skip_invalid {
        return Err(bad_input(anyhow::anyhow!(
            "{} bad line(s) in {}; nothing was published ({})",
            board.errors.len(),
            args.file.display(),
            match board.shots.len() {
                0 => "no line is good: fix them".to_owned(),
                good => format!("fix them, or pass --skip-invalid to publish the {good} good one(s)"),
            }
        )));
    }
    if board.shots.is_empty() {
        return Err(bad_input(anyhow::anyhow!("{} holds no shots", args.file.display())));
    }
    if !args.no_group {
        grouping::group_by_lora_set(&mut board.shots);
    }
    let js = connect(options).await?;
    let since = SystemTime::now();
    let progress = Progress::new(board.shots.len() as u64, "published");
    let submit_options = submit::SubmitOptions {
        max_in_flight: args.max_in_flight,
        content_type: if args.json { ContentType::Json } else { ContentType::MessagePack },
        again: args.again,
    };
    let mut placed = Vec::new();
    let summary = submit::submit(&js, &board.shots, submit_options, |shot, ack| {
        progress.inc();
        placed.push(live::Placed {
            project: shot.job.project.clone(),
            job_id: shot.job.job_id.clone(),
            priority: shot.priority,
            class: shotfleet_schema::SubjectClass::Class(shot.job.class()),
            sequence: ack.sequence,
        });
    })
    .await
    .map_err(server)?;
    progress.finish();
    let rate = summary.queued as f64 / summary.elapsed.as_secs_f64().max(1e-9);
    println!(
        "queued {} job(s) in {:.2}s ({rate:.0}/s); {} already in the stream inside its duplicate window, not queued again",
        summary.queued,
        summary.elapsed.as_secs_f64(),
        summary.duplicates.len()
    );
    print_duplicates(&summary);
    if !args.wait {
        return Ok(0);
    }
    let duplicates: std::collections::HashSet<&String> = summary.duplicates.iter().collect();
    let awaited: Vec<Awaited> = board
        .shots
        .iter()
        .map(|s| {
            let key = s.job.key();
            Awaited {
                project: s.job.project.clone(),
                job_id: s.job.job_id.clone(),
                duplicate: duplicates.contains(&key),
                queued_at: summary.queued_at.get(&key).copied(),
            }
        })
        .collect();
    // On a terminal the bars say how many finished; elsewhere a line every tenth.
    let terminal = std::io::stderr().is_terminal();
    let progress = (!terminal).then(|| Progress::new(awaited.len() as u64, "finished"));
    let order: std::collections::HashMap<String, usize> = board.shots.iter().enumerate().map(|(i, s)| (s.job.key(), i)).collect();
    placed.sort_by_key(|p| order.get(&p.key()).copied());
    let shown = std::sync::Arc::new(std::sync::Mutex::new(live::Live::new(&placed, terminal)));
    let _following = live::follow(&js, placed, shown.clone()).await.map_err(|e| server(anyhow::anyhow!(e)))?;
    // A job told twice (a stored failure, then the result of its replay) finishes once.
    let mut finished = std::collections::HashSet::new();
    let waited = wait::wait(&js, &awaited, since, args.timeout, |job, outcome| {
        if finished.insert(job.to_owned()) {
            progress.iter().for_each(Progress::inc);
        }
        shown.lock().unwrap_or_else(std::sync::PoisonError::into_inner).finished(job, outcome);
    })
    .await;
    shown.lock().unwrap_or_else(std::sync::PoisonError::into_inner).finish();
    progress.iter().for_each(Progress::finish);
    let outcomes = match waited {
        Ok(outcomes) => outcomes,
        // What did finish is shown before the jobs still waiting are named; its own exit code,
        // apart from an unreachable server's, so a script can wait again.
        Err(wait::WaitError::TimedOut { after, pending, so_far }) => {
            let shown = shown.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            print_table(&board.shots, &so_far, |key| shown.unfinished(key));
            let error = wait::WaitError::TimedOut { after, pending, so_far: Default::default() };
            return Err(Failure(TIMED_OUT, error.into()));
        }
        Err(e) => return Err(server(e)),
    };
    print_table(&board.shots, &outcomes, |_| None);
    // A cancelled job ended as someone asked: not a failure.
    let failed = outcomes.values().filter(|o| matches!(o, Outcome::Failed { reason, .. } if reason != "cancelled")).count();
    Ok(if failed > 0 { 1 } else { 0 })
}

/// Why the duplicates of a submission were not queued, and what was queued again.
fn print_duplicates(summary: &submit::SubmitSummary) {
    let some = |keys: &[String]| wait::listed(keys, 5);
    // A changed line under an old id is the easy mistake: the server compares ids, not shots.
    if !summary.rendered.is_empty() {
        let n = summary.rendered.len();
        println!("  {n} already rendered: a job is rendered once under its id; give a changed shot a new job_id ({})", some(&summary.rendered));
    }
    if !summary.ended.is_empty() {
        let n = summary.ended.len();
        println!("  {n} ended failed or cancelled: `--again` queues them again ({})", some(&summary.ended));
    }
    let known: std::collections::HashSet<&String> = summary.rendered.iter().chain(&summary.ended).chain(&summary.unknown).collect();
    let to_come: Vec<String> = summary.duplicates.iter().filter(|k| !known.contains(k)).cloned().collect();
    if !to_come.is_empty() {
        println!("  {} without an outcome yet: still queued or rendering ({})", to_come.len(), some(&to_come));
    }
    if !summary.unknown.is_empty() {
        let n = summary.unknown.len();
        println!(
            "  {n} whose earlier request cannot be read (this role may not read it, or no answer came): `--again` leaves them; a new job_id renders a shot afresh ({})",
            some(&summary.unknown)
        );
    }
    if !summary.again.is_empty() {
        println!("queued {} job(s) again: they had ended failed or cancelled ({})", summary.again.len(), some(&summary.again));
    }
    if !summary.again_before.is_empty() {
        let n = summary.again_before.len();
        println!("{n} job(s) already queued again by an earlier --again, still to come ({})", some(&summary.again_before));
    }
}

/// The outcome of every shot; `unfinished` says where a job without one stands.
fn print_table(
    shots: &[storyboard::Shot],
    outcomes: &std::collections::HashMap<String, Outcome>,
    unfinished: impl Fn(&str) -> Option<(&'static str, String)>,
) {
    println!("{:<24} {:<12} {:<4} {:<9} {:>6} {:>9}  detail", "job", "shot", "prio", "status", "images", "render_s");
    let (mut done, mut degraded, mut failed, mut cancelled, mut waiting) = (0, 0, 0, 0, 0);
    // Ids are unique within a project: a board of several projects names its jobs by key.
    let several_projects = live::spans_projects(shots.iter().map(|s| s.job.project.as_str()));
    // In the file's order (submit groups shots by LoRA set to publish them).
    let mut in_order: Vec<&storyboard::Shot> = shots.iter().collect();
    in_order.sort_by_key(|s| s.line);
    for shot in in_order {
        let job = &shot.job;
        let key = job.key();
        let name = live::label(several_projects, &key);
        let (status, images, render, detail) = match outcomes.get(&key) {
            Some(Outcome::Done(result)) => {
                let degraded_now = result.degrade.is_some();
                if degraded_now { degraded += 1 } else { done += 1 }
                let mut first = result.images.first().map(|i| i.key.clone()).unwrap_or_default();
                for note in &result.notes {
                    first = format!("{first} · {note}");
                }
                (
                    if degraded_now { "degraded" } else { "done" },
                    result.images.len().to_string(),
                    format!("{:.1}", result.timing.render_ms as f64 / 1000.0),
                    first,
                )
            }
            Some(Outcome::Failed { reason, detail, .. }) if reason == "cancelled" => {
                cancelled += 1;
                ("cancelled", "-".into(), "-".into(), detail.clone())
            }
            Some(Outcome::Failed { reason, detail, .. }) => {
                failed += 1;
                ("failed", "-".into(), "-".into(), wait::failure_line(reason, detail))
            }
            None => {
                waiting += 1;
                let (status, stands) = unfinished(&key).unwrap_or(("waiting", "no outcome yet".to_owned()));
                (status, "-".into(), "-".into(), stands)
            }
        };
        println!("{name:<24} {:<12} {:<4} {:<9} {:>6} {:>9}  {detail}", job.shot_id, shot.priority, status, images, render);
    }
    let still = if waiting > 0 { format!(", {waiting} still waiting") } else { String::new() };
    println!("{done} done, {degraded} degraded, {failed} failed, {cancelled} cancelled{still}");
    print_waits(shots, outcomes);
}

/// Queue wait per priority: how long jobs sat in the stream before a worker took them.
fn print_waits(shots: &[storyboard::Shot], outcomes: &std::collections::HashMap<String, Outcome>) {
    for &priority in shotfleet_schema::Priority::ALL {
        let mut waits: Vec<u64> = shots
            .iter()
            .filter(|s| s.priority == priority)
            .filter_map(|s| match outcomes.get(&s.job.key()) {
                Some(Outcome::Done(result)) => Some(result.timing.queue_ms),
                _ => None,
            })
            .collect();
        if waits.is_empty() {
            continue;
        }
        waits.sort_unstable();
        let mean = waits.iter().sum::<u64>() as f64 / waits.len() as f64 / 1000.0;
        let max = *waits.last().unwrap_or(&0) as f64 / 1000.0;
        let images: usize = shots
            .iter()
            .filter(|s| s.priority == priority)
            .filter_map(|s| match outcomes.get(&s.job.key()) {
                Some(Outcome::Done(result)) => Some(result.images.len()),
                _ => None,
            })
            .sum();
        println!("{priority}: {} shots, {images} images, queue wait mean {mean:.1}s, max {max:.1}s", waits.len());
    }
}

async fn show_status(options: &NatsOptions, args: StatusArgs) -> Result<u8, Failure> {
    let js = connect(options).await?;
    if args.watch {
        let interactive = std::io::stdout().is_terminal() && std::io::stdin().is_terminal();
        watch::watch(&js, args.project.as_deref(), interactive).await.map_err(|e| server(anyhow::anyhow!(e)))?;
        return Ok(0);
    }
    use futures::StreamExt as _;
    // The pings' answers arrive while the queues are read, and with --project the progress
    // events of its jobs rendering (a few a second each): every project's would be a
    // permissions violation for a producer, which may read only its own.
    let client = js.client();
    let mut events = match &args.project {
        Some(project) => client.subscribe(watch::events_subject(Some(project))).await.ok(),
        None => None,
    };
    let (status, workers) = tokio::join!(status::read(&js), fleet::ping(&client, Duration::from_secs(1)));
    let status = status.map_err(|e| server(anyhow::anyhow!(e)))?;
    let mut seen = fleet::Fleet::default();
    let now = std::time::Instant::now();
    for state in workers.map_err(|e| server(anyhow::anyhow!(e)))? {
        seen.answered(state, now);
    }
    while let Some(events) = events.as_mut()
        && let Ok(Some(message)) = tokio::time::timeout(Duration::ZERO, events.next()).await
    {
        if let Ok(event) = serde_json::from_slice::<shotfleet_schema::progress::ShotProgress>(&message.payload) {
            seen.progressed(event, now);
        }
    }
    print!("{}", status::render(&status, &seen, now));
    Ok(0)
}

/// Job ids from `jobs` as given: an id, or a key (`<project>/<id>`) of `project`.
fn without_project(project: &str, jobs: Vec<String>) -> Result<Vec<String>, String> {
    jobs.into_iter()
        .map(|job| match job.split_once('/') {
            Some((of, id)) if of == project => Ok(id.to_owned()),
            Some((of, _)) => Err(format!("`{job}` is a job of project `{of}`, not of --project {project}")),
            None => Ok(job),
        })
        .collect()
}

async fn cancel_jobs(options: &NatsOptions, args: CancelArgs) -> Result<u8, Failure> {
    let which = match (args.shot, args.all) {
        (Some(shot), _) => Selection::Shot(shot),
        (None, true) => Selection::All,
        (None, false) if args.jobs.is_empty() => {
            return Err(bad_input(anyhow::anyhow!(
                "name the jobs to cancel, or --shot SHOT for a shot's, or --all for every unfinished job of the project"
            )));
        }
        (None, false) => Selection::Jobs(without_project(&args.project, args.jobs).map_err(|e| bad_input(anyhow::anyhow!(e)))?),
    };
    let target = cancel::Target { project: args.project, which };
    target.validate().map_err(|e| bad_input(anyhow::anyhow!(e)))?;
    let by = args.by.filter(|by| !by.trim().is_empty()).unwrap_or_else(|| "shotfleet cancel".into());
    let js = connect(options).await?;
    let reply = cancel::cancel(&js.client(), &target, &by, args.timeout).await.map_err(server)?;
    println!("{:<24} {:<12} {:<17} {:>7}  detail", "job", "shot", "result", "removed");
    for job in &reply.jobs {
        let result = match job.result {
            shotfleet_schema::CancelResult::Cancelled => "cancelled",
            shotfleet_schema::CancelResult::AlreadyFinished => "already finished",
            shotfleet_schema::CancelResult::Unknown => "unknown",
            shotfleet_schema::CancelResult::Failed => "not cancelled",
        };
        let status = job.status.map(|s| format!("{s:?}").to_lowercase()).unwrap_or_default();
        let detail = if matches!(job.result, shotfleet_schema::CancelResult::AlreadyFinished) { format!("{status}: {}", job.detail) } else { job.detail.clone() };
        println!("{:<24} {:<12} {:<17} {:>7}  {detail}", job.job_id, job.shot_id, result, job.removed);
    }
    if reply.omitted > 0 {
        println!("... and {} more, not listed", reply.omitted);
    }
    // The tally counts the jobs not listed too (a worker before it sends none: count the list).
    let tally = reply.tally.unwrap_or_else(|| shotfleet_schema::cancel::CancelTally::of(&reply.jobs));
    let problems = tally.unknown + tally.failed;
    println!(
        "{} cancelled, {} already finished, {problems} unknown or not cancelled (answered by {})",
        tally.cancelled, tally.already_finished, reply.worker
    );
    // A shot or project with nothing unfinished is named, as an unknown job is: likely a slip.
    if reply.jobs.is_empty() && reply.omitted == 0 {
        let what = match &target.which {
            Selection::Shot(shot) => format!("shot `{shot}` of project `{}`", target.project),
            _ => format!("project `{}`", target.project),
        };
        eprintln!("shotfleet: no unfinished job of {what} is queued or running");
        return Ok(1);
    }
    Ok(if problems > 0 { 1 } else { 0 })
}

async fn make_gallery(options: &NatsOptions, args: GalleryArgs) -> Result<u8, Failure> {
    let store = gallery::store::ImageStore::open(&args.store, std::env::vars()).map_err(|e| bad_input(anyhow::anyhow!(e)))?;
    let board = match &args.board {
        Some(path) => Some(storyboard::read(path, &Limits::default(), &args.ignore_columns).with_context(|| format!("cannot read {}", path.display())).map_err(bad_input)?),
        None => None,
    };
    if let (Some(board), Some(path)) = (&board, &args.board) {
        for error in &board.errors {
            eprintln!("{}: {error} (left out of the gallery)", path.display());
        }
    }
    if !args.listen.ip().is_loopback() {
        return Err(bad_input(anyhow::anyhow!("--listen {}: the gallery serves on loopback only (127.0.0.1 or ::1)", args.listen)));
    }
    let js = connect(options).await?;
    let mut sheet = gallery::Gallery::new(js, store, &args.project, board);
    if args.serve {
        let served = gallery::serve::serve(sheet, args.listen, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .map_err(|e| server(anyhow::anyhow!(e)))?;
        println!("serving the {} gallery on http://{}/ (Ctrl-C stops)", args.project, served.addr);
        served.done.await.map_err(|e| server(anyhow::anyhow!(e)))?.map_err(|e| server(anyhow::anyhow!(e)))?;
        return Ok(0);
    }
    let cards = sheet.cards().await.map_err(|e| server(anyhow::anyhow!(e)))?;
    let out = args.out.unwrap_or_else(|| PathBuf::from(format!("gallery-{}", args.project)));
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display())).map_err(bad_input)?;
    let path = out.join("index.html");
    std::fs::write(&path, gallery::page::render(&args.project, &cards, false)).with_context(|| format!("cannot write {}", path.display())).map_err(bad_input)?;
    println!("wrote {} ({} shots)", path.display(), cards.len());
    if cards.is_empty() {
        eprintln!("shotfleet: project `{}` has no outcome or failed record yet (and no --board lists its shots): is the name right?", args.project);
    }
    Ok(0)
}

async fn replay_failed(options: &NatsOptions, args: ReplayArgs) -> Result<u8, Failure> {
    let now = SystemTime::now();
    let filter = replay::Filter {
        reasons: args.reasons,
        projects: args.projects,
        jobs: args.jobs,
        since: args.since.map(|w| w.resolve(now)),
        until: args.until.map(|w| w.resolve(now)),
    };
    // `--since 1m --until 2h` reads as "from 1 to 2 hours" but is a window that ends before it
    // begins: it would match nothing, silently.
    if let (Some(since), Some(until)) = (filter.since, filter.until)
        && since > until
    {
        return Err(bad_input(anyhow::anyhow!(
            "--since is later than --until, so nothing can match: a duration means that long ago (the last two hours but the last minute: --since 2h --until 1m)"
        )));
    }
    let js = connect(options).await?;
    println!(
        "{:<13} {:>6}  {:<24} {:<14} {:>8}  {:<24} {:>5}  detail",
        "action", "seq", "job", "reason", "attempts", "original subject", "age"
    );
    let mut problems = Vec::new();
    let mut notes = Vec::new();
    let mut invalid_sent = 0;
    let summary = replay::replay(&js, &filter, args.dry_run, |record, outcome| {
        let sent = matches!(outcome, replay::Outcome::WouldReplay { .. } | replay::Outcome::Replayed { duplicate: false, .. });
        if sent && record.reason == FailureReason::Invalid.as_str() {
            invalid_sent += 1;
        }
        let action = match outcome {
            replay::Outcome::WouldReplay { .. } => "would replay",
            replay::Outcome::Replayed { duplicate: false, .. } => "replayed",
            replay::Outcome::Replayed { duplicate: true, .. } => "duplicate",
            replay::Outcome::Rendered { .. } => "rendered",
            replay::Outcome::Skipped { .. } => "skipped",
            _ => "kept",
        };
        println!(
            "{action:<13} {:>6}  {:<24} {:<14} {:>8}  {:<24} {:>5}  {}",
            record.seq,
            record.job_name(),
            if record.reason.is_empty() { "-" } else { &record.reason },
            if record.attempts.is_empty() { "-" } else { &record.attempts },
            record.original_subject.as_deref().unwrap_or("-"),
            replay::format_age(record.age(now)),
            record.detail,
        );
        let named = format!("seq {} (job {})", record.seq, record.job_name());
        match outcome {
            replay::Outcome::Skipped { why } | replay::Outcome::Kept { why } => problems.push(format!("{named}: {why}")),
            replay::Outcome::Rendered { why } => notes.push(format!("{named}: {why}")),
            replay::Outcome::WouldReplay { subject, restored: Some(restored), .. } => {
                notes.push(format!("{named}: would be sent at {restored}, to {subject}"));
            }
            // A duplicate was queued by the interrupted run, as that run sent it.
            replay::Outcome::Replayed { subject, restored: Some(restored), duplicate: false, .. } => {
                notes.push(format!("{named}: sent at {restored}, to {subject}"));
            }
            _ => {}
        }
    })
    .await;
    for line in &notes {
        println!("{line}");
    }
    for line in &problems {
        eprintln!("{line}");
    }
    let summary = summary.map_err(server)?;
    if let Some(why) = &summary.unchecked {
        eprintln!("the jobs' last outcomes were not checked ({why}): records of jobs rendered or cancelled since were replayed too; a worker settles a rendered job's replay without rendering it");
    }
    if summary.matched == 0 {
        // A typo in --job or --project reads the same as an empty failed stream: say which.
        eprintln!("no failed record matches; `shotfleet replay --dry-run` with no filter lists every one");
    }
    if args.dry_run {
        println!(
            "dry run: {} matching, would replay {}, would skip {}, cannot replay {}, already rendered {}; nothing changed",
            summary.matched, summary.would_replay, summary.skipped, summary.kept, summary.rendered
        );
    } else {
        println!(
            "summary: replayed {}, duplicates {}, skipped {}, could not replay {}, already rendered {} (records deleted)",
            summary.replayed, summary.duplicates, summary.skipped, summary.kept, summary.rendered
        );
        if summary.duplicates > 0 {
            println!(
                "{} duplicate(s): already queued by an earlier replay (interrupted, or running beside this one); not queued again, failed copy deleted",
                summary.duplicates
            );
        }
    }
    if invalid_sent > 0 {
        // A payload goes back as it was: only a change beside it (a LoRA pushed, the workers'
        // `[limits]`) lets it render this time.
        let verb = if args.dry_run { "would go" } else { "went" };
        eprintln!(
            "{invalid_sent} record(s) failed as `invalid` {verb} back unchanged: they fail the same way unless what refused them has changed since (a LoRA pushed, the workers' [limits]); a payload at fault needs its producer to send it again, fixed"
        );
    }
    Ok(if summary.kept > 0 { 1 } else { 0 })
}

/// A progress bar on a terminal, plain lines (every 10%) otherwise.
struct Progress {
    bar: Option<ProgressBar>,
    total: u64,
    label: &'static str,
    count: std::sync::atomic::AtomicU64,
}

impl Progress {
    fn new(total: u64, label: &'static str) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template("{spinner} {msg} {pos}/{len} [{bar:40}] {per_sec} eta {eta}")
                    .expect("valid template")
                    .progress_chars("=> "),
            );
            bar.set_message(label);
            bar
        });
        Self { bar, total, label, count: 0.into() }
    }

    fn inc(&self) {
        let n = self.count.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        match &self.bar {
            Some(bar) => bar.inc(1),
            None => {
                let step = (self.total / 10).max(1);
                if n.is_multiple_of(step) || n == self.total {
                    eprintln!("{} {n}/{}", self.label, self.total);
                }
            }
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}
