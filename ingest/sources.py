"""Source tables -> one normalized input table, one row per input row.

Formats (``--source``):

- ``openvid``: OpenVid-1M / OpenVidHD CSV, header exactly DATASETS.md's; ``video`` is a file name
  inside ``--videos``; its frame/fps/seconds are kept as ``stated_*`` (the probe is authoritative).
- ``miradata``: ``miradata_v1_330k.csv``; ``file_path`` relative to ``--videos``; every caption
  is kept, and which one becomes ``text`` must be chosen with ``--caption``.
- ``csv`` / ``parquet``: at least ``path,text``; Open-Sora's ``num_frames,fps,height,width`` (and
  ``seconds``) are read as ``stated_*`` when present (MiraData's ``width,height`` too).
- ``folder``: every video under ``--videos``, caption from the ``.txt`` beside it (UTF-8; a caption
  file that is not is that row's ``bad_row`` reject, naming the file).

A table missing required columns is refused before any work starts, with the missing names and,
when the header matches another known format, which ``--source`` was probably meant. So is a CSV
that is not UTF-8 (its lines named; a UTF-8 byte-order mark, as Excel writes, is fine), a
``--meta`` that is not parquet where parquet is read, and a parquet whose path or caption column
is not text (an int path or a float caption is refused, never silently made text). Rows are
never dropped: a malformed row comes through with ``row_error`` set, a repeated path with
``duplicate_of``; the unit turns both into recorded rejects.
"""

from __future__ import annotations

import csv
import hashlib
import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from reelcache import UserError
from reelcache.catalog.db import clips_arrow_schema
from reelcache.progress import bar

OPENVID_COLUMNS = [
    "video",
    "caption",
    "aesthetic score",
    "motion score",
    "temporal consistency score",
    "camera motion",
    "frame",
    "fps",
    "seconds",
]
MIRADATA_COLUMNS = [
    "clip_id",
    "source",
    "video_url",
    "video_id",
    "width",
    "height",
    "fps",
    "seconds",
    "timestamp",
    "frame_number",
    "framestamp",
    "file_path",
    "short_caption",
    "dense_caption",
    "background_caption",
    "main_object_caption",
    "style_caption",
    "camera_caption",
]
MIRADATA_CAPTIONS = [
    "short_caption",
    "dense_caption",
    "background_caption",
    "main_object_caption",
    "style_caption",
    "camera_caption",
]
GENERIC_COLUMNS = ["path", "text"]
# Columns that become a clip's path or caption: in a parquet they must be text, never numbers made text.
TEXT_COLUMNS = {
    "openvid": ["video", "caption"],
    "miradata": ["file_path", *MIRADATA_CAPTIONS],
    "csv": GENERIC_COLUMNS,
    "parquet": GENERIC_COLUMNS,
}
VIDEO_EXTENSIONS = {".mp4", ".mov", ".m4v", ".mkv", ".webm", ".avi", ".ts", ".mpg", ".mpeg", ".flv", ".wmv"}
FORMATS = ("openvid", "miradata", "csv", "parquet", "folder")
REQUIRED = {
    "openvid": OPENVID_COLUMNS,
    "miradata": MIRADATA_COLUMNS,
    "csv": GENERIC_COLUMNS,
    "parquet": GENERIC_COLUMNS,
}

# Columns of the normalized input table besides those it shares with `clips`.
INTERNAL = {"row_error": "string", "duplicate_of": "int64"}
SHARED = [
    "row",
    "relpath",
    "path",
    "text",
    "clip_id",
    "stated_num_frames",
    "stated_fps",
    "stated_duration",
    "stated_width",
    "stated_height",
    "aesthetic_score",
    "motion_score",
    "temporal_consistency_score",
    "camera_motion",
    "mira_clip_id",
    "mira_source",
    "video_url",
    "video_id",
    "timestamp",
    "framestamp",
    *MIRADATA_CAPTIONS,
    "caption_column",
]


def clip_id(source: str, relpath: str, occurrence: int = 0) -> str:
    """Stable id from (source, relative path); later repeats of a path get their own id."""
    key = f"{source}\0{relpath}" + (f"\0{occurrence}" if occurrence else "")
    return hashlib.blake2b(key.encode(), digest_size=10).hexdigest()


def _num(v, kind=float):
    if v is None or v == "":
        return None
    try:
        x = float(v)
        return int(x) if kind is int and x == int(x) else (None if kind is int else x)
    except (TypeError, ValueError, OverflowError):
        return None


def _guess(header: list[str]) -> str:
    for name, cols in REQUIRED.items():
        if name != "parquet" and set(cols) <= set(header):
            return f" This header looks like --source {name}."
    return ""


