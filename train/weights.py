"""Weights in and out of STDiT3: every layout a run may start from, and the shards we write.

``load_weights(model, path)`` recognises, by what is on disk:

  file ``*.safetensors`` / ``pytorch_model.bin``   a plain state dict                   strict
  folder with ``model.safetensors[.index.json]``   a published STDiT3 (hpcai-tech/OpenSora-STDiT-v3:
                                                   config.json + model.safetensors), or any shard set
  ``ckpt-<step>/`` (``model/`` + ``ema/``)          a reelcache checkpoint: model/, or with which="ema"
                                                   model/ overlaid by ema/ (the EMA holds trainable
                                                   tensors only; frozen ones and buffers come from model/)
  ``epochN-global_stepM/`` (``model/`` + ``running_states.json`` or pytorch_model shards)
                                                   an Open-Sora checkpoint: model/ = the NON-EMA
                                                   weights, strict=False like upstream (``ema.pt``
                                                   with which="ema")
  file ``*.pth`` / ``*.pt``                         PixArt-Σ: Open-Sora's ``reparameter`` (2D patch
                                                   kernel unsqueezed, pos_embed dropped, null caption
                                                   padded/truncated, ``blocks.`` -> ``spatial_blocks.``),
                                                   strict=False

and returns a ``LoadReport``: which tensors were loaded, which start fresh (missing), which were
ignored (unexpected) or skipped for a shape mismatch, with a grouped ``summary()``. Where upstream
loads with strict=False silently, we load the same keys but always say what stayed fresh; a
strict load checks everything before touching the model, so a refused load leaves it unchanged.

``save_sharded`` writes safetensors shards + ``model.safetensors.index.json`` in transformers'
naming (so the folders open with transformers/diffusers tools too); ``read_sharded`` reads any
of the folder layouts above back into one dict.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["LoadReport", "load_weights", "read_sharded", "save_sharded"]

INDEX = "model.safetensors.index.json"


# ---------------------------------------------------------------------------------------------
# shards


def save_sharded(state_dict: dict[str, torch.Tensor], folder, max_shard_bytes: float = 2e9) -> list[Path]:
    """Write ``model-0000N-of-0000M.safetensors`` + ``model.safetensors.index.json`` into ``folder``
    (created). Tensors go to shards greedily in state-dict order; one larger than the limit gets a
    shard of its own. Not atomic by itself: the caller writes into a temporary parent and renames it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in state_dict.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        # safetensors refuses views of shared storage: each tensor gets its own contiguous copy if needed
        shards[-1][key] = t.detach().to("cpu").contiguous()
        size += nbytes
    n = len(shards)
    weight_map, paths = {}, []
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        paths.append(folder / name)
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return paths


def _torch_load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # old pickles with non-tensor objects (args, optimizers)
        warnings.warn(
            f"{path.name}: not loadable with weights_only=True ({type(e).__name__}); loading it "
            f"as a full pickle, which runs code from the file: use only checkpoints you trust",
            stacklevel=3,
        )
        return torch.load(path, map_location="cpu", weights_only=False)


def read_sharded(folder) -> dict[str, torch.Tensor]:
    """One state dict from a folder of safetensors (index + shards, or model.safetensors) or of
    PyTorch shards (``pytorch_model.bin.index.json`` + ``pytorch_model-0000N.bin``, or one .bin)."""
    folder = Path(folder)
    if (folder / INDEX).exists():
        files = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
        return {k: v for f in files for k, v in load_file(folder / f).items()}
    if (folder / "model.safetensors").exists():
        return load_file(folder / "model.safetensors")
    if (folder / "pytorch_model.bin.index.json").exists():
        files = sorted(set(json.loads((folder / "pytorch_model.bin.index.json").read_text())["weight_map"].values()))
        return {k: v for f in files for k, v in _torch_load(folder / f).items()}
    if (folder / "pytorch_model.bin").exists():
        return _torch_load(folder / "pytorch_model.bin")
    singles = sorted(folder.glob("*.safetensors"))
    if len(singles) == 1:
        return load_file(singles[0])
    raise FileNotFoundError(
        f"{folder}: no model.safetensors[.index.json] or pytorch_model.bin[.index.json] "
        f"(found: {sorted(p.name for p in folder.iterdir())[:10]})"
    )


# ---------------------------------------------------------------------------------------------
# report


_BLOCK = re.compile(r"^(\w*blocks)\.(\d+)\.(.*)$")


