"""Makes LoRA fixtures for the tiny model, and diffusers' renders with them as references.

    /work/venv-onnx/bin/python onnx/make_lora_fixtures.py      # writes onnx/tiny/lora/ (~20 s)

Files (float16 tensors, as most published LoRAs):

| file | format | covers |
| --- | --- | --- |
| kohya_sgm.safetensors | kohya / A1111 / ComfyUI: `lora_unet_*`, `lora_te1_*`, `lora_te2_*`, `.lora_down` / `.lora_up` / `.alpha`, with the SGM block names real SDXL kohya files use (`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`) | UNet attention and feed-forward linears, proj_in/out, resnet convolutions (3x3 conv1/conv2, 1x1 conv_shortcut), time_emb_proj, down/upsampler convolutions; every attention and MLP linear of both text encoders. Rank 4, alpha 2 |
| kohya_diffusers_names.safetensors | some of the same tensors under diffusers block names (`lora_unet_down_blocks_1_attentions_0_...`), as SD 1.5-era kohya files name them | a sample: down_blocks.1.attentions.0, up_blocks.1.resnets.0, the downsampler, the mid block, layer 0 of both text encoders |
| peft.safetensors | diffusers / PEFT (`unet.` / `text_encoder.` / `text_encoder_2.` + `lora_A` / `lora_B`), written by `StableDiffusionXLPipeline.save_lora_weights` from adapters PEFT added, with diffusers' `lora_adapter_metadata` (r 2, lora_alpha 3) | UNet attention linears and resnet conv1 / conv2; attention linears of both text encoders |
| sd15.safetensors | kohya names of an SD 1.5 LoRA (`lora_te_`, `down_blocks_0_attentions`) | refusal tests |
| sd3.safetensors | PEFT names of an SD3 LoRA (`transformer.transformer_blocks.0.attn.to_q`) | refusal tests |
| pickle.pt | `torch.save` of a LoRA state dict (a zip with a pickle inside) | refusal tests |

References (`reference/cases.json`, one folder per case with `image.npy` uint8 [n, h, w, 3] and
`latents_final.npy`): diffusers' StableDiffusionXLPipeline on the same seeded tiny models,
`load_lora_weights` of each file as its own adapter, then `set_adapters(names, weights)`:

| case | base case (prompt, size, steps, seed) | LoRAs |
| --- | --- | --- |
| kohya_1.0 | cat_64 | kohya_sgm 1.0 |
| peft_0.7 | lighthouse_128x96 | peft 0.7 |
| stack_0.8_0.5 | cat_64 | kohya_sgm 0.8 + peft 0.5 |
| zero | cat_64 | kohya_sgm 0.0 (checked here to equal the base cat_64 image exactly) |
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import make_tiny  # noqa: E402

OUT = HERE / "tiny" / "lora"
KOHYA_RANK, KOHYA_ALPHA = 4, 2.0
PEFT_RANK, PEFT_ALPHA = 2, 3.0
# Each LoRA moves a layer's output by about this fraction of what the layer itself gives: enough
# to change the images clearly, little enough that they are not saturated noise.
STRENGTH = 0.3

UNET_KOHYA = re.compile(r"(attentions\.\d+\.(proj_in|proj_out|transformer_blocks\.\d+\.(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))))"
                        r"|(resnets\.\d+\.(conv1|conv2|conv_shortcut|time_emb_proj))|((down|up)samplers\.0\.conv)$")
TE_LINEARS = re.compile(r"encoder\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.(fc1|fc2))$")
PEFT_UNET_MODULES = ["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"]
PEFT_TE_MODULES = ["q_proj", "k_proj", "v_proj", "out_proj"]


# ---------------------------------------------------------------------------------------------
# Low-rank weights
# ---------------------------------------------------------------------------------------------


def low_rank(weight: torch.Tensor, rank: int, scale: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(down [r, in(, kh, kw)], up [out, r(, 1, 1)]) with scale * up @ down about STRENGTH x the weight."""
    out_features, in_features = weight.shape[0], weight.shape[1]
    kernel = tuple(weight.shape[2:])
    down = torch.randn((rank, in_features) + kernel, generator=g) / np.sqrt(in_features * max(1, np.prod(kernel)))
    # (up @ down) entries have std sqrt(rank) * std(up) * std(down); aim at STRENGTH * std(weight).
    sigma_up = STRENGTH * float(weight.std()) / (scale * np.sqrt(rank) * float(down.std()))
    up = torch.randn((out_features, rank) + (1,) * len(kernel), generator=g) * sigma_up
    return down.half(), up.half()