def _check_header(kind: str, header: list[str], where: str) -> None:
    missing = [c for c in REQUIRED[kind] if c not in header]
    if missing:
        raise UserError(
            f"{where} is not a {kind} table: missing column(s) {', '.join(map(repr, missing))}; "
            f"found {', '.join(map(repr, header[:20]))}.{_guess(header)}"
        )


def _not_utf8(path: Path, e: UnicodeDecodeError) -> UserError:
    """Name the lines that are not UTF-8 (a second, streamed pass over the bytes: only on failure)."""
    bad, example = [], ""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as le:
                bad.append(n)
                example = example or repr(line[max(0, le.start - 12) : le.end + 12])
    lines = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    return UserError(
        f"--meta {path} is not UTF-8: line(s) {lines} hold bytes that are not (e.g. {example}); "
        f"captions would be corrupted. Re-save it as UTF-8, e.g. `iconv -f latin1 -t utf-8 {path.name} > utf8.csv`"
    )


def _read_csv(path: Path) -> tuple[list[str], list[tuple[list[str] | None, str | None]]]:
    """Header and rows of a CSV read as strict UTF-8 (a byte-order mark, as Excel writes, is dropped):
    a table in another encoding is refused naming its lines, never read with replaced characters."""
    csv.field_size_limit(sys.maxsize)
    try:
        return _read_csv_text(path)
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None


def _read_csv_text(path: Path):
    with open(path, newline="", encoding="utf-8-sig", errors="strict") as f:
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise UserError(f"{path} is empty: no header row") from None
        rows = []
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                break
            except csv.Error as e:
                rows.append((None, f"line {reader.line_num}: unparseable CSV ({e})"))
                continue
            if not fields:
                continue  # blank line: not a row
            if len(fields) != len(header):
                rows.append((fields, f"line {reader.line_num}: {len(fields)} fields, header has {len(header)}"))
            else:
                rows.append((fields, None))
    return header, rows


def _read_parquet(kind: str, meta: Path):
    """The table of a parquet source; its path and caption columns must hold text (never coerced)."""
    try:
        table = pq.read_table(meta)
    except (pa.ArrowException, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"--meta {meta} is not a readable parquet file: {first}") from None
    _check_header(kind, table.column_names, str(meta))
    for name in TEXT_COLUMNS[kind]:
        t = table.schema.field(name).type
        t = t.value_type if pa.types.is_dictionary(t) else t
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)):
            raise UserError(
                f"--meta {meta}: column {name!r} is {t}, it must be text (string): a path or caption is "
                f"never converted from numbers; cast it where the table is made (pandas: .astype(str))"
            )
    return table


def _object_records(videos: str):
    """The ``folder`` format over a prefix in S3: every video object under it (listed, paginated), its caption
    the ``.txt`` object beside it."""
    from reelcache.base import s3

    base = s3.parse(videos)
    keys = {o["Key"] for o in s3.list_objects(f"{base}/")}
    top = base.key.rstrip("/") + "/" if base.key else ""
    for key in sorted(keys):
        stem, dot, ext = key.rpartition(".")
        if not dot or f".{ext.lower()}" not in VIDEO_EXTENSIONS:
            continue
        txt, err, text = f"{stem}.txt", None, ""
        if txt in keys:
            try:
                text = s3.get(s3.Url(base.bucket, txt)).decode("utf-8-sig").strip()
            except UnicodeDecodeError as e:
                text, err = (
                    None,
                    f"caption file {txt.rsplit('/', 1)[-1]} is not UTF-8 (byte {e.object[e.start]:#04x} at {e.start})",
                )
        yield {"path": key[len(top) :], "text": text}, err


def _records(kind: str, meta: Path | None, videos):
    """Yield (fields dict | None, row_error) per input row. `videos`: a folder, or a prefix in S3 (a str)."""
    if kind == "folder" and isinstance(videos, str):
        yield from _object_records(videos)
        return
    if kind == "folder":
        if not videos.is_dir():
            raise UserError(f"--videos {videos} is not a directory")
        for p in sorted(videos.rglob("*")):
            if p.suffix.lower() in VIDEO_EXTENSIONS and p.is_file():
                txt, err = p.with_suffix(".txt"), None
                try:
                    text = txt.read_text(encoding="utf-8-sig").strip() if txt.exists() else ""
                except UnicodeDecodeError as e:  # a reject naming the file, never a caption with U+FFFD in it
                    text, err = (
                        None,
                        f"caption file {txt.name} is not UTF-8 (byte {e.object[e.start]:#04x} at {e.start})",
                    )
                yield {"path": str(p.relative_to(videos)), "text": text}, err
        return
    if meta is None or not meta.exists():
        raise UserError(f"--meta {meta} does not exist")
    if kind == "parquet" or meta.suffix == ".parquet":
        table = _read_parquet("parquet" if kind == "parquet" else kind, meta)
        for r in table.to_pylist():
            yield {k: (None if v is None else str(v)) for k, v in r.items()}, None
        return
    header, rows = _read_csv(meta)
    _check_header(kind, header, str(meta))
    for fields, err in rows:
        yield (dict(zip(header, fields)) if fields else None), err


