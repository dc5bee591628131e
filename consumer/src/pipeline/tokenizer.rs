//! The two CLIP tokenizers of SDXL, built from `vocab.json` + `merges.txt`.
//!
//! Real SDXL folders ship no `tokenizer.json`, so the tokenizer is assembled from the `tokenizers`
//! crate's parts exactly as transformers' `CLIPTokenizer` assembles it (transformers 5: NFC,
//! whitespace collapsed, lowercase; CLIP's split regex then byte-level; BPE with the `</w>`
//! end-of-word suffix; `<bos> ... <eos>` around the text). The named special tokens (bos, eos,
//! unk, pad) are added as special tokens, as transformers does: for `tokenizer_2` that includes
//! the pad token `!`, so a literal `!` in a prompt is matched whole before BPE sees it.
//! Sequences are truncated and padded to `model_max_length` (77) as SDXL's pipeline asks.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Lowercase, NFC, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::roberta::RobertaProcessing;
use tokenizers::{
    AddedToken, PaddingDirection, PaddingParams, PaddingStrategy, SplitDelimiterBehavior, Tokenizer,
    TruncationDirection, TruncationParams, TruncationStrategy,
};

use super::error::LoadError;

/// CLIP's word split, as transformers' `CLIPTokenizer` defines it.
const CLIP_SPLIT: &str =
    r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+";

/// One CLIP tokenizer with its fixed sequence length.
pub struct ClipTokenizer {
    inner: Tokenizer,
    max_length: usize,
    /// Highest token id the tokenizer can produce; checked against the text encoder's vocabulary.
    max_id: u32,
}

/// `tokenizer_config.json` (and, where it leaves a token out, `special_tokens_map.json`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct TokenizerConfig {
    model_max_length: Option<f64>,
    bos_token: Option<Value>,
    eos_token: Option<Value>,
    unk_token: Option<Value>,
    pad_token: Option<Value>,
    added_tokens_decoder: BTreeMap<String, AddedTokenConfig>,
}

#[derive(Debug, Deserialize)]
struct AddedTokenConfig {
    content: String,
    #[serde(default)]
    single_word: bool,
    #[serde(default)]
    lstrip: bool,
    #[serde(default)]
    rstrip: bool,
    normalized: Option<bool>,
    #[serde(default = "yes")]
    special: bool,
}

fn yes() -> bool {
    true
}

impl AddedTokenConfig {
    /// A token given as a string or as transformers' serialised `AddedToken` object.
    fn from_value(value: &Value) -> Option<AddedTokenConfig> {
        match value {
            Value::String(s) => Some(AddedTokenConfig {
                content: s.clone(),
                single_word: false,
                lstrip: false,
                rstrip: false,
                normalized: None,
                special: true,
            }),
            Value::Object(_) => serde_json::from_value(value.clone()).ok(),
            _ => None,
        }
    }

    fn to_added_token(&self) -> AddedToken {
        AddedToken::from(self.content.clone(), self.special)
            .single_word(self.single_word)
            .lstrip(self.lstrip)
            .rstrip(self.rstrip)
            .normalized(self.normalized.unwrap_or(!self.special))
    }
}

