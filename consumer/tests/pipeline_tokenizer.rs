//! Both CLIP tokenizers against the ids transformers 5.24 gives SDXL (`reference/tokens.json`,
//! written by `onnx/make_tiny.py` with `padding="max_length", max_length=77, truncation=True`):
//! unicode, CJK, emoji with joiners, punctuation runs (tokenizer_2 pads with `!`, a special
//! token, so `!!!` is three pads there), contractions, whitespace, HTML entities, full-width
//! text, literal special tokens, a prompt past 77 tokens and the empty prompt. Exact match.
mod pipeline_support;

use pipeline_support::{model_dir, reference_dir};
use serde::Deserialize;
use shotfleet_consumer::pipeline::tokenizer::ClipTokenizer;

#[derive(Deserialize)]
struct Entry {
    prompt: String,
    tokenizer: Vec<u32>,
    tokenizer_2: Vec<u32>,
}

#[test]
fn tokenizer_ids_match_transformers_exactly() {
    let text = std::fs::read_to_string(reference_dir().join("tokens.json")).expect("tokens.json");
    let entries: Vec<Entry> = serde_json::from_str(&text).expect("tokens.json parses");
    assert!(entries.len() >= 10, "expected the tricky prompts");
    let first = ClipTokenizer::load(&model_dir().join("tokenizer")).expect("tokenizer");
    let second = ClipTokenizer::load(&model_dir().join("tokenizer_2")).expect("tokenizer_2");
    let mut failures = Vec::new();
    for entry in &entries {
        for (name, tokenizer, expected) in
            [("tokenizer", &first, &entry.tokenizer), ("tokenizer_2", &second, &entry.tokenizer_2)]
        {
            let ids = tokenizer.encode(&entry.prompt).expect("encode");
            assert_eq!(ids.len(), 77, "{name} {:?}: padded/truncated to 77", entry.prompt);
            if &ids != expected {
                failures.push(format!("{name} {:?}:\n  ours   {ids:?}\n  theirs {expected:?}", entry.prompt));
            }
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn long_prompt_keeps_bos_and_eos() {
    let tokenizer = ClipTokenizer::load(&model_dir().join("tokenizer")).unwrap();
    let ids = tokenizer.encode(&"cat ".repeat(200)).unwrap();
    assert_eq!(ids.len(), 77);
    assert_eq!(ids[0], 49406);
    assert_eq!(ids[76], 49407);
}
