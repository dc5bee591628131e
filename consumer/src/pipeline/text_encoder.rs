//! Prompt to conditioning: both CLIP encoders, as diffusers' `StableDiffusionXLPipeline.encode_prompt`.
//!
//! Prompt embeddings are the penultimate hidden states of each encoder (`hidden_states[-2]`),
//! concatenated on the feature axis (768 + 1280 = 2048 for SDXL); the pooled embedding is
//! `text_embeds` of the second encoder.

use std::borrow::Cow;
use std::path::Path;

use ort::environment::Environment;
use ort::session::SessionInputValue;
use ort::value::DynTensor;
use shotfleet_schema::lora::Part;

use super::control::Runs;
use super::error::{LoadError, RenderError, Stage};
use super::model::{FolderConfig, TEXT_ENCODER, TEXT_ENCODER_2, TOKENIZER, TOKENIZER_2};
use super::session::{ModelSession, extract_f32, int_tensor};
use super::tokenizer::ClipTokenizer;
use super::PipelineOptions;
use super::lora::ResidentSet;

/// The conditioning of one prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptEmbeds {
    /// `[seq_len, dim]`, row-major.
    pub embeds: Vec<f32>,
    /// `[pooled_dim]`.
    pub pooled: Vec<f32>,
    pub seq_len: usize,
    pub dim: usize,
}

impl PromptEmbeds {
    /// All zeros, shaped like `self` (SDXL's negative conditioning for an absent negative prompt).
    pub fn zeros_like(&self) -> PromptEmbeds {
        PromptEmbeds {
            embeds: vec![0.0; self.embeds.len()],
            pooled: vec![0.0; self.pooled.len()],
            seq_len: self.seq_len,
            dim: self.dim,
        }
    }
}

/// What one encoder run gives: the penultimate hidden states `[1, seq, dim]` and, when asked,
/// one more output (the pooled `text_embeds`).
struct EncoderOutput {
    shape: Vec<usize>,
    hidden: Vec<f32>,
    extra: Option<Vec<f32>>,
}

/// One encoder with its tokenizer and the output that gives the penultimate layer.
struct Encoder {
    tokenizer: ClipTokenizer,
    session: ModelSession,
    input_ids: String,
    penultimate: String,
}

impl Encoder {
    fn load(
        env: &Environment,
        config: &FolderConfig,
        tokenizer_dir: &str,
        graph: &str,
        vocab_size: usize,
        options: &PipelineOptions,
    ) -> Result<Encoder, LoadError> {
        let tokenizer = ClipTokenizer::load(&config.dir.join(tokenizer_dir))?;
        let graph_path = config.dir.join(graph);
        // The tokenizer must not emit ids the embedding table lacks: ONNX Runtime would fail
        // (or read out of range) on the first prompt instead of at load.
        if tokenizer.vocab_size() != vocab_size {
            return Err(LoadError::Invalid {
                path: config.dir.join(tokenizer_dir).join("vocab.json"),
                detail: format!(
                    "tokenizer has {} tokens but {} has vocab_size {vocab_size}",
                    tokenizer.vocab_size(),
                    Path::new(graph).with_file_name("config.json").display()
                ),
            });
        }
        let session = ModelSession::load(env, &graph_path, options)?;
        let input_ids = session.require_input("input_ids", Some(2), false)?.name.clone();
        let penultimate = penultimate_output(&session)?;
        Ok(Encoder { tokenizer, session, input_ids, penultimate })
    }

    /// `overrides`: LoRA-merged weights bound by initializer name for this run only.
    fn run(&self, text: &str, extra: Option<&str>, overrides: &[(String, DynTensor)], runs: &Runs) -> Result<EncoderOutput, RenderError> {
        let ids = self.tokenizer.encode(text).map_err(RenderError::Tokenize)?;
        let ids: Vec<i64> = ids.into_iter().map(i64::from).collect();
        let port = self.session.input(&self.input_ids).expect("checked at load");
        let input = int_tensor(port, &[1, ids.len()], &ids).map_err(RenderError::runtime(Stage::TextEncode))?;
        let mut inputs: Vec<(Cow<'_, str>, SessionInputValue<'_>)> = vec![(self.input_ids.as_str().into(), input.into())];
        inputs.extend(overrides.iter().map(|(name, value)| (Cow::from(name.as_str()), SessionInputValue::from(value))));
        runs.check(Stage::TextEncode)?;
        let mut session = self.session.lock();
        let outputs = session.run_with_options(inputs, runs.plain_on(&self.session.device)).map_err(runs.err(Stage::TextEncode))?;
        let bad = |detail: String| RenderError::Output { stage: Stage::TextEncode, detail };
        let (shape, hidden) = extract_f32(&outputs[self.penultimate.as_str()]).map_err(bad)?;
        if shape.len() != 3 || shape[0] != 1 {
            return Err(bad(format!("{} has shape {shape:?}, expected [1, seq, dim]", self.penultimate)));
        }
        let extra = match extra {
            Some(name) => Some(extract_f32(&outputs[name]).map_err(bad)?.1),
            None => None,
        };
        Ok(EncoderOutput { shape, hidden, extra })
    }
}

