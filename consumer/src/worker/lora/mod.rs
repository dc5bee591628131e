//! LoRA sets for the worker's jobs: a job's `loras` resolved through the library into the set it
//! asks for, the set's files fetched only when the pool has no copy of it, merged and placed
//! through the pool off the async threads, and the pool counted by the budget as a line of its
//! own.
//!
//! A set is known by its files' sha256 (read from the library's sidecars when the job is taken)
//! and their weights ([`SetKey`]): a LoRA replaced in the library (`lora push --replace`) is a
//! new set, and one deleted from it fails the jobs that still name it even while its set is on
//! the device: the library decides what exists. Every render binds its own job's set and no
//! other (`Pipeline::render_with_loras`); jobs rendered together share one set (`group.rs`).
//!
//! **Budget.** A set already on the device is held for the job before its room is reserved (so
//! reserving cannot push it off) and costs the plan nothing; a set to place adds its exact
//! bytes to the job's reservation, which hands them to the pool's line once it is placed
//! ([`Loras::place`]). A card that cannot hold one image of the job beside its set is treated
//! as one that cannot hold the image (`render.rs`): offered to the fleet, then degraded to a
//! smaller size, and failed with reason `oom` at its floor, saying so.
//!
//! **How errors end a job** (`settle`): a LoRA that is unknown, corrupt in the library, refused,
//! or made for another model: `invalid`, with a detail that says what to push; the library's
//! store failing for now, or the local cache: a failed attempt (nak with backoff); the store
//! refusing this worker for good: as any store refusal (the job goes back, the worker stops);
//! no device memory to place the set: given back; a model without LoRA maps: a failed attempt
//! (another worker may take the job), reason `attempts` at the limit with the fix in the detail.
//!
//! **Order.** A slot is dealt jobs that name the same LoRAs at the same weights, and the same
//! size, steps and guidance (`reserve.rs`), so they can share batches; should taking them tell
//! them apart after all (a LoRA replaced in between), the groups whose set is on the device go
//! first (`group.rs`).
//!
//! - `config`: the `[lora]` section.

mod config;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use shotfleet_schema::ShotJob;
use tracing::{debug, info};

pub use config::LoraConfig;

use crate::budget::{DeviceLine, MIB, Reservation};
use crate::config::WorkerConfig;
use crate::failure::{ErrorKind, JobError, classify_text};
use crate::library::{LibraryError, LibraryErrorKind, LoraLibrary};
use crate::pipeline::Pipeline;
use crate::pipeline::lora::{Acquired, Adapter, LoraError, LoraPool, ResidentSet, SetKey, Source};
use crate::telemetry;
use crate::worker::Shared;

/// How long a job waits when its set found no device memory to be placed in.
const NO_DEVICE_MEMORY_DELAY: Duration = Duration::from_secs(1);

/// The library and the pool of one worker.
pub struct Loras {
    library: LoraLibrary,
    pool: Arc<LoraPool>,
    /// Why the model takes no LoRAs (no maps, or a quantized UNet); `None` when it takes them.
    refusal: Option<String>,
}

/// The set a job asks for: its LoRAs that change something (weight not 0) and their key.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct JobSet {
    pub key: SetKey,
    loras: Vec<Named>,
}

#[derive(Debug, Clone, PartialEq)]
struct Named {
    name: String,
    sha256: String,
    weight: f32,
}

impl fmt::Display for JobSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, lora) in self.loras.iter().enumerate() {
            write!(f, "{}{}:{}", if i > 0 { "+" } else { "" }, lora.name, lora.weight)?;
        }
        Ok(())
    }
}

/// A job's set on its way to the device.
pub(crate) enum Pending {
    /// The base model: nothing to place.
    Base,
    /// On the device already, held for the job.
    Held(Acquired),
    /// To be placed: its exact bytes (the budget plans them), and its files when it must be
    /// merged (`None`: the pool keeps it in host memory).
    ToPlace { set: JobSet, bytes: u64, adapters: Option<Vec<Adapter>> },
}

impl Pending {
    /// The device bytes placing the set will take: what the job's plan adds.
    pub fn bytes(&self) -> u64 {
        match self {
            Pending::ToPlace { bytes, .. } => *bytes,
            Pending::Base | Pending::Held(_) => 0,
        }
    }
}

/// What the pool's loader says when it was called without the files.
enum Miss {
    Files,
    Lora(LoraError),
}

impl From<LoraError> for Miss {
    fn from(e: LoraError) -> Self {
        Miss::Lora(e)
    }
}

impl Loras {
    /// Opens the library (no I/O on the store) and an empty pool sized for a card whose budget
    /// has `idle_room` bytes beside the models.
    ///
    /// # Errors
    /// The store's settings, or the cache folder cannot be made.
    pub fn open(config: &WorkerConfig, env: Vec<(String, String)>, pipeline: &Pipeline, idle_room: u64) -> Result<Loras, LibraryError> {
        let library_config = config.lora.library(&config.state_dir);
        let library = LoraLibrary::open(&config.store, &library_config, env)?;
        let limits = config.lora.pool_limits(idle_room);
        let refusal = pipeline.require_loras().err().map(|e| e.to_string());
        info!(
            library = library.location(),
            cache = %library_config.cache_dir.display(),
            pool_device_mib = limits.device_bytes / MIB,
            pool_host_mib = limits.host_bytes / MIB,
            takes_loras = refusal.is_none(),
            "LoRA library and pool"
        );
        Ok(Loras { library, pool: Arc::new(LoraPool::new(limits)), refusal })
    }

