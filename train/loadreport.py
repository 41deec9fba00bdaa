"""``LoadReport``: what a load of weights did (train/weights.py), tensor by tensor, said in groups.

Which tensors were loaded, which start fresh (missing from the file), which the file had and the
model has not (ignored), which were skipped for a shape mismatch, and notes (a config field that
differs, how to compute what upstream did). ``summary()`` groups the keys by block and prefix, so
a PixArt-Sigma init of a 56-block model is a few lines, not thousands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

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