def modules(model, pattern: re.Pattern, part: str) -> dict[str, torch.nn.Module]:
    return {te_path(part, name): m for name, m in model.named_modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and pattern.search(name)}


def te_path(part: str, path: str) -> str:
    """Text encoder module paths as checkpoints (and LoRA files) name them: `text_model.encoder...`
    (transformers 5 builds CLIPTextModel without the `text_model` level)."""
    inner = part != "unet" and path.startswith(("encoder.", "embeddings.", "final_layer_norm"))
    return "text_model." + path if inner else path


# ---------------------------------------------------------------------------------------------
# kohya names
# ---------------------------------------------------------------------------------------------


def sgm_path(path: str, layers_per_block: int, up_has_attention: list[bool]) -> str:
    """diffusers UNet module path -> the SGM (LDM) path kohya uses for SDXL."""
    resnet_parts = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
                    "conv_shortcut": "skip_connection"}

    def resnet_tail(tail: str) -> str:
        return resnet_parts.get(tail, tail)

    per = layers_per_block + 1
    if m := re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", path):
        block, kind, layer, tail = int(m[1]), m[2], int(m[3]), m[4]
        inner = 0 if kind == "resnets" else 1
        tail = resnet_tail(tail) if kind == "resnets" else tail
        return f"input_blocks.{1 + block * per + layer}.{inner}.{tail}"
    if m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv", path):
        return f"input_blocks.{(int(m[1]) + 1) * per}.0.op"
    if m := re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)", path):
        kind, layer, tail = m[1], int(m[2]), m[3]
        index = {("resnets", 0): 0, ("attentions", 0): 1, ("resnets", 1): 2}[(kind, layer)]
        return f"middle_block.{index}.{resnet_tail(tail) if kind == 'resnets' else tail}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", path):
        block, kind, layer, tail = int(m[1]), m[2], int(m[3]), m[4]
        inner = 0 if kind == "resnets" else 1
        return f"output_blocks.{block * per + layer}.{inner}.{resnet_tail(tail) if kind == 'resnets' else tail}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv", path):
        block = int(m[1])
        return f"output_blocks.{block * per + layers_per_block}.{2 if up_has_attention[block] else 1}.conv"
    raise ValueError(f"no SGM name for {path}")