    /// The pool as a line of the budget.
    pub fn line(&self) -> Arc<dyn DeviceLine> {
        self.pool.clone()
    }

    /// Before the sessions are rebuilt: every set off the device (they belong to the sessions).
    pub(crate) fn before_reload(&self) {
        self.pool.shrink_device_to(0);
    }

    /// Device bytes of the pool's sets (the leak guard's idle usage leaves them out).
    pub(crate) fn device_bytes(&self) -> u64 {
        self.pool.device_bytes()
    }

    /// Whether `set` is on the device now (the base model always is).
    pub(crate) fn is_resident(&self, set: Option<&JobSet>) -> bool {
        set.is_none_or(|set| self.pool.is_resident(&set.key))
    }

    /// Sets the pool's gauges.
    pub(crate) fn export(&self) {
        telemetry::lora_pool_bytes(self.pool.device_bytes(), self.pool.host_bytes());
    }

    /// The set `job` asks for, through the library's sidecars; `None` for the base model (no
    /// LoRA, or only LoRAs at weight 0, which are still looked up: a misspelt name fails the job).
    ///
    /// # Errors
    /// A [`JobError`] by the library error's kind (module docs); a model without LoRA maps.
    pub(crate) async fn resolve(&self, job: &ShotJob) -> Result<Option<JobSet>, JobError> {
        let mut loras = Vec::new();
        for lora in &job.loras {
            let entry = self.library.entry(&lora.name).await.map_err(library_error)?;
            if lora.weight != 0.0 {
                loras.push(Named { name: lora.name.clone(), sha256: entry.sha256, weight: lora.weight });
            }
        }
        if loras.is_empty() {
            return Ok(None);
        }
        if let Some(why) = &self.refusal {
            // Transient: another worker of the fleet may take LoRAs.
            return Err(JobError::transient(why.clone()));
        }
        let key = SetKey::new(loras.iter().map(|l| (l.sha256.clone(), l.weight)));
        Ok(Some(JobSet { key, loras }))
    }

    /// What getting `set` onto the device takes: nothing (the base model), nothing more (it is
    /// there: held now, so reserving room cannot push it off), or its bytes (from the pool's
    /// host copy, else from its files, fetched here and checked against the model).
    ///
    /// # Errors
    /// See the module docs.
    pub(crate) async fn pending(&self, shared: &Shared, set: Option<&JobSet>) -> Result<Pending, JobError> {
        let Some(set) = set else { return Ok(Pending::Base) };
        let pipeline = shared.pipeline();
        if self.pool.is_resident(&set.key)
            && let Some(held) = self.acquire(pipeline.clone(), set, None).await?
        {
            return Ok(Pending::Held(held));
        }
        if let Some(bytes) = self.pool.bytes_of(&set.key) {
            return Ok(Pending::ToPlace { set: set.clone(), bytes, adapters: None });
        }
        let adapters = self.fetch(set).await?;
        let bytes = pipeline.lora_set_bytes(&adapters).map_err(lora_error)?;
        Ok(Pending::ToPlace { set: set.clone(), bytes, adapters: Some(adapters) })
    }

    /// Puts the set on the device (merged or copied, off the async threads) and hands its bytes
    /// from `reservation` to the pool's line; the set to render with (`None`: the base model).
    ///
    /// # Errors
    /// See the module docs.
    pub(crate) async fn place(&self, shared: &Shared, pending: Pending, reservation: &mut Reservation) -> Result<Option<Arc<ResidentSet>>, JobError> {
        let (set, bytes, adapters) = match pending {
            Pending::Base => return Ok(None),
            Pending::Held(held) => return Ok(Some(held.set)),
            Pending::ToPlace { set, bytes, adapters } => (set, bytes, adapters),
        };
        let pipeline = shared.pipeline();
        let acquired = match self.acquire(pipeline.clone(), &set, adapters).await? {
            Some(acquired) => acquired,
            // Its host copy was dropped meanwhile: merge it from the files.
            None => {
                let adapters = self.fetch(&set).await?;
                self.acquire(pipeline, &set, Some(adapters)).await?.ok_or_else(|| JobError::transient("the LoRA pool asked for files it was given"))?
            }
        };
        reservation.release(bytes);
        Ok(Some(acquired.set))
    }

