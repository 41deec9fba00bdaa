"""Weights in and out of STDiT3: every layout a run may start from, and the shards we write.

``load_weights(model, path)`` recognises, by what is on disk:

  file ``*.safetensors`` / ``pytorch_model.bin``   a plain state dict                   strict
  folder with ``model.safetensors[.index.json]``   a published STDiT3 (hpcai-tech/OpenSora-STDiT-v3:
                                                   config.json + model.safetensors), or any shard set
  ``ckpt-<step>/`` (``model/`` + ``ema/``)          a reelcache checkpoint: model/, or with which="ema"
                                                   ema/ (a complete state dict; one written before it
                                                   was holds the trainable tensors only, and the frozen
                                                   ones and buffers come from model/)
  ``epochN-global_stepM/`` (``model/`` + ``running_states.json`` or pytorch_model shards)
                                                   an Open-Sora checkpoint: model/ = the NON-EMA
                                                   weights, strict=False like upstream (``ema.pt``
                                                   with which="ema")
  file ``*.pth`` / ``*.pt``                         PixArt-Σ: Open-Sora's ``reparameter`` (2D patch
                                                   kernel unsqueezed, pos_embed dropped, null caption
                                                   padded/truncated, ``blocks.`` -> ``spatial_blocks.``),
                                                   strict=False

and returns a ``LoadReport`` (train/load_report.py): which tensors were loaded, which start fresh (missing), which were
ignored (unexpected) or skipped for a shape mismatch, with a grouped ``summary()``. Where upstream
loads with strict=False silently, we load the same keys but always say what stayed fresh; a
strict load checks everything before touching the model, so a refused load leaves it unchanged.

A folder that says which model config trained it (a published folder's config.json, Open-Sora's
``model/config.json``, our ``config.json``) is compared with the model first: a field that changes
no tensor but what the weights compute (``input_sq_size``, ``num_heads``...) would load strictly and
silently give other outputs, so a difference is an error naming the field (``check_config``).

``save_sharded`` writes safetensors shards + ``model.safetensors.index.json`` in transformers'
naming (so the folders open with transformers/diffusers tools too); ``read_sharded`` reads any
of the folder layouts above back into one dict.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from reelcache.train.load_report import LoadReport

__all__ = ["INDEX", "LoadReport", "check_config", "load_weights", "read_sharded", "save_sharded"]

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


# STDiT3Config fields that change the tensors' shapes or names: a difference shows in the load itself
# (refused when strict, reported as fresh or shape-mismatched when not); named here as a note.
SHAPE_FIELDS = (
    "in_channels",
    "hidden_size",
    "depth",
    "mlp_ratio",
    "caption_channels",
    "model_max_length",
    "qk_norm",
    "pred_sigma",
    "patch_size",
)
# Fields that change what the weights compute and no tensor: a difference would load strictly and
# silently compute something else, so it is an error unless the run's model.overrides names the field.
SILENT_FIELDS = ("input_sq_size", "num_heads", "skip_y_embedder", "pos_embed_bf16_freqs")


def _norm(v):
    return tuple(v) if isinstance(v, list) else v


def check_config(theirs: dict, model, source: str, chosen=()) -> list[str]:
    """Compare the model config that trained the weights (``theirs``: STDiT3Config fields, as a
    checkpoint's config.json has them) with ``model.config``. Returns notes for the shape fields; raises
    ValueError naming each silent field that differs, unless it is in ``chosen`` (set on purpose)."""
    mine = getattr(model, "config", None)
    if mine is None or not hasattr(mine, "input_sq_size"):
        return []
    notes, silent = [], []
    for name in (*SHAPE_FIELDS, *SILENT_FIELDS):
        if name not in theirs or _norm(theirs[name]) == getattr(mine, name):
            continue
        if name in SILENT_FIELDS and name not in chosen:
            silent.append(name)
        else:
            notes.append(f"{source}: {name} = {theirs[name]!r}, the model's is {getattr(mine, name)!r}")
    if silent:
        fields = ", ".join(f"{n} = {theirs[n]!r} (this model: {getattr(mine, n)!r})" for n in silent)
        sets = ", ".join(
            f"{n} = {str(theirs[n]).lower() if isinstance(theirs[n], bool) else theirs[n]!r}" for n in silent
        )
        raise ValueError(
            f"{source} was trained with {fields}: these change what the weights compute without changing a "
            f"tensor, so the load would succeed and silently give other outputs. Train the model they were "
            f"trained as with model.overrides {{{sets}}}, or name the field in model.overrides to change it on purpose"
        )
    return notes


def _folder_config(path: Path) -> tuple[dict, str] | None:
    """The STDiT3 config that trained a checkpoint folder, and where it was read: a published or Open-Sora
    folder's (model/)config.json (transformers' STDiT3Config), or our ckpt's config.json ([model])."""
    for f in (path / "config.json", path / "model" / "config.json"):
        if not f.exists():
            continue
        doc = json.loads(f.read_text())
        if isinstance(doc.get("model"), dict) and "preset" in doc["model"]:  # ours: the run's resolved config
            from reelcache.train.model import STDiT3Config

            m = doc["model"]
            try:
                cfg = STDiT3Config.preset(m["preset"], **m.get("overrides", {}))
            except (TypeError, ValueError):
                return None
            return dataclasses.asdict(cfg), str(f)
        return doc, str(f)
    return None


