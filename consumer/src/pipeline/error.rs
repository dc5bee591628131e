//! Errors of the render pipeline.
//!
//! Two kinds: [`LoadError`] (the model folder cannot serve: missing file, wrong graph, bad
//! vocabulary) and [`RenderError`] (one render failed). ONNX Runtime's own error is kept whole in
//! both, code and message, because the worker classifies out-of-memory and driver faults from its
//! text (BFC arena messages, CUDA error strings).

use std::path::PathBuf;

use thiserror::Error;

/// A stage of a render, named in errors and timings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Stage {
    Tokenize,
    TextEncode,
    Unet,
    Vae,
    Png,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stage::Tokenize => "tokenize",
            Stage::TextEncode => "text_encode",
            Stage::Unet => "unet",
            Stage::Vae => "vae",
            Stage::Png => "png",
        })
    }
}

/// The model folder cannot be loaded. Every variant names the file at fault.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LoadError {
    #[error("{path}: missing (the folder must be in Hugging Face Optimum's SDXL ONNX layout)")]
    MissingFile { path: PathBuf },

    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    #[error("{path}: {detail}")]
    Invalid { path: PathBuf, detail: String },

    #[error("{path}: tokenizer cannot be built: {detail}")]
    Tokenizer { path: PathBuf, detail: String },

    /// ONNX Runtime refused the file (corrupt protobuf, unknown operator, no memory for weights).
    #[error("{path}: ONNX Runtime cannot load it: {source}")]
    Session {
        path: PathBuf,
        #[source]
        source: ort::Error,
    },

    /// The graph loaded but its inputs or outputs are not what the pipeline feeds.
    #[error("{path}: {detail}")]
    Graph { path: PathBuf, detail: String },

    /// A first run at load (the test encode, the warm-up render) failed: the device (out of
    /// memory, a fault) as often as the folder, so not told apart here.
    #[error("{path}: {detail}")]
    Run { path: PathBuf, detail: String },

    /// An option this build does not implement.
    #[error("unsupported: {detail}")]
    Unsupported { detail: String },

    /// The capped CPU arena (`PipelineOptions::cpu_arena_max_mem`) cannot be set up: ONNX
    /// Runtime refused it, or the process already has another cap (it is process-wide).
    #[error("capped CPU arena: {detail}")]
    CpuArena { detail: String },

    /// The ONNX Runtime library itself cannot be loaded or initialised.
    #[error("ONNX Runtime library {path}: {detail}")]
    Runtime { path: PathBuf, detail: String },

    /// The threads graph runs go through (`PipelineOptions::run_threads`) cannot be started.
    #[error("cannot start the pipeline's run threads: {0}")]
    Threads(String),
}

impl LoadError {
    /// Whether the folder itself is at fault (a file missing, a JSON, tokenizer or graph not as
    /// the pipeline needs, an option not built), as against the machine or a first run (reading
    /// the disk, ONNX Runtime's memory or library, the warm-up on the device): only those may
    /// mend on a restart.
    pub fn is_the_folders(&self) -> bool {
        matches!(
            self,
            Self::MissingFile { .. } | Self::Json { .. } | Self::Invalid { .. } | Self::Tokenizer { .. } | Self::Graph { .. } | Self::Unsupported { .. }
        )
    }
}

/// One render failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RenderError {
    /// The request cannot be rendered by this model (size not a multiple of the VAE factor, no
    /// images, zero steps...). Retrying will not help.
    #[error("invalid render request: {0}")]
    InvalidRequest(String),

    /// ONNX Runtime failed during a stage. The source keeps ONNX Runtime's code and message text
    /// unchanged; see [`RenderError::message`].
    #[error("{stage}: ONNX Runtime failed: {source}")]
    Runtime {
        stage: Stage,
        #[source]
        source: ort::Error,
    },

    /// A model produced something the pipeline cannot use (wrong shape or element type).
    #[error("{stage}: unexpected model output: {detail}")]
    Output { stage: Stage, detail: String },

    /// The tokenizer failed on the prompt.
    #[error("tokenize: {0}")]
    Tokenize(String),

    /// PNG encoding failed.
    #[error("png: {0}")]
    Png(#[from] png::EncodingError),

    /// The progress callback asked to stop.
    #[error("render cancelled after {steps_done} steps")]
    Cancelled { steps_done: u32 },

    /// A [`CancelHandle`](super::CancelHandle) stopped the render (the worker's time limit),
    /// during or between ONNX Runtime runs of `stage`.
    #[error("{stage}: render terminated through its cancel handle")]
    Terminated { stage: Stage },
}

impl RenderError {
    pub(crate) fn runtime(stage: Stage) -> impl Fn(ort::Error) -> RenderError + Copy {
        move |source| RenderError::Runtime { stage, source }
    }

    /// ONNX Runtime's message text, unchanged, when the error came from ONNX Runtime.
    pub fn message(&self) -> Option<&str> {
        match self {
            RenderError::Runtime { source, .. } => Some(source.message()),
            _ => None,
        }
    }

    /// ONNX Runtime's status code, when the error came from ONNX Runtime.
    pub fn code(&self) -> Option<ort::error::ErrorCode> {
        match self {
            RenderError::Runtime { source, .. } => Some(source.code()),
            _ => None,
        }
    }

    /// The stage that failed, where one applies.
    pub fn stage(&self) -> Option<Stage> {
        match self {
            RenderError::Runtime { stage, .. } | RenderError::Output { stage, .. } | RenderError::Terminated { stage } => Some(*stage),
            RenderError::Tokenize(_) => Some(Stage::Tokenize),
            RenderError::Png(_) => Some(Stage::Png),
            _ => None,
        }
    }
}
