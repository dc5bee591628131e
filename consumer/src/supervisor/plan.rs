//! The box's plan: one worker per card, each with its own config file, id, state folder and
//! port, resolved and validated as the worker itself will resolve it, before anything starts.
//!
//! A worker's config file is the box's file less `[supervisor]`, with its `[supervisor.gpu.N]`
//! merged in (and, on a simulated card, `[budget.simulate] total_mib` from `--gpus sim:...`),
//! written to `<state_dir>/gpuN/worker.toml`. The box's flags reach every worker, less those the
//! supervisor sets per worker (`--config`, `--gpus`, `--gpu`, `--worker-id`, `--state-dir`,
//! `--metrics-addr`), and so does its environment, less `SHOTFLEET_GPUS`; a CUDA worker sees only
//! its own card (`CUDA_VISIBLE_DEVICES=<its UUID>`, so it is CUDA's device 0 there).

use std::collections::HashMap;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::budget::{CUDA_VISIBLE_DEVICES, Visible};
use crate::config::{Overrides, WorkerConfig};

use super::BoxError;
use super::cards::{self, Card, CardsError, Selection};
use super::config::{SupervisorConfig, merge};

/// The environment variable of `--gpus`: a worker must not see it, or it would supervise too.
pub const GPUS_VARIABLE: &str = "SHOTFLEET_GPUS";
/// Overrides `[supervisor] listen`, as `SHOTFLEET_METRICS_ADDR` does a worker's port.
pub const BOX_ADDR_VARIABLE: &str = "SHOTFLEET_BOX_ADDR";

/// Flags the supervisor sets for each worker itself (each takes a value).
const SET_PER_WORKER: &[&str] = &["--config", "--gpus", "--gpu", "--worker-id", "--state-dir", "--metrics-addr"];

/// What the supervisor was started with.
pub struct BoxInputs<'a> {
    /// `--config`.
    pub file: Option<&'a Path>,
    pub env: &'a HashMap<String, String>,
    pub flags: Overrides,
    /// `--gpus`.
    pub gpus: &'a str,
    /// The supervisor's arguments, without the program.
    pub args: Vec<OsString>,
    /// The worker's program: this one.
    pub program: PathBuf,
}

/// Every worker of the box, ready to start.
#[derive(Debug)]
pub struct BoxPlan {
    pub supervisor: SupervisorConfig,
    pub workers: Vec<WorkerPlan>,
}

/// One card's worker.
#[derive(Debug)]
pub struct WorkerPlan {
    pub card: Card,
    /// What it runs with, resolved and validated.
    pub config: WorkerConfig,
    /// Its config file, written by [`BoxPlan::write`].
    pub file: PathBuf,
    table: toml::Table,
    pub command: WorkerCommand,
}

/// How to start a worker.
#[derive(Debug, Clone)]
pub struct WorkerCommand {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub env: Vec<(String, String)>,
    pub env_remove: Vec<String>,
}

impl BoxPlan {
    /// Resolves every worker's config as the worker will (file, environment, flags) and
    /// validates it, so a bad setting stops the box before any worker starts.
    ///
    /// # Errors
    /// [`BoxError::Config`] naming the setting (and the GPU, for one worker's), or
    /// [`BoxError::Start`] when the cards cannot be listed.
    pub fn resolve(inputs: BoxInputs<'_>) -> Result<Self, BoxError> {
        let (base, mut table) = read(inputs.file)?;
        table.remove("supervisor");
        let mut supervisor = base.supervisor.clone();
        if let Some(addr) = inputs.env.get(BOX_ADDR_VARIABLE).filter(|a| !a.is_empty()) {
            supervisor.listen = addr
                .parse()
                .map_err(|_| BoxError::Config(format!("{BOX_ADDR_VARIABLE}: `{addr}` is not an address like 127.0.0.1:9399")))?;
        }
        supervisor.validate().map_err(BoxError::Config)?;
        let selection: Selection = inputs.gpus.parse().map_err(|e| BoxError::Config(format!("--gpus ({GPUS_VARIABLE}): {e}")))?;
        let mut env = inputs.env.clone();
        env.remove(GPUS_VARIABLE);
        let base = base.apply(&env, inputs.flags.clone()).map_err(|e| BoxError::Config(e.to_string()))?;
        let visible = Visible::parse(env.get(CUDA_VISIBLE_DEVICES).map(String::as_str));
        let cards = cards::select(&selection, base.device, &visible).map_err(|e| match e {
            CardsError::Selection(_) => BoxError::Config(e.to_string()),
            CardsError::Nvml(nvml) => BoxError::start("list the GPUs", nvml),
        })?;
        for number in supervisor.gpu.keys() {
            if !cards.iter().any(|card| card.number.to_string() == *number) {
                tracing::warn!(gpu = %number, "[supervisor.gpu.{number}] names no GPU of --gpus; it is not used");
            }
        }
        let ports = ports(&supervisor, base.telemetry.listen, &cards)?;
        let context = Context { inputs: &inputs, env: &env, base: &base, table: &table, supervisor: &supervisor };
        let workers = cards.into_iter().zip(ports).map(|(card, port)| context.worker(card, port)).collect::<Result<_, _>>()?;
        Ok(Self { supervisor, workers })
    }