def _upstream_note(model) -> list[str]:
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "pos_embed_bf16_freqs", True) is False:
        return [
            "Open-Sora trained these weights with bf16-rounded position frequencies: "
            "model.overrides.pos_embed_bf16_freqs = true computes what it computed"
        ]
    return []


def load_weights(
    model: torch.nn.Module, path, *, strict: bool | None = None, which: str = "model", chosen=()
) -> LoadReport:
    """Load a checkpoint of any layout in the module docstring into ``model``; ``strict=None`` takes
    the layout's default (strict for safetensors and our checkpoints, not for Open-Sora folders and
    PixArt ``.pth``). ``which`` = "model" or "ema" for checkpoint folders (a file or a plain
    safetensors folder has no EMA: "ema" is an error there). A folder's model config (config.json,
    Open-Sora's model/config.json, our config.json's [model]) is compared with ``model.config`` first:
    see ``check_config``; ``chosen``: the STDiT3Config fields the run sets on purpose (its model.overrides)."""
    if which not in ("model", "ema"):
        raise ValueError(f'which must be "model" or "ema", got {which!r}')
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    src = str(path)
    no_ema = f"{path} holds one set of weights, no EMA: which = 'ema' is for checkpoint folders (ema/, ema.pt)"

    if path.is_file():
        if which == "ema":
            raise ValueError(no_ema)
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

    found = _folder_config(path)
    notes = check_config(found[0], model, found[1], chosen) if found else []

    if (path / INDEX).exists() or (path / "model.safetensors").exists():
        if which == "ema":
            raise ValueError(no_ema)
        report = LoadReport(src, "safetensors folder", notes=notes)
        if found and found[0].get("model_type") == "STDiT3":  # transformers' config.json: a published STDiT3
            report.notes += _upstream_note(model)
        return _apply(model, read_sharded(path), report, True if strict is None else strict)

    sub = path / "model"
    if sub.is_dir():
        open_sora = (path / "running_states.json").exists() or any(sub.glob("pytorch_model*"))
        if open_sora:
            if which == "ema":
                if not (path / "ema.pt").exists():
                    raise FileNotFoundError(
                        f"{path} has no ema.pt (copied without it?); model/ holds the non-EMA weights"
                    )
                report = LoadReport(src, "Open-Sora checkpoint, ema.pt (its EMA)", notes=notes)
                state = _strip_module_prefix(_torch_load(path / "ema.pt"))
            else:
                report = LoadReport(src, "Open-Sora checkpoint, model/ (non-EMA; its EMA is ema.pt)", notes=notes)
                state = _strip_module_prefix(read_sharded(sub))
            report.notes += _upstream_note(model)
            return _apply(model, state, report, False if strict is None else strict)
        base = read_sharded(sub)
        strict = True if strict is None else strict
        if which == "ema":
            if not (path / "ema").is_dir():
                raise FileNotFoundError(f"{path} has no ema/ (trained with ema.decay = 0?)")
            report = LoadReport(src, "reelcache checkpoint, ema/", notes=notes)
            ema = read_sharded(path / "ema")
            if rest := set(base) - set(ema):  # written before ema/ was complete: trainable tensors only
                report.kind = "reelcache checkpoint, ema/ over model/"
                report.notes.append(
                    f"{len(ema)} tensors from ema/, the other {len(rest)} (frozen parameters, buffers) from model/"
                )
            return _apply(model, {**base, **ema}, report, strict)  # model/ under the EMA overlay
        return _apply(model, base, LoadReport(src, "reelcache checkpoint, model/", notes=notes), strict)

    raise FileNotFoundError(
        f"{path}: not a weight file or a known checkpoint folder (expected *.safetensors, "
        f"*.pth, a folder with {INDEX} or model.safetensors, or a checkpoint with model/)"
    )
