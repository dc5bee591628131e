"""Times diffusers' StableDiffusionXLPipeline on the tiny fixture model on the CPU, per image.

    /work/venv-onnx/bin/python onnx/bench_diffusers_tiny.py [--steps 20] [--repeats 5] [--threads N]

The reference column for the CPU benchmark the Rust consumer prints: same weights (rebuilt from the
fixture's seeds), same scheduler, guidance 5.0, one image per call, at 64x64 and 128x128. Each stage
is timed on its own (best of --repeats after one warm-up; the minimum is the steadiest
estimate on a shared machine):

  text       pipe.encode_prompt (both CLIP encoders, prompt + zero negative)
  unet_loop  pipe(..., prompt_embeds=..., output_type="latent"): the denoising loop with guidance
  vae        vae.decode(latents / scaling_factor)
  to_uint8   image_processor.postprocess(..., "np") then (x * 255).round() as uint8
  png        PNG encoding of the uint8 image with Pillow
  pipeline   one plain end-to-end pipe(prompt, output_type="np") call, for comparison
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import make_tiny  # noqa: E402

PROMPT = "a photo of a cat"


def best_time(fn, repeats: int) -> tuple[float, object]:
    result = fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def bench(pipe, width: int, height: int, steps: int, repeats: int) -> dict:
    from PIL import Image

    guidance = 5.0
    noise = torch.randn(1, 4, height // 8, width // 8, generator=torch.Generator().manual_seed(0))
    row = {}

    row["text"], embeds = best_time(
        lambda: pipe.encode_prompt(PROMPT, num_images_per_prompt=1, do_classifier_free_guidance=True), repeats
    )
    pe, npe, ppe, nppe = embeds

    def loop():
        return pipe(prompt_embeds=pe, negative_prompt_embeds=npe, pooled_prompt_embeds=ppe,
                    negative_pooled_prompt_embeds=nppe, width=width, height=height, num_inference_steps=steps,
                    guidance_scale=guidance, latents=noise.clone(), output_type="latent").images

    row["unet_loop"], latents = best_time(loop, repeats)
    sf = pipe.vae.config.scaling_factor
    row["vae"], decoded = best_time(lambda: pipe.vae.decode(latents / sf, return_dict=False)[0], repeats)

    def to_uint8():
        x = pipe.image_processor.postprocess(decoded, output_type="np")
        return (x * 255).round().clip(0, 255).astype(np.uint8)

    row["to_uint8"], u8 = best_time(to_uint8, repeats)

    def png():
        buf = io.BytesIO()
        Image.fromarray(u8[0]).save(buf, format="PNG")
        return buf.getvalue()

    row["png"], _ = best_time(png, repeats)
    row["sum"] = sum(row[k] for k in ("text", "unet_loop", "vae", "to_uint8", "png"))
    row["pipeline"], _ = best_time(
        lambda: pipe(PROMPT, width=width, height=height, num_inference_steps=steps, guidance_scale=guidance,
                     latents=noise.clone(), output_type="np"),
        repeats,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--sizes", default="64x64,128x128", help="comma list of WIDTHxHEIGHT")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    models = make_tiny.build()
    pipe = make_tiny.make_pipeline(models, make_tiny.load_tokenizers(HERE / "tiny" / "model"))
    cols = ["text", "unet_loop", "vae", "to_uint8", "png", "sum", "pipeline"]
    print(f"diffusers tiny SDXL, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.steps} steps, guidance 5.0, 1 image; best of {args.repeats}, milliseconds per image")
    print(f"{'size':>9} " + " ".join(f"{c:>10}" for c in cols))
    for size in args.sizes.split(","):
        w, h = (int(v) for v in size.split("x"))
        row = bench(pipe, w, h, args.steps, args.repeats)
        print(f"{size:>9} " + " ".join(f"{row[c] * 1000:10.2f}" for c in cols), flush=True)


if __name__ == "__main__":
    main()