    /// Writes each worker's config file into its state folder (readable by its owner only: the
    /// file may name credential files).
    ///
    /// # Errors
    /// [`BoxError::Start`] naming the file.
    pub fn write(&self) -> Result<(), BoxError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        for worker in &self.workers {
            let write = || -> std::io::Result<()> {
                std::fs::create_dir_all(&worker.config.state_dir)?;
                let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&worker.file)?;
                let label = worker.card.label();
                writeln!(file, "# {label}'s worker, written by `shotfleet-consumer --gpus` at every start: the box's file less")?;
                writeln!(file, "# [supervisor], with [supervisor.gpu.{}] merged in. Edit those, not this.", worker.card.number)?;
                let text = toml::to_string(&worker.table).map_err(std::io::Error::other)?;
                file.write_all(text.as_bytes())
            };
            write().map_err(|e| BoxError::start(&format!("write {}", worker.file.display()), e))?;
        }
        Ok(())
    }
}

/// What every worker's plan is made from.
struct Context<'a> {
    inputs: &'a BoxInputs<'a>,
    env: &'a HashMap<String, String>,
    base: &'a WorkerConfig,
    table: &'a toml::Table,
    supervisor: &'a SupervisorConfig,
}

impl Context<'_> {
    fn worker(&self, card: Card, port: u16) -> Result<WorkerPlan, BoxError> {
        let label = card.label();
        let in_worker = |e: &dyn std::fmt::Display| BoxError::Config(format!("{label}: {e}"));
        let mut table = self.table.clone();
        if let Some(overrides) = self.supervisor.overrides(card.number) {
            merge(&mut table, overrides);
        }
        if card.simulated() {
            let total: toml::Table = toml::from_str(&format!("budget.simulate.total_mib = {}", card.total_mib)).expect("a TOML key path");
            merge(&mut table, &total);
        }
        let id = format!("{}/{label}", box_name(&self.base.worker_id));
        let state_dir = self.base.state_dir.join(&label);
        let addr = SocketAddr::new(self.base.telemetry.listen.ip(), port);
        let file = state_dir.join("worker.toml");
        let mut env = self.env.clone();
        let mut set_env = Vec::new();
        if let Some(uuid) = &card.uuid {
            env.insert(CUDA_VISIBLE_DEVICES.to_owned(), uuid.clone());
            set_env.push((CUDA_VISIBLE_DEVICES.to_owned(), uuid.clone()));
        }
        let gpu = (!card.simulated()).then_some(0);
        let flags = Overrides {
            gpu,
            worker_id: Some(id.clone()),
            state_dir: Some(state_dir.clone()),
            metrics_addr: Some(addr.to_string()),
            ..self.inputs.flags.clone()
        };
        let config: WorkerConfig = toml::Value::Table(table.clone()).try_into().map_err(|e: toml::de::Error| in_worker(&e.message()))?;
        let config = config.apply(&env, flags).map_err(|e| in_worker(&e))?;
        config.validate().map_err(|e| in_worker(&e))?;
        config.require_store().map_err(|e| in_worker(&e))?;

        let mut args = forwarded(&self.inputs.args);
        for (flag, value) in [
            ("--config", file.as_os_str().to_owned()),
            ("--worker-id", id.into()),
            ("--state-dir", state_dir.into_os_string()),
            ("--metrics-addr", addr.to_string().into()),
        ] {
            args.extend([flag.into(), value]);
        }
        if let Some(gpu) = gpu {
            args.extend(["--gpu".into(), gpu.to_string().into()]);
        }
        let command =
            WorkerCommand { program: self.inputs.program.clone(), args, env: set_env, env_remove: vec![GPUS_VARIABLE.to_owned()] };
        Ok(WorkerPlan { card, config, file, table, command })
    }
}

