//! Which model a LoRA was made for, and which module paths SDXL has.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::Part;

/// The model family a LoRA file's keys belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    Sdxl,
    /// Stable Diffusion 1.x / 2.x: one text encoder (`lora_te_`), attention in the first UNet level.
    Sd1,
    /// SD3 / Flux: a transformer (`transformer.`, `double_blocks`, `joint_blocks`, ...).
    Sd3OrFlux,
    Unknown,
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Arch::Sdxl => "sdxl",
            Arch::Sd1 => "sd1",
            Arch::Sd3OrFlux => "sd3/flux",
            Arch::Unknown => "unknown",
        })
    }
}

/// Key fragments only SD3 / Flux LoRAs have.
const TRANSFORMER_MARKERS: [&str; 9] = [
    "double_blocks",
    "single_blocks",
    "single_transformer_blocks",
    "joint_blocks",
    "context_embedder",
    "x_embedder",
    "context_block",
    "x_block",
    "lora_transformer_",
];
const TRANSFORMER_PREFIXES: [&str; 3] = ["transformer.", "diffusion_model.", "base_model.model.transformer"];

/// A raw key that says the file is not for SDXL, and for which model.
pub(super) fn foreign_key(key: &str) -> Option<Arch> {
    if TRANSFORMER_PREFIXES.iter().any(|p| key.starts_with(p)) || TRANSFORMER_MARKERS.iter().any(|m| key.contains(m)) {
        return Some(Arch::Sd3OrFlux);
    }
    // kohya's SD 1.x/2.x files: one text encoder, and attention at the UNet's first level (SDXL's
    // first level has none; SGM input blocks 1-2 are that level).
    const SD1: [&str; 5] = ["lora_te_", "lora_unet_down_blocks_0_attentions", "lora_unet_input_blocks_1_1_", "lora_unet_input_blocks_2_1_", "lora_unet_up_blocks_3_"];
    SD1.iter().any(|m| key.starts_with(m)).then_some(Arch::Sd1)
}

/// A canonical UNet module path that says the file is for SD 1.x/2.x.
pub(super) fn sd1_module(module: &str) -> bool {
    module.starts_with("down_blocks.0.attentions") || module.starts_with("up_blocks.3.")
}

/// Module paths of SDXL's parts that carry a Linear or Conv2d weight; `#` is any index.
const UNET_TOP: [&str; 6] = [
    "conv_in",
    "conv_out",
    "time_embedding.linear_1",
    "time_embedding.linear_2",
    "add_embedding.linear_1",
    "add_embedding.linear_2",
];
const UNET_BLOCKS: [&str; 3] = ["down_blocks.#", "up_blocks.#", "mid_block"];
const UNET_INNER: [&str; 16] = [
    "resnets.#.conv1",
    "resnets.#.conv2",
    "resnets.#.conv_shortcut",
    "resnets.#.time_emb_proj",
    "attentions.#.proj_in",
    "attentions.#.proj_out",
    "attentions.#.transformer_blocks.#.attn1.to_q",
    "attentions.#.transformer_blocks.#.attn1.to_k",
    "attentions.#.transformer_blocks.#.attn1.to_v",
    "attentions.#.transformer_blocks.#.attn1.to_out.0",
    "attentions.#.transformer_blocks.#.attn2.to_q",
    "attentions.#.transformer_blocks.#.attn2.to_k",
    "attentions.#.transformer_blocks.#.attn2.to_v",
    "attentions.#.transformer_blocks.#.attn2.to_out.0",
    "attentions.#.transformer_blocks.#.ff.net.0.proj",
    "attentions.#.transformer_blocks.#.ff.net.2",
];
const UNET_SAMPLERS: [&str; 2] = ["downsamplers.0.conv", "upsamplers.0.conv"];
const TEXT: [&str; 7] = [
    "text_model.encoder.layers.#.self_attn.q_proj",
    "text_model.encoder.layers.#.self_attn.k_proj",
    "text_model.encoder.layers.#.self_attn.v_proj",
    "text_model.encoder.layers.#.self_attn.out_proj",
    "text_model.encoder.layers.#.mlp.fc1",
    "text_model.encoder.layers.#.mlp.fc2",
    "text_projection",
];

/// Whether SDXL's `part` has a LoRA-adaptable module at `path`.
pub(super) fn sdxl_has(part: Part, path: &str) -> bool {
    match part {
        Part::TextEncoder | Part::TextEncoder2 => TEXT.iter().any(|p| matches(p, path)),
        Part::Unet => {
            UNET_TOP.contains(&path)
                || UNET_BLOCKS.iter().any(|block| {
                    let Some(rest) = strip_pattern(block, path) else { return false };
                    UNET_INNER.iter().chain(&UNET_SAMPLERS).any(|inner| matches(inner, rest))
                })
        }
    }
}

/// `path` matches `pattern` token by token (`#`: one all-digit token).
fn matches(pattern: &str, path: &str) -> bool {
    strip_pattern(pattern, path) == Some("")
}

/// What follows `pattern` (and its dot) in `path`, when `path` starts with it.
fn strip_pattern<'p>(pattern: &str, path: &'p str) -> Option<&'p str> {
    let mut rest = Some(path);
    for want in pattern.split('.') {
        let (token, tail) = match rest?.split_once('.') {
            Some((token, tail)) => (token, Some(tail)),
            None => (rest?, None),
        };
        let ok = if want == "#" { !token.is_empty() && token.bytes().all(|b| b.is_ascii_digit()) } else { token == want };
        if !ok {
            return None;
        }
        rest = tail;
    }
    Some(rest.unwrap_or(""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sdxl_module_paths() {
        for path in [
            "down_blocks.1.attentions.0.transformer_blocks.9.attn1.to_q",
            "mid_block.resnets.1.conv_shortcut",
            "up_blocks.0.upsamplers.0.conv",
            "conv_in",
            "up_blocks.2.resnets.2.time_emb_proj",
        ] {
            assert!(sdxl_has(Part::Unet, path), "{path}");
        }
        for path in ["down_blocks.1.attentions.0.norm", "down_blocks.x.resnets.0.conv1", "down_blocks.1", "mid_blockz.resnets.0.conv1", "conv_in.0"] {
            assert!(!sdxl_has(Part::Unet, path), "{path}");
        }
        assert!(sdxl_has(Part::TextEncoder2, "text_model.encoder.layers.31.mlp.fc2"));
        assert!(!sdxl_has(Part::TextEncoder, "text_model.encoder.layers.0.layer_norm1"));
    }
}
