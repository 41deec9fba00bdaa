"""Encoders behind one interface, and their identity.

Video encoders (``kind``): ``opensora-v1.2`` (cache/opensora_vae.py: the per-frame SDXL VAE and
the causal temporal VAE over 17-frame chunks, loading the public checkpoint), the diffusers
video VAEs through their own classes, ``wan`` (AutoencoderKLWan), ``cogvideox``, ``hunyuan``,
``ltx``; and ``sd-per-frame``, an image ``AutoencoderKL`` applied frame by frame.
Text encoder: ``t5`` (``T5EncoderModel``, T5-v1.1-XXL in Open-Sora 1.2, 300 tokens). Weights
always come from a local directory (``path``, loaded with ``HF_HUB_OFFLINE=1`` semantics); every
kind also has a ``tiny = true`` configuration with seeded random weights for tests and the demo.

Video VAEs return their posterior's mean and log-variance, normalized exactly as the model's
own diffusers pipeline normalizes latents before its transformer (``normalization``: each kind's
rule, with the pipeline file it comes from): z' = (z - shift) x scale per channel, applied to the
mean, with log(scale^2) added to the log-variance, so a sample drawn at load time is a sample of
the normalized posterior and is training-ready. ``VideoEncoder.decode`` is the inverse, for the
evaluation server's samples: z = z' / scale + shift, then the VAE's own decoder. The per-channel
shift and scale are tensors built once with the encoder, in fp32 whatever its dtype: the
normalization is computed in fp32 and only its result is stored in bf16.

Frames are folded into the batch (cache/frames.py: ``fold_frames``, [B, C, T, H, W] -> [(B T), C, H, W], and
``unfold_frames`` back) for the VAEs whose convolutions are 2-D: ``sd-per-frame`` (an image VAE,
so every frame is encoded alone) and the Open-Sora VAE's spatial stage (the SDXL VAE, per frame
before its temporal VAE compresses time). The video VAEs (``wan``, ``cogvideox``, ``hunyuan``,
``ltx``) take [B, C, T, H, W] as it is: their 3-D causal convolutions see time themselves.

What an encoder is (settings, tiny configurations, shape rules, identity) lives in cache/spec.py,
which loads nothing: import those names from there.
"""

from __future__ import annotations

import functools
import os
import re

from reelcache import UserError
from reelcache.cache.frames import fold_frames, unfold_frames
from reelcache.cache.spec import TINY_VIDEO, EncoderSpec, spatial_multiple, spec_identity, temporal_ratio
from reelcache.words import ADJ, CAMERA, PLACES, SUBJECTS, THINGS, VERBS

# torch, diffusers, transformers and tokenizers are imported inside the functions that use them:
# `cache plan` (cache/plan.py imports this module) computes identities on a CPU head node, and
# it and `reelcache --help` must start without loading them.

# LTX keeps its statistics as buffers of the VAE, not in its config: tiny values set after init.
TINY_LTX_STATS = {"latents_mean": [0.25, -0.5, 0.0, 0.75], "latents_std": [0.5, 1.25, 2.0, 0.8]}


def _dtype(name: str):
    import torch  # deferred: see the imports

    try:
        return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]
    except KeyError:
        raise UserError(f"dtype {name!r}: use bfloat16, float16 or float32") from None