/// The box's file: its settings (the supervisor's among them) and its table, for the workers'
/// files; the defaults without one.
fn read(file: Option<&Path>) -> Result<(WorkerConfig, toml::Table), BoxError> {
    let Some(path) = file else { return Ok((WorkerConfig::default(), toml::Table::new())) };
    let text = std::fs::read_to_string(path).map_err(|e| BoxError::Config(format!("--config: cannot read {}: {e}", path.display())))?;
    let in_file = |e: toml::de::Error| BoxError::Config(format!("{}: {e}", path.display()));
    Ok((toml::from_str(&text).map_err(in_file)?, toml::from_str(&text).map_err(in_file)?))
}

/// The box's part of a worker id: `render-07` of `render-07/gpu0` (a per-GPU file's id) or of
/// the default `render-07/cpu`; an id without such an end names the box as it is.
fn box_name(worker_id: &str) -> &str {
    match worker_id.rsplit_once('/') {
        Some((name, last)) if last == "cpu" || last.strip_prefix("gpu").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())) => name,
        _ => worker_id,
    }
}

/// Each worker's port: listed, or the base port + N.
fn ports(supervisor: &SupervisorConfig, listen: SocketAddr, cards: &[Card]) -> Result<Vec<u16>, BoxError> {
    let ports = if supervisor.metrics_ports.is_empty() {
        if listen.port() == 0 {
            return Err(BoxError::Config(
                "telemetry.listen: port 0 gives the workers no base port; set one (9400), or list them in `[supervisor] metrics_ports`".into(),
            ));
        }
        cards
            .iter()
            .map(|card| {
                u16::try_from(card.number).ok().and_then(|n| listen.port().checked_add(n)).ok_or_else(|| {
                    BoxError::Config(format!("telemetry.listen: port {} + {} is past 65535; set a lower one", listen.port(), card.number))
                })
            })
            .collect::<Result<Vec<_>, _>>()?
    } else if supervisor.metrics_ports.len() != cards.len() {
        return Err(BoxError::Config(format!(
            "supervisor.metrics_ports: {} port(s) for {} GPU(s) ({}); give one per GPU, in the order of --gpus",
            supervisor.metrics_ports.len(),
            cards.len(),
            cards.iter().map(Card::label).collect::<Vec<_>>().join(", ")
        )));
    } else {
        supervisor.metrics_ports.clone()
    };
    if let Some(twice) = ports.iter().enumerate().find_map(|(i, p)| ports[..i].contains(p).then_some(*p)) {
        return Err(BoxError::Config(format!("supervisor.metrics_ports: port {twice} is given to two workers")));
    }
    if ports.contains(&supervisor.listen.port()) {
        return Err(BoxError::Config(format!(
            "supervisor.listen: port {} is also a worker's metrics port; give the box's endpoint another",
            supervisor.listen.port()
        )));
    }
    Ok(ports)
}