def kohya_state_dict(unet_loras: dict, te1_loras: dict, te2_loras: dict, unet_name) -> dict[str, torch.Tensor]:
    sd = {}
    for prefix, loras, name_of in (("lora_unet_", unet_loras, unet_name), ("lora_te1_", te1_loras, lambda p: p),
                                   ("lora_te2_", te2_loras, lambda p: p)):
        for path, (down, up) in loras.items():
            key = prefix + name_of(path).replace(".", "_")
            sd[f"{key}.lora_down.weight"] = down
            sd[f"{key}.lora_up.weight"] = up
            sd[f"{key}.alpha"] = torch.tensor(KOHYA_ALPHA, dtype=torch.float16)
    return sd


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def write_kohya(models, g: torch.Generator) -> None:
    from safetensors.torch import save_file

    scale = KOHYA_ALPHA / KOHYA_RANK
    unet_loras = {p: low_rank(m.weight, KOHYA_RANK, scale, g) for p, m in modules(models["unet"], UNET_KOHYA, "unet").items()}
    te1 = {p: low_rank(m.weight, KOHYA_RANK, scale, g) for p, m in modules(models["text_encoder"], TE_LINEARS, "text_encoder").items()}
    te2 = {p: low_rank(m.weight, KOHYA_RANK, scale, g) for p, m in modules(models["text_encoder_2"], TE_LINEARS, "text_encoder_2").items()}
    cfg = models["unet"].config
    up_attention = ["CrossAttn" in t for t in cfg.up_block_types]
    meta = {"ss_network_module": "networks.lora", "ss_network_dim": str(KOHYA_RANK), "ss_network_alpha": str(KOHYA_ALPHA),
            "ss_base_model_version": "sdxl_base_v1-0"}
    sgm = kohya_state_dict(unet_loras, te1, te2, lambda p: sgm_path(p, cfg.layers_per_block, up_attention))
    save_file(sgm, OUT / "kohya_sgm.safetensors", metadata=meta)
    # The diffusers-named copy holds a sample (small fixture): a test checks it reads as the same
    # targets as the SGM-named file.
    sample = {p: t for p, t in unet_loras.items() if p.startswith(("down_blocks.1.attentions.0", "up_blocks.1.resnets.0",
                                                                     "down_blocks.0.downsamplers", "mid_block"))}
    first = {p: t for p, t in te1.items() if ".layers.0." in p}
    first2 = {p: t for p, t in te2.items() if ".layers.0." in p}
    save_file(kohya_state_dict(sample, first, first2, lambda p: p), OUT / "kohya_diffusers_names.safetensors", metadata=meta)
    print(f"kohya: {len(unet_loras)} UNet, {len(te1)} + {len(te2)} text encoder modules")


def write_peft(g: torch.Generator) -> None:
    """PEFT adds the adapters to fresh copies of the models; diffusers saves them."""
    from diffusers import StableDiffusionXLPipeline
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    models = make_tiny.build()
    scale = PEFT_ALPHA / PEFT_RANK
    configs = {
        "unet": LoraConfig(r=PEFT_RANK, lora_alpha=PEFT_ALPHA, target_modules=PEFT_UNET_MODULES, init_lora_weights=False),
        "text_encoder": LoraConfig(r=PEFT_RANK, lora_alpha=PEFT_ALPHA, target_modules=PEFT_TE_MODULES, init_lora_weights=False),
        "text_encoder_2": LoraConfig(r=PEFT_RANK, lora_alpha=PEFT_ALPHA, target_modules=PEFT_TE_MODULES, init_lora_weights=False),
    }
    layers = {}
    for part, config in configs.items():
        model = models[part]
        inject_adapter_in_model(config, model, adapter_name="default")
        for _, m in model.named_modules():
            if hasattr(m, "lora_A") and "default" in m.lora_A:
                down, up = low_rank(m.base_layer.weight, PEFT_RANK, scale, g)
                m.lora_A["default"].weight.data = down.float().reshape(m.lora_A["default"].weight.shape)
                m.lora_B["default"].weight.data = up.float().reshape(m.lora_B["default"].weight.shape)
        layers[part] = {te_path(part, k): v.half() for k, v in get_peft_model_state_dict(model).items()}
    StableDiffusionXLPipeline.save_lora_weights(
        OUT, unet_lora_layers=layers["unet"], text_encoder_lora_layers=layers["text_encoder"],
        text_encoder_2_lora_layers=layers["text_encoder_2"], weight_name="peft.safetensors",
        unet_lora_adapter_metadata=configs["unet"].to_dict(),
        text_encoder_lora_adapter_metadata=configs["text_encoder"].to_dict(),
        text_encoder_2_lora_adapter_metadata=configs["text_encoder_2"].to_dict(),
    )
    print(f"peft: {sum(len(v) for v in layers.values()) // 2} modules")


