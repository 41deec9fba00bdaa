"""What an encoder is, without loading it: its settings, its tiny configurations, its shape rules and
its identity.

Identity (``spec_identity``): kind, config, dtype, a hash of the weight files (or the seed of a
tiny model's random init) and library versions, computed without loading the model, so ``plan``
on a CPU head node and ``run`` on each GPU agree on it. ``cache.json`` stores it; a cache
is reused only when it matches. Nothing here imports torch, diffusers or transformers: ``cache
plan`` and ``reelcache --help`` start without them (cache/encoders.py loads the models).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from reelcache import UserError
from reelcache.settings import TEXT, check, setting

TINY_VIDEO = {
    # Tiny models carry latent statistics that are not 0/1, so a normalization that is skipped shows.
    "wan": (
        "AutoencoderKLWan",
        dict(
            base_dim=16,
            z_dim=4,
            dim_mult=[1, 2, 2],
            num_res_blocks=1,
            temperal_downsample=[False, True],
            latents_mean=[0.3, -0.2, 0.1, -0.4],
            latents_std=[1.5, 0.7, 2.0, 0.9],
        ),
    ),
    "cogvideox": (
        "AutoencoderKLCogVideoX",
        dict(
            block_out_channels=(16, 32),
            latent_channels=4,
            layers_per_block=1,
            down_block_types=("CogVideoXDownBlock3D",) * 2,
            norm_num_groups=4,
            up_block_types=("CogVideoXUpBlock3D",) * 2,
        ),
    ),
    "hunyuan": (
        "AutoencoderKLHunyuanVideo",
        dict(
            block_out_channels=(16, 32, 32),
            latent_channels=4,
            layers_per_block=1,
            down_block_types=("HunyuanVideoDownBlock3D",) * 3,
            norm_num_groups=4,
            up_block_types=("HunyuanVideoUpBlock3D",) * 3,
            spatial_compression_ratio=4,
            temporal_compression_ratio=4,
        ),
    ),
    "ltx": (
        "AutoencoderKLLTXVideo",
        dict(
            block_out_channels=(16, 32),
            decoder_block_out_channels=(16, 32),
            down_block_types=("LTXVideoDownBlock3D",) * 2,
            layers_per_block=(1, 1, 1),
            decoder_layers_per_block=(1, 1, 1),
            spatio_temporal_scaling=(True, False),
            decoder_spatio_temporal_scaling=(True, False),
            upsample_residual=(False, False),
            decoder_inject_noise=(False, False, False),
            upsample_factor=(1, 1),
            latent_channels=4,
            patch_size=4,
            patch_size_t=1,
            scaling_factor=1.3,
        ),
    ),
    "opensora-v1.2": ("OpenSoraVAE", {"layout": "hpcai-tech/OpenSora-VAE-v1.2 encoder", "tiny": True}),
    "sd-per-frame": (
        "AutoencoderKL",
        dict(
            block_out_channels=(16, 32),
            latent_channels=4,
            layers_per_block=1,
            down_block_types=("DownEncoderBlock2D",) * 2,
            norm_num_groups=4,
            up_block_types=("UpDecoderBlock2D",) * 2,
            scaling_factor=0.18215,
            shift_factor=0.0609,
        ),
    ),
}
# Temporal compression of the real models: a clip's frame count must be 1 + a multiple of it.
TEMPORAL_RATIO = {"wan": 4, "cogvideox": 4, "hunyuan": 4, "ltx": 8, "sd-per-frame": 1, "opensora-v1.2": 1}
# Height and width must be multiples of this (spatial compression x patch size), real and tiny.
SPATIAL_MULTIPLE = {
    "wan": (8, 4),
    "cogvideox": (8, 2),
    "hunyuan": (8, 4),
    "ltx": (32, 8),
    "sd-per-frame": (8, 2),
    "opensora-v1.2": (8, 2),
}


def _versions() -> dict:
    return {m: version(m) for m in ("torch", "diffusers", "transformers")}


def files_hash(path: Path) -> str:
    """sha256 over a model folder's weight and config files, cached beside them by (size, mtime)."""
    if Path(path).is_file():  # a single checkpoint file (the Open-Sora VAE's model.safetensors)
        files, path = [Path(path)], Path(path).parent
    else:
        files = sorted(
            p
            for p in Path(path).rglob("*")
            if p.is_file()
            and p.suffix in (".safetensors", ".bin", ".json", ".model", ".txt")
            and not p.name.startswith(".reelcache")
        )
    if not files:
        raise UserError(f"{path} holds no weights (*.safetensors, *.bin)")
    stamp = json.dumps([(str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in files])
    cache = Path(path) / ".reelcache-sha256.json"
    try:
        doc = json.loads(cache.read_text())
        if doc["stamp"] == stamp:
            return doc["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(path)).encode())
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    try:
        cache.write_text(json.dumps({"stamp": stamp, "sha256": h.hexdigest()}))
    except OSError:
        pass  # read-only weights folder: hash again next time
    return h.hexdigest()


def spec_identity(spec: EncoderSpec) -> dict:
    """What makes an encoder's outputs what they are, computed without loading the model."""
    if spec.tiny:
        config = TINY_VIDEO[spec.kind][1] if spec.kind in TINY_VIDEO else {"t5": "tiny", "tokenizer": "tiny"}
        weights = f"seeded-random:{spec.seed}"
    else:
        cfg = Path(spec.path) / "config.json"
        config = json.loads(cfg.read_text()) if cfg.exists() else TINY_VIDEO.get(spec.kind, ("", {}))[0]
        weights = files_hash(Path(spec.path))
    ident = {
        "kind": spec.kind,
        "tiny": spec.tiny,
        "config": _jsonable(config),
        "dtype": spec.dtype,
        "weights_sha256": weights,
        "versions": _versions(),
    }
    if spec.kind == "t5":
        ident["max_tokens"] = spec.max_tokens
    if spec.extra:
        ident["extra"] = _jsonable(spec.extra)
    return ident


def spatial_multiple(spec: EncoderSpec) -> int:
    """Crops are rounded down to this: e.g. the 240p 9:16 bucket (240, 426) is encoded as 240 x 424."""
    return SPATIAL_MULTIPLE[spec.kind][1 if spec.tiny else 0]


def temporal_ratio(spec: EncoderSpec) -> int:
    if spec.tiny and spec.kind not in ("hunyuan", "sd-per-frame"):
        return 2
    return TEMPORAL_RATIO.get(spec.kind, 1)


@dataclass
class EncoderSpec:
    kind: str = setting(
        doc="video: wan, cogvideox, hunyuan, ltx, opensora-v1.2, sd-per-frame; text: t5", choices=(*TINY_VIDEO, "t5")
    )
    path: str | None = setting(None, "a local weights folder (or the Open-Sora VAE's file)", pattern=TEXT)
    tiny: bool = setting(False, "seeded random weights of a tiny configuration (tests, the demo)")
    dtype: str = setting("bfloat16", "the encoder's dtype", choices=("bfloat16", "float16", "float32"))
    seed: int = setting(0, "tiny models: weights are randomly initialized from this seed", ge=0)
    max_tokens: int = setting(300, "text encoders: caption tokens", ge=1)
    extra: dict = setting(doc="opensora-v1.2: {spatial, temporal} sizes other than the published", factory=dict)

    def __post_init__(self):
        check(self)
        if not self.tiny and not self.path:
            raise UserError(f"encoder {self.kind!r}: give `path` (a local weights folder) or `tiny = true`")


def _jsonable(config) -> dict:
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return json.loads(json.dumps(d, default=str, sort_keys=True))
