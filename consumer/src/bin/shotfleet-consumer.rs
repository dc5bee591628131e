//! `shotfleet-consumer`: one worker process per GPU, or with `--gpus` the box's supervisor of
//! one worker process per GPU (`shotfleet_consumer::supervisor`).
//!
//! Parses flags, sets up logging, resolves the config (file, environment, flags) and runs the
//! worker until SIGTERM or SIGINT. Exit codes, for the supervisor: 0 after a clean stop; 2 bad
//! configuration or model folder; 3 a start-up step failed that may pass (NATS, the store
//! unreachable, calibration); 75 a driver fault (restart the worker, check the GPU); 76 a
//! restart requested by the leak guard; 77 the store refuses for good; 78 the card holds none
//! of the classes the worker may serve (do not restart: a person must act).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use shotfleet_consumer::config::{Overrides, WorkerConfig};
use shotfleet_schema::nats::NatsArgs;

#[derive(Parser)]
#[command(name = "shotfleet-consumer", version, about = "A shotfleet GPU worker")]
struct Cli {
    /// TOML config file; the environment and flags override it.
    #[arg(long, env = "SHOTFLEET_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    nats: NatsArgs,
    /// Model folder, Optimum SDXL ONNX layout (SHOTFLEET_MODEL).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Object store: file:///path or s3://bucket/prefix (SHOTFLEET_STORE); required to serve.
    #[arg(long)]
    store: Option<String>,
    /// cpu or cuda (SHOTFLEET_DEVICE).
    #[arg(long)]
    device: Option<String>,
    /// GPU index, as CUDA numbers them (SHOTFLEET_GPU).
    #[arg(long)]
    gpu: Option<u32>,
    /// Supervise one worker process per GPU: `all`, a list (`0,2`), or simulated GPUs for a CPU
    /// box (`sim:4096,1024`, MiB each). The box's health is on `[supervisor] listen`.
    #[arg(long, env = "SHOTFLEET_GPUS", conflicts_with_all = ["gpu", "check_budget"])]
    gpus: Option<String>,
    /// Memory classes served, comma separated (xs,s,m,l,xl), or auto.
    #[arg(long)]
    classes: Option<String>,
    /// Metrics and health address (SHOTFLEET_METRICS_ADDR); default 127.0.0.1:9400.
    #[arg(long)]
    metrics_addr: Option<String>,
    /// How long in-flight jobs may finish after SIGTERM, e.g. 60s.
    #[arg(long)]
    grace_period: Option<String>,
    /// This worker's name in results and logs (SHOTFLEET_WORKER_ID).
    #[arg(long)]
    worker_id: Option<String>,
    /// Where calibration fingerprints are kept (SHOTFLEET_STATE_DIR).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Human-readable logs instead of JSON.
    #[arg(long)]
    plain_logs: bool,
    /// Check the budget instead of serving: load and calibrate, render each shape
    /// (WIDTHxHEIGHTxIMAGES, comma separated) from shrunk arenas, print predicted vs observed
    /// peak memory as JSON lines on stdout, and exit (0: every render worked). No NATS needed.
    #[arg(long, value_name = "SHAPES")]
    check_budget: Option<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,ort=error".into());
    if cli.plain_logs {
        // Colours only for a person at a terminal: a log file or journal gets plain text.
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
    } else {
        tracing_subscriber::fmt().json().with_env_filter(filter).with_writer(std::io::stderr).init();
    }
    let env: HashMap<String, String> = std::env::vars().collect();
    let overrides = Overrides {
        nats: cli.nats,
        model: cli.model,
        store: cli.store,
        device: cli.device,
        gpu: cli.gpu,
        classes: cli.classes,
        metrics_addr: cli.metrics_addr,
        grace_period: cli.grace_period,
        worker_id: cli.worker_id,
        state_dir: cli.state_dir,
    };
    if let Some(gpus) = &cli.gpus {
        return supervise(cli.config.as_deref(), &env, overrides, gpus).await;
    }
    let config = match WorkerConfig::resolve(cli.config.as_deref(), &env, overrides) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("shotfleet-consumer: configuration: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(shapes) = cli.check_budget {
        return check_budget(&config, &shapes).await;
    }
    if let Err(e) = config.require_store() {
        eprintln!("shotfleet-consumer: configuration: {e}");
        return ExitCode::from(2);
    }
    match shotfleet_consumer::run(config, env.into_iter().collect(), shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, exit_code = e.exit_code(), "worker stopped");
            eprintln!("shotfleet-consumer: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

/// `--gpus`: plans the box, then supervises its workers until SIGTERM or SIGINT.
async fn supervise(file: Option<&std::path::Path>, env: &HashMap<String, String>, flags: Overrides, gpus: &str) -> ExitCode {
    use shotfleet_consumer::supervisor::{self, BoxInputs, BoxPlan};
    let program = match std::env::current_exe() {
        Ok(program) => program,
        Err(e) => {
            eprintln!("shotfleet-consumer: cannot find this program to run the workers: {e}");
            return ExitCode::from(shotfleet_consumer::failure::EXIT_START as u8);
        }
    };
    let inputs = BoxInputs { file, env, flags, gpus, args: std::env::args_os().skip(1).collect(), program };
    let outcome = match BoxPlan::resolve(inputs) {
        Ok(plan) => supervisor::run(plan, shutdown_signal()).await,
        Err(e) => Err(e),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, exit_code = e.exit_code(), "box stopped");
            eprintln!("shotfleet-consumer: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

/// `--check-budget`: one JSON object per shape on stdout, then a summary line.
async fn check_budget(config: &WorkerConfig, shapes: &str) -> ExitCode {
    use shotfleet_consumer::worker::check;
    let shapes = match check::parse_shapes(shapes, &config.limits) {
        Ok(shapes) => shapes,
        Err(e) => {
            eprintln!("shotfleet-consumer: --check-budget: {e}");
            return ExitCode::from(2);
        }
    };
    let (checked, summary) = match check::check_budget(config, &shapes).await {
        Ok(done) => done,
        Err(e) => {
            eprintln!("shotfleet-consumer: {e}");
            return ExitCode::from(e.exit_code() as u8);
        }
    };
    for row in &checked {
        println!("{}", serde_json::to_string(row).expect("plain numbers serialize"));
    }
    println!("{}", serde_json::json!({ "summary": summary }));
    ExitCode::SUCCESS
}

/// Resolves on the first SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("install SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
}