def write_refused(g: torch.Generator) -> None:
    from safetensors.torch import save_file

    def pair(out_features, in_features):
        return torch.randn(2, in_features, generator=g).half(), torch.randn(out_features, 2, generator=g).half()

    sd15 = {}
    for key, (o, i) in {"lora_te_text_model_encoder_layers_0_self_attn_q_proj": (8, 8),
                        "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q": (8, 8),
                        "lora_unet_up_blocks_3_attentions_2_transformer_blocks_0_attn2_to_k": (8, 12)}.items():
        down, up = pair(o, i)
        sd15 |= {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up, f"{key}.alpha": torch.tensor(2.0).half()}
    save_file(sd15, OUT / "sd15.safetensors", metadata={"ss_base_model_version": "sd_v1"})
    sd3 = {}
    for key in ("transformer.transformer_blocks.0.attn.to_q", "transformer.transformer_blocks.0.attn.add_k_proj",
                "transformer.context_embedder"):
        down, up = pair(8, 8)
        sd3 |= {f"{key}.lora_A.weight": down, f"{key}.lora_B.weight": up}
    save_file(sd3, OUT / "sd3.safetensors")
    down, up = pair(8, 8)
    torch.save({"lora_unet_down_blocks_1_attentions_0_proj_in.lora_down.weight": down,
                "lora_unet_down_blocks_1_attentions_0_proj_in.lora_up.weight": up}, OUT / "pickle.pt")


# ---------------------------------------------------------------------------------------------
# diffusers references
# ---------------------------------------------------------------------------------------------

CASES = [
    dict(name="kohya_1.0", base="cat_64", loras=[("kohya_sgm", 1.0)]),
    dict(name="peft_0.7", base="lighthouse_128x96", loras=[("peft", 0.7)]),
    dict(name="stack_0.8_0.5", base="cat_64", loras=[("kohya_sgm", 0.8), ("peft", 0.5)]),
    dict(name="zero", base="cat_64", loras=[("kohya_sgm", 0.0)]),
]


def applied_modules(model) -> int:
    return sum(1 for _, m in model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A) > 0)


def write_references() -> None:
    models = make_tiny.build()
    tokenizers = make_tiny.load_tokenizers(HERE / "tiny" / "model")
    pipe = make_tiny.make_pipeline(models, tokenizers)
    for adapter in ("kohya_sgm", "peft"):
        pipe.load_lora_weights(str(OUT), weight_name=f"{adapter}.safetensors", adapter_name=adapter)
    print("modules with adapters:", {p: applied_modules(getattr(pipe, p)) for p in ("unet", "text_encoder", "text_encoder_2")})
    base_cases = {c["name"]: c for c in make_tiny.CASES}
    ref = OUT / "reference"
    entries = []
    for case in CASES:
        names = [n for n, _ in case["loras"]]
        weights = [w for _, w in case["loras"]]
        pipe.set_adapters(names, weights)
        base = base_cases[case["base"]]
        folder = ref / case["name"]
        make_tiny.run_case(pipe, base, folder)
        # Keep only what the Rust parity test reads.
        for f in folder.iterdir():
            if f.name not in ("image.npy", "latents_final.npy"):
                f.unlink()
        entries.append({"name": case["name"], "base": case["base"],
                        "loras": [{"file": f"{n}.safetensors", "weight": w} for n, w in case["loras"]]})
        print(case["name"], "done")
    (ref / "cases.json").write_text(json.dumps(entries, indent=2) + "\n")
    zero = np.load(ref / "zero" / "image.npy")
    base = np.load(HERE / "tiny" / "reference" / "cat_64" / "image.npy")
    assert np.array_equal(zero, base), "a LoRA at weight 0 must leave diffusers' image unchanged"
    moved = np.abs(np.load(ref / "kohya_1.0" / "image.npy").astype(int) - base.astype(int))
    print(f"kohya_1.0 vs base: mean {moved.mean():.1f} levels, max {moved.max()}")


def main() -> None:
    torch.set_grad_enabled(False)
    OUT.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(14)
    write_kohya(make_tiny.build(), g)
    write_peft(g)
    write_refused(g)
    write_references()
    sizes = {p.name: p.stat().st_size for p in sorted(OUT.iterdir()) if p.is_file()}
    print(json.dumps(sizes, indent=1))


if __name__ == "__main__":
    main()