class VideoEncoder:
    def __init__(self, spec: EncoderSpec, device: str = "cpu"):
        import diffusers  # deferred: see the imports
        import torch

        if spec.kind not in TINY_VIDEO:
            raise UserError(f"unknown video encoder {spec.kind!r}; choose one of {', '.join(TINY_VIDEO)}")
        self.spec, self.device, self.dtype = spec, device, _dtype(spec.dtype)
        cls_name, tiny_cfg = TINY_VIDEO[spec.kind]
        if spec.kind == "opensora-v1.2":
            from reelcache.cache.opensora_vae import OpenSoraVAE  # imports torch and diffusers

            torch.manual_seed(spec.seed)
            self.model = (
                OpenSoraVAE(tiny=True)
                if spec.tiny
                else OpenSoraVAE.from_checkpoint(
                    spec.path, spatial=spec.extra.get("spatial"), temporal=spec.extra.get("temporal")
                )
            )
        elif spec.tiny:
            torch.manual_seed(spec.seed)
            self.model = getattr(diffusers, cls_name)(**tiny_cfg)
            if spec.kind == "ltx":
                for name, values in TINY_LTX_STATS.items():
                    getattr(self.model, name).copy_(torch.tensor(values))
        else:
            self.model = getattr(diffusers, cls_name).from_pretrained(
                spec.path, torch_dtype=self.dtype, local_files_only=True
            )
        self.model = (
            self.model.to(device=device)
            if spec.tiny and spec.dtype == "float32"
            else self.model.to(device=device, dtype=self.dtype)
        )
        self.model.eval()
        self.per_frame = spec.kind == "sd-per-frame"
        self.opensora = spec.kind == "opensora-v1.2"  # normalizes inside its own encode
        # [1, C, 1, 1, 1] in fp32 on the model's device: the normalization is computed in fp32 (module docstring)
        shift, scale = normalization(spec.kind, self.model)
        self.shift = torch.tensor(shift, device=device, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self.scale = torch.tensor(scale, device=device, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self.logvar_shift = 2 * torch.log(self.scale)  # log(scale^2): the log-variance of (z - shift) x scale

    def identity(self) -> dict:
        return spec_identity(self.spec)

    @functools.cached_property
    def spatial_factor(self) -> int:
        """Pixels per latent along H and W, measured once on a small input (any VAE, tiny or real)."""
        import torch  # deferred: see the imports

        m = spatial_multiple(self.spec)
        t = 1 + temporal_ratio(self.spec) if not self.opensora else 1
        x = torch.zeros((1, t, 2 * m, 2 * m, 3), dtype=torch.uint8)
        return (2 * m) // self.encode(x)["mean"].shape[-1]

    def encode(self, frames) -> dict:
        """uint8 [B, T, H, W, 3] -> {'mean', 'logvar'}: [B, C, t, h, w], normalized, on CPU in bf16."""
        import torch  # deferred: see the imports

        x = torch.as_tensor(frames).to(self.device, non_blocking=True)
        x = x.permute(0, 4, 1, 2, 3).to(self.dtype).div_(127.5).sub_(1.0)  # [B, 3, T, H, W] in [-1, 1]
        with torch.inference_mode():
            if self.opensora:
                mean, logvar = self.model.encode(x)
            elif self.per_frame:
                dist = self.model.encode(fold_frames(x)).latent_dist
                mean, logvar = unfold_frames(dist.mean, len(x)), unfold_frames(dist.logvar, len(x))
            else:
                dist = self.model.encode(x).latent_dist
                mean, logvar = dist.mean, dist.logvar
            mean = (mean.float() - self.shift) * self.scale
            logvar = logvar.float() + self.logvar_shift
        return {"mean": mean.to(torch.bfloat16).cpu(), "logvar": logvar.to(torch.bfloat16).cpu()}

    def decode(self, z, num_frames: int):
        """Normalized latents [B, C, t, h, w] (as the cache stores them) -> uint8 video [B, T, H, W, 3].

        The inverse of ``encode``: z = z' / scale + shift per channel (the step each diffusers
        pipeline takes before ``vae.decode``), then the VAE's own decoder: the Open-Sora VAE
        un-normalizes and decodes itself (5-latent chunks, then every frame); ``sd-per-frame``
        decodes every frame; the video VAEs decode the clip. Causal VAEs return 1 + k x ratio
        frames: the first ``num_frames`` are kept. Real LTX-Video 0.9.1+ VAEs condition their
        decoder on a timestep; this decodes with the VAE's defaults (no timestep)."""
        import torch  # deferred: see the imports

        z = torch.as_tensor(z).to(self.device)
        with torch.inference_mode():
            if self.opensora:
                x = self.model.decode(z.to(self.dtype), num_frames=num_frames)
            else:
                raw = (z.float() / self.scale + self.shift).to(self.dtype)
                if self.per_frame:
                    x = unfold_frames(self.model.decode(fold_frames(raw)).sample, len(raw))
                else:
                    x = self.model.decode(raw).sample
        if x.shape[2] < num_frames:
            raise ValueError(
                f"the VAE decoded {x.shape[2]} frames from {z.shape[2]} latent frames, "
                f"fewer than the {num_frames} asked for"
            )
        return to_uint8(x[:, :, :num_frames])


def to_uint8(x):
    """[B, 3, T, H, W] in [-1, 1] -> uint8 [B, T, H, W, 3] on CPU (the inverse of the input's x / 127.5 - 1)."""
    import torch  # deferred: see the imports

    x = (x.float().clamp(-1, 1) + 1) * 127.5
    return x.round().to(torch.uint8).permute(0, 2, 3, 4, 1).contiguous().cpu()


def normalization(kind: str, model) -> tuple[list[float], list[float]]:
    """Per-channel (shift, scale) such that (z - shift) x scale is what the kind's diffusers
    pipeline feeds its transformer (the inverse of what it does to latents before ``vae.decode``).
    Files are under diffusers/pipelines/ (diffusers 0.42)."""
    cfg = getattr(model, "config", None)
    if kind == "opensora-v1.2":  # OpenSoraVAE.encode normalizes itself: (z - shift) / scale
        return [0.0], [1.0]
    if kind == "wan":
        # wan/pipeline_wan_i2v.py prepare_latents: (z - latents_mean) * (1 / latents_std), config values;
        # wan/pipeline_wan.py decodes latents / (1 / latents_std) + latents_mean.
        return list(cfg.latents_mean), [1.0 / s for s in cfg.latents_std]
    if kind == "ltx":
        # ltx/pipeline_ltx.py _normalize_latents: (z - latents_mean) * scaling_factor / latents_std with
        # vae.latents_mean / vae.latents_std BUFFERS (loaded with the weights) and config.scaling_factor,
        # the inverse of the _denormalize_latents call before vae.decode.
        sf = float(cfg.scaling_factor)
        return model.latents_mean.float().tolist(), [sf / s for s in model.latents_std.float().tolist()]
    if kind in ("hunyuan", "cogvideox"):
        # hunyuan_video/pipeline_hunyuan_video_image2video.py: z * scaling_factor (decode: / scaling_factor);
        # cogvideo/pipeline_cogvideox_video2video.py: scaling_factor * z. Their latents_mean/std are unused.
        return [0.0], [float(cfg.scaling_factor)]
    if kind == "sd-per-frame":
        if getattr(cfg, "latents_mean", None) is not None and getattr(cfg, "latents_std", None) is not None:
            # stable_diffusion_xl/pipeline_stable_diffusion_xl_img2img.py: (z - mean) * scaling_factor / std
            return list(cfg.latents_mean), [float(cfg.scaling_factor) / s for s in cfg.latents_std]
        # stable_diffusion_3/pipeline_stable_diffusion_3_img2img.py: (z - shift_factor) * scaling_factor;
        # stable_diffusion/pipeline_stable_diffusion_img2img.py (no shift_factor): scaling_factor * z.
        return [float(getattr(cfg, "shift_factor", None) or 0.0)], [float(cfg.scaling_factor)]
    raise UserError(f"no latent normalization rule for {kind!r}")


class TextEncoder:
    def __init__(self, spec: EncoderSpec, device: str = "cpu"):
        import torch  # deferred: see the imports
        from transformers import AutoTokenizer, T5Config, T5EncoderModel

        if spec.kind != "t5":
            raise UserError(f"unknown text encoder {spec.kind!r}; choose t5")
        self.spec, self.device, self.dtype = spec, device, _dtype(spec.dtype)
        if spec.tiny:
            self.tokenizer = tiny_tokenizer()
            torch.manual_seed(spec.seed)
            self.model = T5EncoderModel(
                T5Config(
                    vocab_size=len(self.tokenizer),
                    d_model=32,
                    d_kv=8,
                    d_ff=64,
                    num_layers=2,
                    num_heads=4,
                    pad_token_id=0,
                )
            )
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(spec.path, local_files_only=True)
            self.model = T5EncoderModel.from_pretrained(spec.path, torch_dtype=self.dtype, local_files_only=True)
        self.model = self.model.to(device=device, dtype=self.dtype).eval()

    def identity(self) -> dict:
        return spec_identity(self.spec)

    def encode(self, texts: list[str]) -> list:
        """Embeddings trimmed to each caption's real tokens: [L_i, D] bf16 on CPU."""
        import torch  # deferred: see the imports

        tok = self.tokenizer(texts, max_length=self.spec.max_tokens, padding=True, truncation=True, return_tensors="pt")
        with torch.inference_mode():
            h = self.model(
                input_ids=tok.input_ids.to(self.device), attention_mask=tok.attention_mask.to(self.device)
            ).last_hidden_state
        lens = tok.attention_mask.sum(1).tolist()
        return [h[i, :n].to(torch.bfloat16).cpu() for i, n in enumerate(lens)]


def tiny_tokenizer():
    """A real `tokenizers` word-level tokenizer over the demo captions' vocabulary (no download).

    The vocabulary is built explicitly in sorted order rather than trained: trainers break ties
    in an unspecified order, and a tokenizer that differs between processes would break the
    cache's bit-exact reproducibility.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors  # deferred: see the imports
    from transformers import PreTrainedTokenizerFast

    text = (
        " ".join(ADJ + PLACES + SUBJECTS + THINGS + VERBS + CAMERA) + " a an the and with in of while next to "
        "watches shows camera background . , ' !"
    )
    words = sorted({w.lower() for w in re.findall(r"\w+|[^\w\s]", text)})
    vocab = {tok: i for i, tok in enumerate(["<pad>", "</s>", "<unk>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")


def default_device() -> str:
    import torch  # deferred: see the imports

    return "cuda" if torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES", "0") != "" else "cpu"