    /// The pool's acquire, off the async threads (a merge is seconds of CPU, a placement a
    /// copy of gigabytes). `Ok(None)`: the pool needs the files and `adapters` is `None`.
    async fn acquire(&self, pipeline: Arc<Pipeline>, set: &JobSet, adapters: Option<Vec<Adapter>>) -> Result<Option<Acquired>, JobError> {
        let (pool, key) = (self.pool.clone(), set.key.clone());
        let acquired = tokio::task::spawn_blocking(move || pool.acquire(&pipeline, &key, || adapters.ok_or(Miss::Files)))
            .await
            .map_err(|e| JobError::transient(format!("the LoRA set task failed: {e}")))?;
        let acquired = match acquired {
            Ok(Some(acquired)) => acquired,
            Ok(None) => return Err(JobError::transient("a base-model set was acquired")),
            Err(Miss::Files) => return Ok(None),
            Err(Miss::Lora(e)) => return Err(lora_error(e)),
        };
        let source = source_name(acquired.source);
        let elapsed_ms = acquired.elapsed.as_millis() as u64;
        if acquired.switched || acquired.source != Source::Resident {
            info!(loras = %set, source, switched = acquired.switched, elapsed_ms, "LoRA set on the device");
        } else {
            debug!(loras = %set, source, switched = false, elapsed_ms, "LoRA set on the device");
        }
        telemetry::lora_set(source, acquired.switched);
        self.export();
        Ok(Some(acquired))
    }

    /// The set's files from the library (its local cache first), each checked to be the file
    /// the job was resolved against.
    async fn fetch(&self, set: &JobSet) -> Result<Vec<Adapter>, JobError> {
        let mut adapters = Vec::with_capacity(set.loras.len());
        for lora in &set.loras {
            let fetched = self.library.fetch(&lora.name).await.map_err(library_error)?;
            if fetched.entry.sha256 != lora.sha256 {
                let detail = format!("LoRA `{}` was replaced in the library after the job was taken; taking the job again", lora.name);
                return Err(JobError::give_back(Duration::ZERO, detail));
            }
            adapters.push(Adapter { name: lora.name.clone(), file: fetched.file, weight: lora.weight });
        }
        Ok(adapters)
    }
}

/// The pool's sets are the budget's LoRA line: what no render holds can be given back.
impl DeviceLine for LoraPool {
    fn device_bytes(&self) -> u64 {
        LoraPool::device_bytes(self)
    }

    fn reclaimable_bytes(&self) -> u64 {
        self.idle_device_bytes()
    }

    fn reclaim(&self, bytes: u64) -> u64 {
        LoraPool::reclaim(self, bytes)
    }
}

fn source_name(source: Source) -> &'static str {
    match source {
        Source::Resident => "resident",
        Source::Host => "host",
        Source::Merged => "merged",
    }
}

/// A library error as a job error, by its kind.
fn library_error(e: LibraryError) -> JobError {
    let kind = match e.kind() {
        LibraryErrorKind::InvalidJob => ErrorKind::Invalid,
        LibraryErrorKind::Retry => ErrorKind::Transient,
        LibraryErrorKind::Operator => ErrorKind::LibraryUnusable,
    };
    JobError::new(kind, e.to_string())
}

/// A set that cannot be made or placed, as a job error.
fn lora_error(e: LoraError) -> JobError {
    if e.is_invalid_job() {
        return JobError::invalid(e.to_string());
    }
    match &e {
        LoraError::Device { source } => match classify_text(None, &source.to_string()) {
            ErrorKind::Oom => JobError::give_back(NO_DEVICE_MEMORY_DELAY, e.to_string()),
            ErrorKind::DriverFault => JobError::new(ErrorKind::DriverFault, e.to_string()),
            _ => JobError::transient(e.to_string()),
        },
        _ => JobError::transient(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_end_jobs_by_what_can_fix_them() {
        let unknown = LibraryError::Unknown { name: "mei".into(), location: "file:///lib".into() };
        let error = library_error(unknown);
        assert_eq!(error.kind, ErrorKind::Invalid);
        assert!(error.detail.contains("shotfleet lora push FILE --name mei"), "{}", error.detail);
        let cache = LibraryError::Cache { path: "/cache".into(), source: std::io::Error::other("disk full") };
        assert_eq!(library_error(cache).kind, ErrorKind::Transient);
        let shape = LoraError::Shape { lora: "mei".into(), part: shotfleet_schema::lora::Part::Unet, module: "m".into(), model: vec![4, 4], lora_shape: vec![8, 8] };
        assert_eq!(lora_error(shape).kind, ErrorKind::Invalid);
        let placed = LoraError::Device { source: ort::Error::new("Failed to allocate memory for requested buffer of size 100") };
        assert!(matches!(lora_error(placed).kind, ErrorKind::GiveBack { .. }));
        assert_eq!(lora_error(LoraError::NotPrepared { model: "/m".into() }).kind, ErrorKind::Transient);
    }

    #[test]
    fn a_set_reads_as_its_loras() {
        let named = |name: &str, weight| Named { name: name.into(), sha256: "ab".into(), weight };
        let set = JobSet { key: SetKey::new([("ab", 0.8), ("ab", 0.5)]), loras: vec![named("mei.v2", 0.8), named("ink", 0.5)] };
        assert_eq!(set.to_string(), "mei.v2:0.8+ink:0.5");
    }
}