def _group(keys: list[str], universe: set[str]) -> list[str]:
    """Readable groups: a top-level module whose every key is in ``keys`` -> "m.*" (with the block
    count for block lists); otherwise per-block patterns "spatial_blocks.*.attn.q_norm.weight (28 blocks)"."""
    keys_set = set(keys)
    out: list[str] = []
    tops: dict[str, list[str]] = {}
    for k in keys:
        tops.setdefault(k.split(".")[0], []).append(k)
    for top, ks in tops.items():
        everything = {u for u in universe if u.split(".")[0] == top}
        blocks = {int(m.group(2)) for k in ks if (m := _BLOCK.match(k))}
        if everything <= keys_set:
            label = f"{top}.*" if len(everything) > 1 else next(iter(everything))
            out.append(label + (f" ({len(blocks)} blocks)" if blocks else ""))
            continue
        patterns: dict[str, set[int]] = {}
        for k in ks:
            m = _BLOCK.match(k)
            if m:
                patterns.setdefault(m.group(3), set()).add(int(m.group(2)))
            else:
                patterns.setdefault(k, set())
        if blocks and all(ix == blocks for ix in patterns.values()):
            every = {m.group(3) for u in everything if (m := _BLOCK.match(u))}
            all_blocks = {int(m.group(2)) for u in everything if (m := _BLOCK.match(u))}
            rest = sorted(every - set(patterns))
            if not rest:  # whole blocks, not all of them
                out.append(
                    ", ".join(f"{top}.{i}.*" for i in sorted(blocks))
                    if len(blocks) <= 4
                    else f"{top}.* ({len(blocks)} of {len(all_blocks)} blocks)"
                )
                continue
            if blocks == all_blocks and len(rest) < len(patterns):  # name the few sub-keys NOT here
                out.append(f"{top}.* ({len(blocks)} blocks) except " + ", ".join(rest))
                continue
        out.extend(f"{top}.*.{p} ({len(ix)} blocks)" if ix else p for p, ix in patterns.items())
    return out


