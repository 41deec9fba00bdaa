"""What a cache costs: `cache plan`'s table of K = 1 .. max(K, 3) views (encodes, new vs reused from the
store, pixels, bytes in cache format 1 and in the store, GPU-hours) and the projection from the rate
finished units measured."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from reelcache.cache.spec import spatial_multiple, temporal_ratio
from reelcache.log import say

# Latent channels of the real VAEs where their config does not say (cache/encoders.py's kinds).
LATENT_CHANNELS = {"wan": 16, "cogvideox": 16, "hunyuan": 16, "ltx": 128, "opensora-v1.2": 4, "sd-per-frame": 4}
SAMPLE_OVERHEAD = 1536  # bytes per latent sample besides its tensors: tar header and padding, safetensors header


def latent_bytes(cfg, ident: dict, frames: int, height: int, width: int) -> int:
    """Bytes of one stored latent (bf16; mean and logvar for a posterior) from the encoder's geometry:
    C x t x H/f x W/f, with f its spatial multiple and t its temporal compression of the frames. An
    estimate where a VAE's geometry is not these rules; `cache run` reports the real shapes."""
    spec = cfg.video_encoder
    conf = ident["video_encoder"].get("config") or {}
    channels = conf.get("z_dim") or conf.get("latent_channels") or (4 if spec.tiny else LATENT_CHANNELS[spec.kind])
    if spec.kind == "opensora-v1.2":  # 17-frame chunks, 4x inside each (cache/opensora_vae.py: latent_frames)
        t = sum(-(-min(17, frames - i) // 4) for i in range(0, frames, 17))
    elif spec.kind == "sd-per-frame":
        t = frames
    else:
        t = 1 + (frames - 1) // temporal_ratio(spec)
    f = spatial_multiple(spec)
    return int(channels) * t * (height // f) * (width // f) * 2 * (2 if cfg.store == "posterior" else 1)


def view_costs(draws: list, cfg, ident: dict, tokens: float | None = None, upto: int | None = None) -> list[dict]:
    """What a cache of K = 1 .. upto views encodes and stores. `draws`: (caption, caption key, caption
    already stored, [draw of view 0, 1, ...]) per clip, a draw's ``reused`` true when the store holds its
    latent; `upto` at most as many views as each has (default: that many); `tokens`: measured tokens per
    caption (None: estimated from its words). Per K: ``encodes`` (distinct draws of views 0..K-1), ``new``
    (of them, not in the store: what runs), ``pixels`` and ``new_pixels``, ``bytes_before`` (cache format
    1: every sample holds its caption's embedding), ``bytes`` (the store: latents, each caption once),
    ``added`` (what this plan adds to the store) and ``text_bytes`` / ``text_bytes_before``."""
    conf = ident["text_encoder"].get("config") or {}
    width = 32 if cfg.text_encoder.tiny else int(conf.get("d_model", 4096))
    upto = upto or (len(draws[0][3]) if draws else 1)
    sizes: dict = {}
    names = ("encodes", "new", "pixels", "new_pixels", "latent", "new_latent", "text_before", "text", "new_text")
    per_view = [dict.fromkeys(names, 0) for _ in range(upto)]  # what view v adds
    first: dict = {}  # caption key -> (first view with a latent, its bytes, already stored)
    for caption, key, stored, views in draws:
        n = tokens or min(cfg.text_encoder.max_tokens, 1 + round(1.3 * len((caption or "").split())))
        text = n * width * 2 + SAMPLE_OVERHEAD
        for v, d in enumerate(views[:upto]):
            if d["bucket"] is None or d["same_as"] is not None:  # no latent, or an earlier view's
                continue
            shape = (d["num_frames"], d["height"], d["width"])
            if shape not in sizes:
                sizes[shape] = latent_bytes(cfg, ident, *shape) + SAMPLE_OVERHEAD
            add, pixels = per_view[v], d["num_frames"] * d["height"] * d["width"]
            add["encodes"] += 1
            add["pixels"] += pixels
            add["latent"] += sizes[shape]
            add["text_before"] += text
            if not d.get("reused"):
                add["new"] += 1
                add["new_pixels"] += pixels
                add["new_latent"] += sizes[shape]
            if v < first.get(key, (upto,))[0]:
                first[key] = (v, text, stored)
    for v, text, stored in first.values():  # each caption once, from the first view that uses it
        per_view[v]["text"] += text
        per_view[v]["new_text"] += 0 if stored else text
    out, total = [], dict.fromkeys(names, 0)
    for k in range(upto):  # K = k + 1 views: views 0..k
        total = {n: total[n] + per_view[k][n] for n in names}
        out.append(
            {"views": k + 1, "measured_tokens": tokens is not None}
            | {n: total[n] for n in ("encodes", "new", "pixels", "new_pixels")}
            | {
                "bytes_before": total["latent"] + total["text_before"],
                "bytes": total["latent"] + total["text"],
                "added": total["new_latent"] + total["new_text"],
                "text_bytes_before": total["text_before"],
                "text_bytes": total["text"],
            }
        )
    return out


def report(rows: list[dict], cdir: Path, clips: int, views: int, costs: list[dict]) -> None:
    """`cache plan`'s summary: buckets, what is encoded and what is reused, the cost table, the projection."""
    mine = [r for r in rows if r["bucket"] and r["same_as"] is None]
    by_bucket = Counter(r["bucket"] for r in mine)
    drawn = sum(1 for r in rows if r["bucket"])
    lost = Counter(r["no_bucket"] for r in rows if not r["bucket"])
    todo = [r for r in mine if r.get("reuse_shard") is None]
    frames = sum(r["num_frames"] for r in todo)
    pixels = sum(r["num_frames"] * r["height"] * r["width"] for r in todo)
    shared = sum(1 for r in rows if r["same_as"] is not None)
    captions = {r["text_key"] for r in rows if r["bucket"]}
    new_captions = sum(1 for r in rows if r.get("encode_text"))
    what = f"{clips} clips" if views == 1 else f"{clips} clips x {views} views"
    say(
        f"cache plan: {what}, {drawn} in {len(by_bucket)} buckets, "
        f"{sum(lost.values())} fit no bucket"
        + (f" ({', '.join(f'{k} {v}' for k, v in lost.items())})" if lost else "")
        + (f"; {shared} views share an earlier view's latent (same bucket and window)" if views > 1 else "")
    )
    for b, n in sorted(by_bucket.items()):
        say(f"  {b:18s} {n:8d} " + ("clips" if views == 1 else "latents"))
    say(
        f"  encodes: {len(todo)} new, {len(mine) - len(todo)} reused from the store; captions: "
        f"{len(captions)} distinct, {new_captions} new, {len(captions) - new_captions} reused"
    )
    say(f"  {frames:,} frames, {pixels / 1e9:.2f} Gpixels to encode")
    for line in cost_table(cdir, clips, views, costs):
        say(line)
    say(projection(cdir, costs[views - 1]["new"], costs[views - 1]["new_pixels"]))


def measured(cdir: Path) -> dict:
    """What finished units measured: encode seconds, encoded samples and their pixels and caption tokens."""
    m = {"units": 0, "seconds": 0.0, "encoded": 0, "pixels": 0, "tokens": 0, "texts": 0, "with_pixels": True}
    for p in sorted(cdir.glob("[0-9]*.parquet")):
        meta = pq.read_schema(p).metadata or {}
        if b"encode_seconds" not in meta:
            continue
        m["units"] += 1
        m["seconds"] += float(meta[b"encode_seconds"])
        m["encoded"] += int(meta[b"encoded_clips"])
        if b"encoded_pixels" in meta:  # written since views came: older units count samples only
            m["pixels"] += int(meta[b"encoded_pixels"])
            m["tokens"] += int(meta[b"text_tokens"])
            m["texts"] += int(meta.get(b"encoded_texts", meta[b"encoded_clips"]))  # format 1: one per sample
        else:
            m["with_pixels"] = False
    if m["texts"] and m["with_pixels"]:
        m["text_tokens"] = m["tokens"] / m["texts"]
    return m


def _gpu_hours(m: dict, encodes: int, pixels: int) -> float | None:
    if not m["encoded"] or not m["seconds"]:
        return None
    if m["with_pixels"] and m["pixels"]:  # the VAE's cost follows pixels, which views change
        return pixels * m["seconds"] / m["pixels"] / 3600
    return encodes * m["seconds"] / m["encoded"] / 3600


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def cost_table(cdir: Path, clips: int, views: int, costs: list[dict]) -> list[str]:
    """`cache plan`'s table of what K views cost (the planned K marked *): all encodes and the new ones,
    bytes in cache format 1 (each sample holds its caption) and in the store (each caption once), what
    this plan adds to the store, and GPU-hours for the new encodes."""
    m = measured(cdir)
    base = costs[0]
    tokens = "measured" if costs[0]["measured_tokens"] else "estimated from word counts"
    lines = [
        "  what views cost (bytes: latents from the encoder's geometry and caption embeddings; 'format 1': "
        f"each sample holds its caption, 'store': each caption once; tokens {tokens}):",
        f"    {'K':>3} {'encodes':>10} {'per clip':>8} {'new':>10} {'Gpixels':>9} {'x K=1':>6} "
        f"{'format 1':>10} {'store':>10} {'added':>10} {'GPU-hours':>10}",
    ]
    for c in costs:
        hours = _gpu_hours(m, c["new"], c["new_pixels"])
        lines.append(
            f"  {'*' if c['views'] == views else ' '} {c['views']:>3} {c['encodes']:>10,} "
            f"{c['encodes'] / max(1, clips):>8.2f} {c['new']:>10,} {c['new_pixels'] / 1e9:>9.2f} "
            f"{c['pixels'] / max(1, base['pixels']):>6.2f} {_size(c['bytes_before']):>10} {_size(c['bytes']):>10} "
            f"{_size(c['added']):>10} {'-' if hours is None else f'{hours:.3g}':>10}"
        )
    if not m["encoded"]:
        lines.append("    GPU-hours: run a unit to measure (they scale with the pixels to encode, column 'x K=1')")
    return lines


def projection(cdir: Path, encodes: int, pixels: int | None = None) -> str:
    """GPU-hours for the whole cache (`encodes` latents of `pixels` pixels, None: unknown) from the rate
    finished units measured, if any."""
    m = measured(cdir)
    if not m["encoded"]:
        return "  projection: run a unit to measure clips/s per GPU"
    rate = m["encoded"] / max(1e-9, m["seconds"])
    hours = _gpu_hours(m, encodes, pixels) if pixels is not None else encodes / rate / 3600
    return (
        f"  projection: {rate:.2f} latents/s per GPU measured over {m['units']} unit(s) -> "
        f"{hours:.3g} GPU-hours for {encodes} latents"
    )