def read_source(kind: str, source: str, meta: str | None, videos: str, caption: str | None = None):
    """Read any supported table into the normalized input table (pyarrow), one row per input row."""
    if kind not in FORMATS:
        raise UserError(f"unknown --source format {kind!r}; choose one of {', '.join(FORMATS)}")
    if kind == "miradata":
        if caption is None:
            raise UserError(
                "MiraData has six captions; choose which one trains with --caption "
                f"({', '.join(c.removesuffix('_caption') for c in MIRADATA_CAPTIONS)}). "
                "All of them are kept in the catalog either way."
            )
        caption = caption if caption.endswith("_caption") else f"{caption}_caption"
        if caption not in MIRADATA_CAPTIONS:
            raise UserError(f"--caption {caption!r} is not a MiraData caption column")
    # --videos: a folder, or a prefix in S3 (``s3://bucket/prefix``: the paths are objects, docs/STORAGE.md)
    remote = videos.rstrip("/") if videos.startswith("s3://") else None
    videos_dir = remote or Path(videos).resolve()

    seen: dict[str, tuple[int, int]] = {}
    out = []
    records = _records(kind, Path(meta) if meta else None, videos_dir)
    for i, (rec, err) in enumerate(bar(records, desc="reading rows", unit="row")):
        rec = rec or {}
        r = _normalize(kind, rec, caption)
        r["row"] = i
        r["row_error"] = err
        rel = _relpath(r.get("relpath"))
        r["relpath"] = rel
        r["path"] = _path(videos_dir, rel)
        if rel and not err:
            first, n = seen.get(rel, (i, 0))
            seen[rel] = (first, n + 1)
            r["duplicate_of"] = first if n else None
            r["clip_id"] = clip_id(source, rel, n)
        else:
            r["duplicate_of"] = None
            r["clip_id"] = clip_id(source, f"#row{i}")
        out.append(r)
    schema = input_schema()
    return pa.Table.from_pylist(out, schema=schema)


def _relpath(rel: str | None) -> str | None:
    """A table's path, normalised: a relative or absolute path, or an object's URL (``s3://bucket/key``)."""
    if not rel:
        return None
    if rel.startswith("s3://"):
        bucket, _, key = rel[5:].partition("/")
        return f"s3://{bucket}/{os.path.normpath(key)}"
    return os.path.normpath(rel)


def _path(videos, rel: str | None) -> str | None:
    """Where a table's path points: an s3:// URL as it is, else under `videos` (a folder or an s3:// prefix)."""
    if not rel:
        return None
    if rel.startswith("s3://"):
        return rel
    if isinstance(videos, str):
        return f"{videos}/{rel.lstrip('/')}"
    return str(videos / rel)


def input_schema():
    clips = clips_arrow_schema()
    fields = [clips.field(n) for n in SHARED]
    fields += [pa.field(n, t) for n, t in INTERNAL.items()]
    return pa.schema(fields)


def _normalize(kind: str, rec: dict, caption: str | None) -> dict:
    g = rec.get
    if kind == "openvid":
        return {
            "relpath": g("video"),
            "text": g("caption"),
            "aesthetic_score": _num(g("aesthetic score")),
            "motion_score": _num(g("motion score")),
            "temporal_consistency_score": _num(g("temporal consistency score")),
            "camera_motion": g("camera motion"),
            "stated_num_frames": _num(g("frame"), int),
            "stated_fps": _num(g("fps")),
            "stated_duration": _num(g("seconds")),
        }
    if kind == "miradata":
        r = {
            "relpath": g("file_path"),
            "text": g(caption),
            "caption_column": caption,
            "mira_clip_id": g("clip_id"),
            "mira_source": g("source"),
            "video_url": g("video_url"),
            "video_id": g("video_id"),
            "timestamp": g("timestamp"),
            "framestamp": g("framestamp"),
            "stated_num_frames": _num(g("frame_number"), int),
            "stated_fps": _num(g("fps")),
            "stated_duration": _num(g("seconds")),
            "stated_width": _num(g("width"), int),
            "stated_height": _num(g("height"), int),
        }
        r.update({c: g(c) for c in MIRADATA_CAPTIONS})
        return r
    return {
        "relpath": g("path"),
        "text": g("text"),
        "stated_num_frames": _num(g("num_frames"), int),
        "stated_fps": _num(g("fps")),
        "stated_duration": _num(g("seconds")),
        "stated_width": _num(g("width"), int),
        "stated_height": _num(g("height"), int),
    }