/// `args` less the flags the supervisor sets per worker, with their values.
fn forwarded(args: &[OsString]) -> Vec<OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let text = arg.to_string_lossy();
        if SET_PER_WORKER.contains(&&*text) {
            args.next();
        } else if !SET_PER_WORKER.iter().any(|flag| text.strip_prefix(flag).is_some_and(|rest| rest.starts_with('='))) {
            out.push(arg.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    #[test]
    fn workers_get_the_boxs_flags_less_those_set_per_worker() {
        let args = os(&["--gpus", "all", "--config=/etc/w.toml", "--plain-logs", "--store", "s3://r/p", "--gpu", "3", "--metrics-addr=0.0.0.0:9400", "--classes", "auto"]);
        assert_eq!(forwarded(&args), os(&["--plain-logs", "--store", "s3://r/p", "--classes", "auto"]));
    }

    #[test]
    fn the_box_is_named_by_the_id_less_its_card() {
        assert_eq!(box_name("render-07/gpu0"), "render-07");
        assert_eq!(box_name("render-07/cpu"), "render-07");
        assert_eq!(box_name("box"), "box");
        assert_eq!(box_name("rack3/render-07"), "rack3/render-07");
        assert_eq!(box_name("render-07/gpu"), "render-07/gpu");
    }

    #[test]
    fn each_card_gets_its_own_worker_config_id_folder_port_and_arguments() {
        let dir = tempfile::tempdir().unwrap();
        let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../onnx/tiny/model");
        let file = dir.path().join("box.toml");
        std::fs::write(
            &file,
            format!(
                "worker_id = \"rack/gpu0\"\ndevice = \"cpu\"\nmodel = \"{}\"\nstate_dir = \"{}\"\n[store]\nurl = \"file:///tmp/x\"\n\
                 [budget.simulate]\ntotal_mib = 1\nothers_used_mib = 100\n[supervisor.gpu.1]\nclasses = [\"xs\"]\nbudget = {{ max_mib = 2000 }}\n",
                model.display(),
                dir.path().join("state").display()
            ),
        )
        .unwrap();
        let env: HashMap<String, String> = [("SHOTFLEET_GPUS".to_owned(), "sim:4096,1024".to_owned())].into();
        let inputs = BoxInputs {
            file: Some(&file),
            env: &env,
            flags: Overrides { grace_period: Some("7s".into()), ..Overrides::default() },
            gpus: "sim:4096,1024",
            args: os(&["--gpus", "sim:4096,1024", "--config", "box.toml", "--grace-period", "7s"]),
            program: "/bin/shotfleet-consumer".into(),
        };
        let plan = BoxPlan::resolve(inputs).unwrap();
        let [gpu0, gpu1] = &plan.workers[..] else { panic!("two workers: {plan:?}") };
        assert_eq!((gpu0.config.worker_id.as_str(), gpu1.config.worker_id.as_str()), ("rack/gpu0", "rack/gpu1"));
        assert_eq!(gpu1.config.state_dir, dir.path().join("state/gpu1"));
        assert_eq!(gpu1.file, dir.path().join("state/gpu1/worker.toml"));
        assert_eq!((gpu0.config.telemetry.listen.port(), gpu1.config.telemetry.listen.port()), (9400, 9401));
        let simulated = |w: &WorkerPlan| w.config.budget.simulate.clone().unwrap();
        assert_eq!((simulated(gpu0).total_mib, simulated(gpu1).total_mib, simulated(gpu1).others_used_mib), (4096, 1024, 100));
        assert_eq!((gpu0.config.budget.max_mib, gpu1.config.budget.max_mib), (None, Some(2000)));
        assert_eq!(gpu1.config.classes.to_string(), "xs");
        assert_eq!(gpu1.config.grace_period, std::time::Duration::from_secs(7), "the box's flags reach every worker");
        let args: Vec<String> = gpu1.command.args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        let state = dir.path().join("state/gpu1").display().to_string();
        let config = format!("{state}/worker.toml");
        let expected = ["--grace-period", "7s", "--config", &config, "--worker-id", "rack/gpu1", "--state-dir", &state, "--metrics-addr", "127.0.0.1:9401"];
        assert_eq!(args, expected);
        assert_eq!((gpu1.command.env.is_empty(), gpu1.command.env_remove.as_slice()), (true, &["SHOTFLEET_GPUS".to_owned()][..]));

        plan.write().unwrap();
        let written = std::fs::read_to_string(&gpu1.file).unwrap();
        let reread = WorkerConfig::resolve(Some(&gpu1.file), &HashMap::new(), Overrides::default()).unwrap();
        assert_eq!((reread.budget.max_mib, reread.classes.to_string()), (Some(2000), "xs".to_owned()), "{written}");
        assert!(!written.contains("\n[supervisor"), "{written}");
    }

    fn sim(numbers: &[u64]) -> Vec<Card> {
        cards::select(&Selection::Simulated(numbers.to_vec()), crate::config::DeviceKind::Cpu, &Visible::All).unwrap()
    }

    #[test]
    fn ports_follow_the_base_port_or_the_list() {
        let listen: SocketAddr = "127.0.0.1:9400".parse().unwrap();
        let supervisor = SupervisorConfig::default();
        assert_eq!(ports(&supervisor, listen, &sim(&[1, 1])).unwrap(), [9400, 9401]);
        let listed = SupervisorConfig { metrics_ports: vec![7001, 7002], ..SupervisorConfig::default() };
        assert_eq!(ports(&listed, listen, &sim(&[1, 1])).unwrap(), [7001, 7002]);
        let short = ports(&listed, listen, &sim(&[1, 1, 1])).unwrap_err().to_string();
        assert!(short.contains("2 port(s) for 3 GPU(s) (gpu0, gpu1, gpu2)"), "{short}");
        let clash = SupervisorConfig { listen: "127.0.0.1:9401".parse().unwrap(), ..SupervisorConfig::default() };
        assert!(ports(&clash, listen, &sim(&[1, 1])).unwrap_err().to_string().contains("also a worker's metrics port"));
        let zero = ports(&supervisor, "127.0.0.1:0".parse().unwrap(), &sim(&[1])).unwrap_err().to_string();
        assert!(zero.contains("metrics_ports"), "{zero}");
    }
}