impl ClipTokenizer {
    /// Builds the tokenizer of folder `dir` (`tokenizer/` or `tokenizer_2/`).
    ///
    /// # Errors
    /// [`LoadError`] naming the file that is missing or malformed.
    pub fn load(dir: &Path) -> Result<ClipTokenizer, LoadError> {
        let vocab = require(dir.join("vocab.json"))?;
        let merges = require(dir.join("merges.txt"))?;
        let config_path = dir.join("tokenizer_config.json");
        let mut config: TokenizerConfig = read_json_or_default(&config_path)?;
        let map_path = dir.join("special_tokens_map.json");
        let map: TokenizerConfig = read_json_or_default(&map_path)?;
        // The special tokens map fills what the config leaves out.
        config.bos_token = config.bos_token.or(map.bos_token);
        config.eos_token = config.eos_token.or(map.eos_token);
        config.unk_token = config.unk_token.or(map.unk_token);
        config.pad_token = config.pad_token.or(map.pad_token);

        let token = |value: &Option<Value>, default: &str| {
            value.as_ref().and_then(AddedTokenConfig::from_value).unwrap_or(AddedTokenConfig {
                content: default.to_owned(),
                single_word: false,
                lstrip: false,
                rstrip: false,
                normalized: None,
                special: true,
            })
        };
        let bos = token(&config.bos_token, "<|startoftext|>");
        let eos = token(&config.eos_token, "<|endoftext|>");
        let unk = token(&config.unk_token, "<|endoftext|>");
        let pad = token(&config.pad_token, "<|endoftext|>");

        let tok_err = |path: &Path, e: &dyn std::fmt::Display| LoadError::Tokenizer {
            path: path.to_path_buf(),
            detail: e.to_string(),
        };
        let bpe = BPE::from_file(&path_str(&vocab), &path_str(&merges))
            .continuing_subword_prefix(String::new())
            .end_of_word_suffix("</w>".into())
            .fuse_unk(false)
            .unk_token(unk.content.clone())
            .build()
            .map_err(|e| tok_err(&vocab, &e))?;
        let mut inner = Tokenizer::new(bpe);
        let normalizer = NormalizerSequence::new(vec![
            NFC.into(),
            Replace::new(tokenizers::normalizers::replace::ReplacePattern::Regex(r"\s+".into()), " ")
                .map_err(|e| tok_err(dir, &e))?
                .into(),
            Lowercase.into(),
        ]);
        inner.with_normalizer(Some(normalizer));
        let split = Split::new(SplitPattern::Regex(CLIP_SPLIT.into()), SplitDelimiterBehavior::Removed, true)
            .map_err(|e| tok_err(dir, &e))?;
        // Python's `ByteLevel(add_prefix_space=False)`: trim_offsets and use_regex keep their
        // defaults (true), as in transformers.
        inner.with_pre_tokenizer(Some(PreTokenizerSequence::new(vec![
            split.into(),
            ByteLevel::new(false, true, true).into(),
        ])));
        inner.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));

        let mut added: Vec<AddedToken> =
            config.added_tokens_decoder.values().map(AddedTokenConfig::to_added_token).collect();
        for named in [&bos, &eos, &unk, &pad] {
            if !added.iter().any(|t| t.content == named.content) {
                added.push(named.to_added_token());
            }
        }
        inner.add_special_tokens(&added);

        let id = |t: &AddedTokenConfig| {
            inner.token_to_id(&t.content).ok_or_else(|| LoadError::Tokenizer {
                path: vocab.clone(),
                detail: format!("special token {:?} is not in the vocabulary", t.content),
            })
        };
        let (bos_id, eos_id, pad_id) = (id(&bos)?, id(&eos)?, id(&pad)?);
        inner.with_post_processor(Some(
            RobertaProcessing::new((eos.content.clone(), eos_id), (bos.content.clone(), bos_id))
                .trim_offsets(false)
                .add_prefix_space(false),
        ));

        let max_length = config.model_max_length.filter(|&m| (2.0..=4096.0).contains(&m)).unwrap_or(77.0) as usize;
        inner
            .with_truncation(Some(TruncationParams {
                direction: TruncationDirection::Right,
                max_length,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
            }))
            .map_err(|e| tok_err(&config_path, &e))?;
        inner.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::Fixed(max_length),
            direction: PaddingDirection::Right,
            pad_to_multiple_of: None,
            pad_id,
            pad_type_id: 0,
            pad_token: pad.content.clone(),
        }));
        let max_id = inner.get_vocab(true).values().copied().max().unwrap_or(0);
        Ok(ClipTokenizer { inner, max_length, max_id })
    }

    /// Token ids of `text`: `<bos>`, at most `max_length - 2` tokens, `<eos>`, then padding.
    ///
    /// # Errors
    /// The tokenizer's own error text (not expected for valid UTF-8).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        let encoding = self.inner.encode(text, true).map_err(|e| e.to_string())?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn max_length(&self) -> usize {
        self.max_length
    }

    /// How many of `text`'s tokens fall past what the text encoder reads (0: it reads them all).
    ///
    /// # Errors
    /// The tokenizer's own error text.
    pub fn tokens_cut(&self, text: &str) -> Result<usize, String> {
        let encoding = self.inner.encode(text, true).map_err(|e| e.to_string())?;
        // Each overflowing piece is framed by its own `<bos>` and `<eos>`, and padded.
        let real = |piece: &tokenizers::Encoding| piece.get_attention_mask().iter().filter(|&&m| m == 1).count().saturating_sub(2);
        Ok(encoding.get_overflowing().iter().map(real).sum())
    }

    /// The number of ids the tokenizer can produce (highest id + 1).
    pub fn vocab_size(&self) -> usize {
        self.max_id as usize + 1
    }
}

fn require(path: PathBuf) -> Result<PathBuf, LoadError> {
    if path.is_file() { Ok(path) } else { Err(LoadError::MissingFile { path }) }
}

fn path_str(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

/// Reads a JSON file, or the type's default when the file is absent (both tokenizer configs are
/// optional: CLIP's defaults are what SDXL uses).
pub(crate) fn read_json_or_default<T: serde::de::DeserializeOwned + Default>(path: &Path) -> Result<T, LoadError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|source| LoadError::Json { path: path.to_path_buf(), source }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(T::default()),
        Err(source) => Err(LoadError::Io { path: path.to_path_buf(), source }),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn tokens_past_the_encoders_length_are_counted() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../onnx/tiny/model/tokenizer");
        let tokenizer = super::ClipTokenizer::load(&dir).unwrap();
        assert_eq!(tokenizer.tokens_cut("a cat").unwrap(), 0);
        let short = "a lighthouse keeper at dawn ".repeat(10);
        let long = "a lighthouse keeper at dawn ".repeat(20);
        assert_eq!(tokenizer.tokens_cut(&short).unwrap(), 0, "fifty words fit");
        let cut = tokenizer.tokens_cut(&long).unwrap();
        // Twice the words: about as many tokens past the 75 read as the first ten repeats take.
        assert!((20..=60).contains(&cut), "{cut}");
    }
}