/// `hidden_states.<k>` with the second-highest index: diffusers' `hidden_states[-2]`.
fn penultimate_output(session: &ModelSession) -> Result<String, LoadError> {
    let last = session
        .outputs
        .iter()
        .filter_map(|o| o.name.strip_prefix("hidden_states.")?.parse::<usize>().ok())
        .max()
        .filter(|&k| k >= 1)
        .ok_or_else(|| session.graph_err("no hidden_states.<k> outputs (export with output_hidden_states=True)".into()))?;
    let name = format!("hidden_states.{}", last - 1);
    session.require_output(&name, Some(3))?;
    Ok(name)
}

/// Both encoders of SDXL.
pub(crate) struct TextEncoders {
    first: Encoder,
    second: Encoder,
    pooled: String,
}

impl TextEncoders {
    /// Both encoders' sessions, first then second.
    pub(crate) fn sessions(&self) -> [&ModelSession; 2] {
        [&self.first.session, &self.second.session]
    }

    pub(crate) fn load(env: &Environment, config: &FolderConfig, options: &PipelineOptions) -> Result<TextEncoders, LoadError> {
        let first = Encoder::load(env, config, TOKENIZER, TEXT_ENCODER, config.text_encoder_vocab, options)?;
        let second = Encoder::load(env, config, TOKENIZER_2, TEXT_ENCODER_2, config.text_encoder_2_vocab, options)?;
        let pooled = second.session.require_output("text_embeds", Some(2))?.name.clone();
        Ok(TextEncoders { first, second, pooled })
    }

    /// Token ids of both tokenizers (for tests and diagnostics).
    pub(crate) fn token_ids(&self, text: &str) -> Result<(Vec<u32>, Vec<u32>), String> {
        Ok((self.first.tokenizer.encode(text)?, self.second.tokenizer.encode(text)?))
    }

    /// How many of `text`'s tokens the encoders do not read (the first tokenizer's count; both
    /// are CLIP's, of one length).
    pub(crate) fn tokens_cut(&self, text: &str) -> Result<usize, String> {
        self.first.tokenizer.tokens_cut(text)
    }

    /// The conditioning of `text`, with a LoRA set's text encoder weights when given.
    ///
    /// # Errors
    /// [`RenderError::Runtime`] from ONNX Runtime, or [`RenderError::Output`] on unexpected shapes.
    pub(crate) fn encode(&self, text: &str, loras: Option<&ResidentSet>, runs: &Runs) -> Result<PromptEmbeds, RenderError> {
        let (first, second) = match loras {
            Some(set) => (set.part(Part::TextEncoder), set.part(Part::TextEncoder2)),
            None => (&[][..], &[][..]),
        };
        let EncoderOutput { shape: shape1, hidden: hidden1, .. } = self.first.run(text, None, first, runs)?;
        let EncoderOutput { shape: shape2, hidden: hidden2, extra: pooled } = self.second.run(text, Some(&self.pooled), second, runs)?;
        if shape1[1] != shape2[1] {
            return Err(RenderError::Output {
                stage: Stage::TextEncode,
                detail: format!("encoders disagree on sequence length: {shape1:?} vs {shape2:?}"),
            });
        }
        let (seq_len, d1, d2) = (shape1[1], shape1[2], shape2[2]);
        let mut embeds = Vec::with_capacity(seq_len * (d1 + d2));
        for t in 0..seq_len {
            embeds.extend_from_slice(&hidden1[t * d1..(t + 1) * d1]);
            embeds.extend_from_slice(&hidden2[t * d2..(t + 1) * d2]);
        }
        Ok(PromptEmbeds { embeds, pooled: pooled.expect("asked for"), seq_len, dim: d1 + d2 })
    }
}
