"""Builds the tiny SDXL-architecture fixture and its diffusers reference outputs.

    /work/venv-onnx/bin/python onnx/make_tiny.py            # writes onnx/tiny/model and onnx/tiny/reference

1. Builds UNet2DConditionModel (text_time), CLIPTextModel, CLIPTextModelWithProjection and AutoencoderKL
   from the tiny configs in sdxl_onnx.py with fixed seeds, plus SDXL's EulerDiscreteScheduler config and
   the real CLIP BPE vocabulary (from open-clip-torch).
2. Exports them to onnx/tiny/model/ in Optimum's SDXL layout (fp32, opset 17), makes the UNet's and
   text encoders' Linear/Conv weights overridable for LoRAs (lora_ready.py: <part>/lora_map.json,
   weights in <part>/model.onnx_data), and checks every part against torch with onnxruntime's CPU
   provider (onnx/tiny/model_check.json).
3. Runs diffusers' StableDiffusionXLPipeline (CPU, fp32) on the same weights for a few cases and saves
   the intermediate tensors and images under onnx/tiny/reference/, plus tokenizer ids for tricky prompts.

Everything is seeded; rerunning rewrites the same numbers (up to CPU floating-point nondeterminism,
which was not observed here).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import sdxl_onnx as sx  # noqa: E402

MODEL_SEED = 0

CASES = [
    # Empty negative prompt: diffusers is called with negative_prompt=None, so SDXL's
    # force_zeros_for_empty_prompt makes the negative embeddings (and pooled) exactly zero.
    dict(name="cat_64", prompt="a photo of a cat", negative_prompt="", width=64, height=64,
         steps=5, guidance=5.0, images=1, capture_step=2, seed=1),
    # Non-square (width 128, height 96), a real negative prompt, two images per prompt.
    dict(name="lighthouse_128x96", prompt="A watercolor painting of a lighthouse at dusk, highly detailed",
         negative_prompt="blurry, low quality", width=128, height=96, steps=6, guidance=7.0, images=2,
         capture_step=2, seed=2),
    # guidance 1.0: diffusers skips classifier-free guidance (UNet batch = images, no negative half).
    dict(name="no_cfg_64", prompt="an astronaut riding a horse", negative_prompt="", width=64, height=64,
         steps=3, guidance=1.0, images=1, capture_step=1, seed=3),
]

TOKEN_PROMPTS = [
    "a photo of a cat",
    "",
    "A Photo Of A CAT",
    "café au lait, naïve résumé, Ångström, façade",
    "一个女孩在雨中",
    "cat 🐱🚀 rocket 👩‍🚀 astronaut",
    "wow!!!???... really?!",
    "don't stop, it's fine, we're here, I'll go, they've, you'd, I'm",
    "   lots \t of\twhitespace \n\n and\r\nnewlines   ",
    "1024x1024, 3.14, 2024-11-30, 100%",
    "fish &amp; chips &lt;b&gt; &quot;quoted&quot;",
    "ＦＵＬＬＷＩＤＴＨ ｔｅｘｔ and ﬁ ligature",
    "<|startoftext|> literal special tokens <|endoftext|>",
    "a masterpiece, " * 30 + "the end",
]


def build(seed: int = MODEL_SEED):
    return sx.build_random_models(sx.SDXL_TINY, seed)


def export_fixture(models, model_dir: Path) -> None:
    import lora_ready

    model_dir.mkdir(parents=True, exist_ok=True)
    sx.export_all(models, model_dir)
    sx.write_configs(model_dir, models, sx.SDXL_SCHEDULER)
    sx.write_tokenizers(model_dir)
    # LoRA-targetable weights become overridable graph inputs, mapped in <part>/lora_map.json.
    lora_ready.prepare(model_dir, models)


# ---------------------------------------------------------------------------------------------
# torch vs onnxruntime, part by part
# ---------------------------------------------------------------------------------------------


def max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def check_parts(models, model_dir: Path, tokenizers) -> dict:
    import onnxruntime as ort

    def session(part):
        return ort.InferenceSession(str(model_dir / part / "model.onnx"), providers=["CPUExecutionProvider"])

    report = {}
    prompts = ["a photo of a cat", "A watercolor painting of a lighthouse at dusk, highly detailed"]
    for part, tok, proj in (("text_encoder", tokenizers[0], False), ("text_encoder_2", tokenizers[1], True)):
        ids = tok(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="np").input_ids
        sess = session(part)
        got = sess.run(None, {"input_ids": ids.astype(np.int32)})
        names = [o.name for o in sess.get_outputs()]
        with torch.no_grad():
            out = models[part](torch.from_numpy(ids.astype(np.int64)), output_hidden_states=True)
        head = [out.text_embeds, out.last_hidden_state] if proj else [out.last_hidden_state, out.pooler_output]
        want = [t.numpy() for t in head + list(out.hidden_states)]
        report[part] = {n: max_abs(g, w) for n, g, w in zip(names, got, want)}

    unet = session("unet")
    cfg = models["unet"].config
    pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
    g = torch.Generator().manual_seed(123)
    report["unet"] = {}
    for batch, h, w, t in ((2, 8, 8, 801.0), (4, 12, 16, 1.0)):
        x = torch.randn(batch, 4, h, w, generator=g)
        ehs = torch.randn(batch, 77, cfg.cross_attention_dim, generator=g)
        te = torch.randn(batch, pooled, generator=g)
        tid = torch.tensor([[h * 8.0, w * 8.0, 0.0, 0.0, h * 8.0, w * 8.0]] * batch)
        with torch.no_grad():
            want = models["unet"](x, torch.tensor(t), ehs, added_cond_kwargs={"text_embeds": te, "time_ids": tid}).sample
        got = unet.run(None, {"sample": x.numpy(), "timestep": np.array(t, dtype=np.float32),
                              "encoder_hidden_states": ehs.numpy(), "text_embeds": te.numpy(), "time_ids": tid.numpy()})[0]
        report["unet"][f"b{batch}_{h}x{w}_t{int(t)}"] = max_abs(got, want.numpy())

    vae = session("vae_decoder")
    report["vae_decoder"] = {}
    for batch, h, w in ((1, 8, 8), (2, 12, 16)):
        z = torch.randn(batch, 4, h, w, generator=g) / 0.13025
        with torch.no_grad():
            want = models["vae"].decode(z).sample
        got = vae.run(None, {"latent_sample": z.numpy()})[0]
        report["vae_decoder"][f"b{batch}_{h}x{w}"] = max_abs(got, want.numpy())
    return report


# ---------------------------------------------------------------------------------------------
# diffusers reference
# ---------------------------------------------------------------------------------------------


def load_tokenizers(model_dir: Path):
    from transformers import CLIPTokenizer

    return (
        CLIPTokenizer.from_pretrained(model_dir / "tokenizer"),
        CLIPTokenizer.from_pretrained(model_dir / "tokenizer_2"),
    )


def make_pipeline(models, tokenizers):
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline(
        vae=models["vae"],
        text_encoder=models["text_encoder"],
        text_encoder_2=models["text_encoder_2"],
        tokenizer=tokenizers[0],
        tokenizer_2=tokenizers[1],
        unet=models["unet"],
        scheduler=EulerDiscreteScheduler.from_config(sx.SDXL_SCHEDULER),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    assert pipe.vae_scale_factor == 8
    return pipe


def run_case(pipe, case: dict, out_dir: Path) -> dict:
    from PIL import Image

    out_dir.mkdir(parents=True, exist_ok=True)
    n, h, w = case["images"], case["height"], case["width"]
    noise = torch.randn(n, 4, h // 8, w // 8, generator=torch.Generator().manual_seed(case["seed"]))

    seen = {}

    def grab_unet_inputs(_module, args, kwargs):
        if "encoder_hidden_states" not in seen:
            seen["encoder_hidden_states"] = kwargs["encoder_hidden_states"].clone()
            seen["text_embeds"] = kwargs["added_cond_kwargs"]["text_embeds"].clone()
            seen["time_ids"] = kwargs["added_cond_kwargs"]["time_ids"].clone()

    steps = []

    def on_step_end(_pipe, i, _t, kwargs):
        steps.append(kwargs["latents"].clone())
        return kwargs

    hook = pipe.unet.register_forward_pre_hook(grab_unet_inputs, with_kwargs=True)
    try:
        with torch.no_grad():
            result = pipe(
                prompt=case["prompt"],
                negative_prompt=case["negative_prompt"] or None,
                width=w,
                height=h,
                num_inference_steps=case["steps"],
                guidance_scale=case["guidance"],
                num_images_per_prompt=n,
                latents=noise.clone(),
                output_type="np",
                callback_on_step_end=on_step_end,
                callback_on_step_end_tensor_inputs=["latents"],
            )
    finally:
        hook.remove()

    cfg_on = case["guidance"] > 1.0
    ehs, te, tid = seen["encoder_hidden_states"], seen["text_embeds"], seen["time_ids"]
    if cfg_on:
        neg_e, pos_e = ehs[:n], ehs[n:]
        neg_p, pos_p = te[:n], te[n:]
    else:
        # Without guidance diffusers never computes negative embeddings; store what it would
        # have used (zeros for an empty negative prompt) so every case has the same files.
        pos_e, pos_p = ehs, te
        neg_e, neg_p = torch.zeros_like(ehs), torch.zeros_like(te)

    save = lambda name, t: np.save(out_dir / f"{name}.npy", np.ascontiguousarray(t))  # noqa: E731
    save("latents_init", noise.numpy().astype(np.float32))
    save("prompt_embeds", pos_e.numpy())
    save("negative_prompt_embeds", neg_e.numpy())
    save("pooled_prompt_embeds", pos_p.numpy())
    save("negative_pooled_prompt_embeds", neg_p.numpy())
    save("add_time_ids", tid.numpy())
    save("timesteps", pipe.scheduler.timesteps.numpy().astype(np.float32))
    save("sigmas", pipe.scheduler.sigmas.numpy().astype(np.float32))
    for k, lat in enumerate(steps):
        save(f"latents_step_{k}", lat.numpy())
    save("latents_final", steps[-1].numpy())
    images = result.images  # float in [0, 1], NHWC
    u8 = (images * 255).round().clip(0, 255).astype(np.uint8)
    save("image", u8)
    Image.fromarray(u8[0]).save(out_dir / "image_0.png")
    if case["negative_prompt"] == "" and cfg_on:
        assert float(neg_e.abs().max()) == 0.0 and float(neg_p.abs().max()) == 0.0
    return {
        "init_noise_sigma": float(pipe.scheduler.init_noise_sigma),
        "unet_batch": int(ehs.shape[0]),
        "embed_dim": int(ehs.shape[-1]),
        "pooled_dim": int(te.shape[-1]),
    }


def write_tokens(tokenizers, ref_dir: Path) -> None:
    import transformers

    entries = []
    for p in TOKEN_PROMPTS:
        ids = [t(p, padding="max_length", max_length=77, truncation=True).input_ids for t in tokenizers]
        assert all(len(i) == 77 for i in ids)
        entries.append({"prompt": p, "tokenizer": ids[0], "tokenizer_2": ids[1]})
    (ref_dir / "tokens.json").write_text(json.dumps(entries, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    meta = {
        "ftfy": False,
        "transformers": transformers.__version__,
        "tokenizer_class": type(tokenizers[0]).__module__ + "." + type(tokenizers[0]).__name__,
        "note": (
            "transformers 5 has no pure-Python ('slow') CLIPTokenizer any more: CLIPTokenizer is backed by the "
            "Rust tokenizers library (normalizer NFC + whitespace runs -> ' ' + lowercase; CLIP split regex; "
            "byte-level BPE with '</w>'), and ftfy is never consulted, installed or not. These ids are what "
            "diffusers 0.42.1 feeds SDXL with this pinned transformers. Call: padding='max_length', "
            "max_length=77, truncation=True."
        ),
    }
    (ref_dir / "tokens_meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "tiny")
    ap.add_argument("--skip-reference", action="store_true")
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    model_dir, ref_dir = args.out / "model", args.out / "reference"
    models = build()
    export_fixture(models, model_dir)
    tokenizers = load_tokenizers(model_dir)
    assert tokenizers[0]("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]

    report = check_parts(models, model_dir, tokenizers)
    sizes = {p.name: sx.folder_size(p) for p in sorted(model_dir.iterdir()) if p.is_dir()}
    sizes["total"] = sx.folder_size(model_dir)
    io = {part: sx.describe_onnx(model_dir / part / "model.onnx")
          for part in ("text_encoder", "text_encoder_2", "unet", "vae_decoder")}
    (args.out / "model_check.json").write_text(
        json.dumps({"torch_vs_ort_max_abs": report, "bytes": sizes, "io": io}, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(json.dumps(sizes, indent=2))
    if args.skip_reference:
        return

    ref_dir.mkdir(parents=True, exist_ok=True)
    pipe = make_pipeline(models, tokenizers)
    cases = []
    for case in CASES:
        info = run_case(pipe, case, ref_dir / case["name"])
        cases.append({k: case[k] for k in ("name", "prompt", "negative_prompt", "width", "height", "steps",
                                           "guidance", "images", "capture_step", "seed")} | info)
        print(case["name"], info)
    (ref_dir / "cases.json").write_text(json.dumps(cases, ensure_ascii=False, indent=2) + "\n")
    write_tokens(tokenizers, ref_dir)


if __name__ == "__main__":
    main()