@dataclass
class LoadReport:
    """What a load did. ``missing`` keys keep the model's fresh values; ``unexpected`` ones were ignored."""

    source: str
    kind: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple, tuple]] = field(default_factory=list)  # (key, file shape, model shape)
    notes: list[str] = field(default_factory=list)
    universe: set[str] = field(default_factory=set, repr=False)

    @property
    def complete(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def summary(self) -> str:
        lines = [
            f"{self.source} ({self.kind}): {len(self.loaded)} tensors loaded, {len(self.missing)} fresh, "
            f"{len(self.unexpected)} ignored, {len(self.mismatched)} shape-mismatched"
        ]
        for label, keys in (
            ("loaded", self.loaded),
            ("fresh (kept from init)", self.missing),
            ("ignored (not in the model)", self.unexpected),
        ):
            if keys:
                lines.append(f"  {label}: " + "; ".join(_group(keys, self.universe)))
        for key, got, want in self.mismatched:
            lines.append(f"  shape mismatch, kept fresh: {key} file {list(got)} vs model {list(want)}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# loading


def _apply(model: torch.nn.Module, state: dict[str, torch.Tensor], report: LoadReport, strict: bool) -> LoadReport:
    """Check ``state`` against the model, then copy what fits."""
    own = model.state_dict()
    report.universe = set(own) | set(state)
    for key, t in state.items():
        if key not in own:
            report.unexpected.append(key)
        elif tuple(t.shape) != tuple(own[key].shape):
            report.mismatched.append((key, tuple(t.shape), tuple(own[key].shape)))
        else:
            report.loaded.append(key)
    loaded = set(report.loaded)
    report.missing = [k for k in own if k not in loaded]
    if strict and not report.complete:
        raise ValueError(f"strict load refused, the model was not changed:\n{report.summary()}")
    if report.mismatched:
        warnings.warn(
            f"{report.source}: {len(report.mismatched)} tensors have other shapes and stay fresh", stacklevel=3
        )
    with torch.no_grad():
        model.load_state_dict({k: state[k] for k in report.loaded}, strict=False)
    return report


def _strip_module_prefix(state: dict) -> dict:
    if state and all(k.startswith("module.") for k in state):
        return {k[len("module.") :]: v for k, v in state.items()}
    return state


def reparameter_pixart(state: dict, model, notes: list[str]) -> dict:
    """Open-Sora's ``reparameter`` for a PixArt checkpoint, each change recorded in ``notes``."""
    if isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
        notes.append('took ckpt["state_dict"]')
    state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    w = state.get("x_embedder.proj.weight")
    if w is not None and w.dim() == 4:
        state["x_embedder.proj.weight"] = w.unsqueeze(2)
        notes.append(f"x_embedder.proj.weight {list(w.shape)} -> {list(w.unsqueeze(2).shape)} (2D patch kernel as 3D)")
    for k in ("pos_embed", "pos_embed_temporal"):
        if state.pop(k, None) is not None:
            notes.append(f"dropped {k} (STDiT3's positions are computed, not stored)")
    ye = state.get("y_embedder.y_embedding")
    want = model.config.model_max_length
    if ye is not None and ye.shape[0] != want:
        if ye.shape[0] < want:
            ye2 = torch.cat([ye, ye[-1:].expand(want - ye.shape[0], -1)], dim=0)
            notes.append(f"y_embedder.y_embedding padded {ye.shape[0]} -> {want} rows (copies of the last)")
        else:
            ye2 = ye[:want]
            notes.append(f"y_embedder.y_embedding truncated {ye.shape[0]} -> {want} rows")
        state["y_embedder.y_embedding"] = ye2
    renamed = {}
    for k, v in state.items():
        renamed["spatial_" + k if k.startswith("blocks.") else k] = v
    n = sum(k.startswith("blocks.") for k in state)
    if n:
        notes.append(f"renamed {n} blocks.* tensors to spatial_blocks.*")
    return renamed


def _config_notes(folder: Path, model) -> list[str]:
    cfg_path = folder / "config.json"
    if not cfg_path.exists() or not hasattr(model, "config"):
        return []
    theirs = json.loads(cfg_path.read_text())
    notes = []
    for name in (
        "in_channels",
        "hidden_size",
        "depth",
        "num_heads",
        "mlp_ratio",
        "caption_channels",
        "model_max_length",
        "qk_norm",
        "pred_sigma",
        "patch_size",
    ):
        if name in theirs:
            mine, other = getattr(model.config, name), theirs[name]
            if (tuple(other) if isinstance(other, list) else other) != mine:
                notes.append(f"config.json {name}={other} differs from the model's {mine}")
    return notes


def load_weights(model: torch.nn.Module, path, *, strict: bool | None = None, which: str = "model") -> LoadReport:
    """Load a checkpoint of any layout in the module docstring into ``model``; ``strict=None`` takes
    the layout's default (strict for safetensors and our checkpoints, not for Open-Sora folders and
    PixArt ``.pth``). ``which`` = "model" or "ema" for checkpoint folders."""
    if which not in ("model", "ema"):
        raise ValueError(f'which must be "model" or "ema", got {which!r}')
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    src = str(path)

    if path.is_file():
        if path.suffix == ".safetensors":
            report = LoadReport(src, "safetensors")
            return _apply(model, load_file(path), report, True if strict is None else strict)
        if path.suffix == ".bin":
            report = LoadReport(src, "pytorch state dict")
            return _apply(model, _strip_module_prefix(_torch_load(path)), report, True if strict is None else strict)
        if path.suffix in (".pth", ".pt"):
            report = LoadReport(src, "PixArt/Open-Sora .pth, reparameterised")
            state = reparameter_pixart(_torch_load(path), model, report.notes)
            return _apply(model, _strip_module_prefix(state), report, False if strict is None else strict)
        raise ValueError(f"{path}: unknown weight file type {path.suffix!r} (.safetensors, .bin, .pth, .pt)")

    if (path / INDEX).exists() or (path / "model.safetensors").exists():
        report = LoadReport(src, "safetensors folder")
        report.notes += _config_notes(path, model)
        return _apply(model, read_sharded(path), report, True if strict is None else strict)

    sub = path / "model"
    if sub.is_dir():
        open_sora = (path / "running_states.json").exists() or any(sub.glob("pytorch_model*"))
        if open_sora:
            if which == "ema":
                report = LoadReport(src, "Open-Sora checkpoint, ema.pt")
                state = _strip_module_prefix(_torch_load(path / "ema.pt"))
            else:
                report = LoadReport(src, "Open-Sora checkpoint, model/ (non-EMA)")
                state = _strip_module_prefix(read_sharded(sub))
            return _apply(model, state, report, False if strict is None else strict)
        base = read_sharded(sub)
        strict = True if strict is None else strict
        if which == "ema":
            if not (path / "ema").is_dir():
                raise FileNotFoundError(f"{path} has no ema/ (trained with ema_decay = 0?)")
            report = LoadReport(src, "reelcache checkpoint, ema/ over model/")
            ema = read_sharded(path / "ema")
            report.notes.append(
                f"{len(ema)} tensors from ema/, the other {len(set(base) - set(ema))} "
                f"(frozen parameters, buffers) from model/"
            )
            return _apply(model, {**base, **ema}, report, strict)  # model/ under the EMA overlay
        return _apply(model, base, LoadReport(src, "reelcache checkpoint, model/"), strict)

    raise FileNotFoundError(
        f"{path}: not a weight file or a known checkpoint folder (expected *.safetensors, "
        f"*.pth, a folder with {INDEX} or model.safetensors, or a checkpoint with model/)"
    )
