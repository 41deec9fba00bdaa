"""The viewer's routes: pages (Jinja2 templates in view/templates/) and media (files, ranges, previews)."""

from __future__ import annotations

import collections
import functools
import html
import json
import math
import shlex
import threading
import time
from pathlib import Path
from urllib.parse import quote, urlencode

import anyio
import pyarrow as pa
import pyarrow.parquet as pq
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.templating import Jinja2Templates

from reelcache.catalog.levels import NOUN_TAGS
from reelcache.view import preview, runs
from reelcache.view.files import (
    Gone,
    NotFound,
    Refused,
    confined,
    file_response,
    playable,
    served_as,
    slice_response,
    within,
)
from reelcache.view.store import PAGE, REJECTS_PAGE, SLOT_WAIT_S, SORTS, BadQuery, Budget, Busy

templates = Jinja2Templates(directory=str(Path(__file__).with_name("templates")))
DEFAULT_WHERE = "status = 'ok'"
MAX_POINTS, MAX_ROWS = 1500, 300  # a run's loss curve and table
MAX_PAGE = 10**9  # a page number past this is a bad URL, not an OFFSET DuckDB cannot hold
KNOWN = 4096  # clips whose raw member /media/raw still serves while a merge holds the catalog


def _store(request: Request):
    return request.app.state.store


def _root(request: Request) -> Path:
    """The local folder of the catalog and the viewer's files: the root, or for a root in S3 its mirror."""
    return request.app.state.root


def _data(request: Request) -> str:
    """Where the shards are read: the root, or its ``s3://`` URL."""
    return request.app.state.data


def _page(request: Request) -> int:
    given = request.query_params.get("page", "0")
    try:
        page = int(given)
    except ValueError:
        page = -1
    if not 0 <= page <= MAX_PAGE:
        raise ValueError(f"page = {given[:40]!r}: expected a number from 0 to {MAX_PAGE}")
    return page


def _render(request: Request, template: str, status: int = 200, **ctx) -> Response:
    return templates.TemplateResponse(request, template, ctx, status_code=status)


_known: collections.OrderedDict = collections.OrderedDict()  # clip_id -> its raw member (shard, offset, ...)
_known_lock = threading.Lock()
RAW_KEYS = ("clip_id", "shard", "shard_offset", "file_size", "ext")


def _clip(request: Request, clip_id: str | None = None) -> dict:
    clip_id = clip_id or request.query_params.get("id", "")
    clip = _store(request).clip(clip_id)
    if clip is None:
        raise NotFound(f"no clip {clip_id!r} in the catalog")
    if clip.get("shard"):
        with _known_lock:
            _known[clip_id] = {k: clip.get(k) for k in RAW_KEYS}
            _known.move_to_end(clip_id)
            while len(_known) > KNOWN:
                _known.popitem(last=False)
    return clip


async def _user_queries(request: Request, fn):
    """``fn(budget)`` in a worker thread with a slot of the user's queries (waited for SLOT_WAIT_S on the
    event loop, then a Busy), its queries interrupted if the client leaves before they end."""
    store = _store(request)
    deadline = time.monotonic() + SLOT_WAIT_S
    while not store.take_slot():
        if time.monotonic() >= deadline or await request.is_disconnected():
            raise store.busy_slots()
        await anyio.sleep(0.05)
    try:
        budget = Budget(store.request_s)
        result, error = None, None
        async with anyio.create_task_group() as tg:

            async def watch():
                while not await request.is_disconnected():
                    await anyio.sleep(0.2)
                budget.interrupt("the client left")

            tg.start_soon(watch)
            try:
                result = await anyio.to_thread.run_sync(fn, budget)
            except Exception as e:  # noqa: BLE001 - raised below, outside the task group (not an ExceptionGroup)
                error = e
            tg.cancel_scope.cancel()
        if error is not None:
            raise error
        return result
    finally:
        store.release_slot()


# -- pages ---------------------------------------------------------------------------------
def overview(request: Request) -> Response:
    root = _root(request)
    plots = sorted(str(p.relative_to(root)) for p in [*root.glob("stats/*.png"), *root.glob("runs/*.png")])
    return _render(
        request, "overview.html", o=_store(request).overview(), plots=plots, runs=runs.list_runs(root), root=root
    )


def rejects(request: Request) -> Response:
    reason = request.query_params.get("reason") or None
    page = _page(request)
    rows, total = _store(request).rejects(reason, page)
    return _render(
        request,
        "rejects.html",
        reasons=_store(request).reject_reasons(),
        reason=reason,
        rows=rows,
        total=total,
        page=page,
        pages=max(1, math.ceil(total / REJECTS_PAGE)),
    )


def reject(request: Request) -> Response:
    clip = _clip(request)
    why = None
    try:
        _input_path(request, clip)
    except Refused as e:
        why = str(e)
    ext = (clip["path"] or "").rsplit(".", 1)[-1].lower() if clip["path"] else None
    return _render(request, "reject.html", c=clip, refused=why, unplayable=why or playable(clip["codec"], ext))


async def clips(request: Request) -> Response:
    """The grid of a WHERE clause (within a manifest's members with ``manifest=``), sorted, with its facets:
    each count a link to the selection narrowed to it, and the `catalog manifest` command that freezes it."""
    q = request.query_params
    where = q.get("where", DEFAULT_WHERE).strip() or "true"
    page, sort, desc = _page(request), q.get("sort", "clip_id"), q.get("desc", "") == "1"
    if sort not in SORTS:
        raise ValueError(f"sort = {sort[:40]!r}: expected one of {', '.join(SORTS)}")
    store, m = _store(request), None

    def select(budget) -> dict:  # in a worker thread: the manifest's lookup and read block, as the queries do
        nonlocal m
        if q.get("manifest"):
            m = _manifest(request, q["manifest"], q.get("fp"))
        members = _members(confined(_root(request), m["path"]), m["fingerprint"]) if m else None
        return store.clips(budget, where, page, sort, desc, members)

    try:
        res, error = await _user_queries(request, select), None
    except BadQuery as e:
        res, error = {"grid": [], "counts": {}, "total": 0}, str(e)

    def url(**change) -> str:
        now = {"where": where, "sort": "" if sort == "clip_id" else sort, "desc": "1" if desc else "", "page": "",
               "manifest": m["name"] if m else "", "fp": m["fingerprint"] if m else ""}  # fmt: skip
        now.update({k: str(v) for k, v in change.items()})
        return "/clips?" + urlencode({k: v for k, v in now.items() if v not in ("", None)})

    counts = res["counts"]
    for what in ("level", "source", "status"):
        for r in counts.get(what, []):
            r["href"] = url(where=_narrow(where, _equals(what, r["key"])))
    if "bucket" in counts:
        counts["bucket"] = [
            {"key": f"{r['cache']} {r['bucket']}", "n": r["n"], "views": r["views"],
             "href": url(where=_narrow(where, "clip_id IN (SELECT clip_id FROM latents WHERE status = 'ok' AND "
                                              f"cache = {_literal(r['cache'])} AND bucket = {_literal(r['bucket'])})"))}
            for r in counts["bucket"]
        ]  # fmt: skip
    ok = next((r["n"] for r in counts.get("status", []) if r["key"] == "ok"), 0)
    views: dict = {}
    for r in counts.get("bucket", []):
        cache = r["key"].split(" ", 1)[0]
        views[cache] = views.get(cache, 0) + r["views"]
    command = None
    if not m:  # a manifest of a manifest's members is not one `catalog manifest` makes
        base = ["reelcache", "catalog", "manifest", "--root", str(_root(request)), "--name", "NAME", "--where", where]
        command = {
            "clips": (shlex.join(base), ok),
            "caches": [(shlex.join([*base, "--cache", c]), n) for c, n in views.items()],
        }
    return _render(
        request,
        "clips.html",
        status=400 if error else 200,
        where=where,
        error=error,
        page=page,
        pages=max(1, math.ceil(res["total"] / PAGE)),
        url=url,
        sort=sort,
        desc=desc,
        sorts=list(SORTS),
        manifest=m,
        command=command,
        **res,
    )


def _literal(v) -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return repr(v)
    return "'" + str(v).replace("'", "''") + "'"


def _equals(column: str, value) -> str:
    return f"{column} IS NULL" if value is None else f"{column} = {_literal(value)}"


def _narrow(where: str, cond: str) -> str:
    """``where`` AND ``cond``, as text a user reads and edits (a `--` comment in ``where`` ends at its line)."""
    if where.strip().lower() == "true":
        return cond
    return f"(\n{where}\n) AND {cond}" if "--" in where else f"({where}) AND {cond}"


@functools.lru_cache(maxsize=4)
def _members(path: Path, fingerprint: str):
    """A manifest's clip ids, once each, as an Arrow table (its content never changes: its fingerprint)."""
    import pyarrow.compute as pc

    ids = pc.unique(pq.read_table(path, columns=["clip_id"])["clip_id"])
    return pa.table({"clip_id": ids})


def _manifest(request: Request, name: str, fp: str | None) -> dict:
    m = _store(request).manifest(name, fp)
    if m is None:
        raise NotFound(f"no manifest {name!r} in the catalog")
    return m


def clip(request: Request) -> Response:
    c = _clip(request)
    views = _store(request).clip_latents(c["clip_id"])
    for v in views:
        v["span"] = _span(request, v)
    return _render(
        request,
        "clip.html",
        c=c,
        views=views,
        lineage=_store(request).lineage(c["clip_id"]),
        nouns=_nouns(c),
        unplayable=playable(c["codec"], c["ext"]) if c["shard"] else "this clip has no raw shard (rejected at ingest)",
    )


def manifest(request: Request) -> Response:
    m = _manifest(request, request.query_params.get("name", ""), request.query_params.get("fp"))
    path, store = confined(_root(request), m["path"]), _store(request)
    return _stream(request, "manifest.html", m=m, info=lambda: _manifest_counts(store, path, m["fingerprint"]))


@functools.lru_cache(maxsize=16)
def _manifest_counts(store, path: Path, fingerprint: str) -> tuple[int, int, list[str], dict]:
    """A manifest's rows (views, for a cache's manifest), clips, columns and counts: computed once, as its
    content never changes (its fingerprint)."""
    import pyarrow.compute as pc

    names = pq.read_schema(path).names
    table = pq.read_table(path, columns=[c for c in ("clip_id", "bucket") if c in names])
    return table.num_rows, pc.count_distinct(table["clip_id"]).as_py(), names, store.breakdown(table)


def run(request: Request) -> Response:
    root, name = _root(request), request.query_params.get("name", "")
    d = runs.run_dir(root, name)
    if not d.is_dir():
        raise Refused(f"no run {name!r} under {root / 'runs'}")
    losses, bad = runs.losses(d), runs.bad_steps(d)
    return _render(
        request,
        "run.html",
        name=name,
        losses=losses[-MAX_ROWS:],
        logged=len(losses),
        bad=bad,
        svg=loss_svg(name, losses, {b["step"] for b in bad}),
        samples=runs.eval_samples(root, d),
        has_config=(d / "config.json").exists(),
    )


def step(request: Request) -> Response:
    root, name = _root(request), request.query_params.get("name", "")
    try:
        n = int(request.query_params.get("step", ""))
    except ValueError:
        raise ValueError(f"step = {request.query_params.get('step')!r}: expected a step number") from None
    rows = runs.step_clips(runs.run_dir(root, name), n)
    meta = _store(request).clips_by_id([r["clip_id"] for r in rows])
    return _render(request, "step.html", name=name, step=n, rows=rows, meta=meta)


def stage(request: Request) -> Response:
    root, name = _root(request), request.query_params.get("name", "")
    d = runs.run_dir(root, name)
    if not (d / "config.json").is_file():  # no run, or one that never started: its stage is not known
        raise NotFound(f"no run {name!r} with a config.json under {root / 'runs'}")
    return _stream(request, "stage.html", name=name, s=runs.stage(root, d, _store(request)))


def _stream(request: Request, template: str, **ctx) -> Response:
    """A page sent as it renders: its head at once, then what takes seconds at 1.3M clips (a manifest's
    join with the catalog, each epoch of a stage as the loader plans it), computed by the template."""

    def body():
        try:
            yield from templates.get_template(template).generate(request=request, **ctx)
        except (ValueError, OSError, Busy) as e:  # after the head is sent: the error is a line on the page
            yield f'<p class="err">{html.escape(" ".join(str(e).split()))}</p></main></body></html>'

    return StreamingResponse(body(), media_type="text/html; charset=utf-8")


# -- media ---------------------------------------------------------------------------------
def media_raw(request: Request) -> Response:
    """The clip's video member, straight from its raw shard (byte ranges of the tar); while a merge holds
    the catalog, from what an earlier request learnt of it (shards never change once written)."""
    try:
        c = _clip(request)
    except Busy:
        with _known_lock:
            c = _known.get(request.query_params.get("id", ""))
        if c is None:
            raise
    source = _raw_shard(request, c)
    kind, extra = served_as(f"{c['clip_id']}.{c['ext'] or 'mp4'}")  # an ext from the data: never an active type
    return slice_response(source, c["shard_offset"], c["file_size"], request.headers.get("range"), kind, extra)


def _input_path(request: Request, clip: dict) -> Path:
    if clip.get("reject_reason") == "withdrawn":
        raise Gone(f"clip {clip['clip_id']} was withdrawn ({clip.get('reject_detail') or 'a takedown'}): not served")
    if not clip["path"]:
        raise Refused("the source row names no file")
    p = Path(clip["path"])
    if not p.is_absolute():
        raise Refused(f"refused: the input path {clip['path']!r} is not absolute")
    if not p.exists():
        raise Refused(f"the input file {p} does not exist (any more)")
    try:
        return within(p, [_root(request), *request.app.state.videos])
    except Refused:
        raise Refused(
            f"the input file {p} is outside the data root: not served (start the viewer with --videos <its folder>)"
        ) from None


def media_input(request: Request) -> Response:
    """A rejected row's input file: only from ROOT or a --videos folder."""
    return file_response(_input_path(request, _clip(request)), request.headers.get("range"))


def _raw_shard(request: Request, c: dict):
    """The clip's raw shard, confined to ROOT as every file the viewer reads for a page (media_raw's rule): its
    path, or for a root in S3 its object's URL (the same relative path under the root)."""
    if not c["shard"]:
        raise Refused(f"clip {c['clip_id']!r} has no raw shard")
    path = confined(_root(request), c["shard"])
    remote = request.app.state.remote
    return remote / path.relative_to(_root(request)).as_posix() if remote else path


def media_thumb(request: Request) -> Response:
    c = _clip(request)
    _raw_shard(request, c)
    return file_response(preview.thumbnail(_root(request), c, _data(request)), None)


def _latent(request: Request) -> tuple[dict, dict]:
    c = _clip(request)
    cache, view = request.query_params.get("cache", ""), int(request.query_params.get("view", 0))
    lat = _store(request).latent(cache, c["clip_id"], view)
    if lat is None:
        raise NotFound(f"no latent of clip {c['clip_id']!r} in cache {cache!r} (view {view})")
    return c, lat


def media_window(request: Request) -> Response:
    c, lat = _latent(request)
    _raw_shard(request, c)  # the window is decoded from it
    return file_response(preview.window_preview(_root(request), c, lat, _data(request)), request.headers.get("range"))


def media_latent(request: Request) -> Response:
    c, lat = _latent(request)
    return file_response(preview.latent_preview(_root(request), c, lat, _data(request)), request.headers.get("range"))


def files(request: Request) -> Response:
    path = confined(_root(request), request.path_params["path"])
    if not path.is_file():
        raise Refused(f"not a file under the data root: {request.path_params['path']!r}")
    return file_response(path, request.headers.get("range"))


# -- helpers -------------------------------------------------------------------------------
def _span(request: Request, v: dict) -> dict | None:
    """Where the view's window sits in the clip: (start, frames covered, duration s), from cache.json."""
    if v["status"] != "ok":
        return None
    try:
        _cfg, ident = preview.cache_doc(_root(request), v["cache"])
    except Exception:  # noqa: BLE001 - a cache planned elsewhere: the page says so instead
        return None
    k = int(ident["buckets"].get("frame_interval", 1))
    weights = str(ident.get("video_encoder", {}).get("weights_sha256", ""))
    return {"interval": k, "covered": (v["num_frames"] - 1) * k + 1, "random_vae": weights.startswith("seeded-random")}


@functools.cache
def tagger():
    """textblob's PatternTagger (its lexicon takes about a second to load: server.py warms it at start)."""
    from textblob.en.taggers import PatternTagger

    return PatternTagger()


def _nouns(c: dict) -> list[tuple[str, bool]]:
    """The caption's words, each marked noun or not by the catalog's tagger (textblob's pattern)."""
    text = c["text"] or ""
    if not (c.get("noun_tagger") or "").startswith("textblob"):
        return [(text, False)]
    return [(w, tag in NOUN_TAGS) for w, tag in tagger().tag(text)]


def _ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> list[float]:
    """Round values from lo to hi, about n of them (1, 2 or 5 times a power of ten apart)."""
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(k * mag for k in (1, 2, 5, 10) if k * mag >= raw)
    if integer:
        step = max(1, round(step))
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def loss_svg(name: str, losses: list[dict], bad: set[int], w: int = 720, h: int = 240) -> dict | None:
    """The loss curve: points (bad or skipped steps marked), axes with round ticks, and a line where a
    resumed generation's steps begin (the run was stopped or killed before it)."""
    pts = [r for r in losses if r["loss"] is not None and math.isfinite(r["loss"])]
    if not pts:
        return None
    s0, s1 = pts[0]["step"], max(pts[-1]["step"], pts[0]["step"] + 1)
    lo, hi = min(r["loss"] for r in pts), max(r["loss"] for r in pts)
    hi = hi if hi > lo else lo + 1
    left, right, top, bottom = 56, 10, 10, 30

    def x_of(step):
        return left + (w - left - right) * (step - s0) / (s1 - s0)

    def y_of(loss):
        return top + (h - top - bottom) * (hi - loss) / (hi - lo)

    every = max(1, len(pts) // MAX_POINTS)  # a long run: every k-th step drawn, bad ones always
    pts = [r for i, r in enumerate(pts) if i % every == 0 or r["step"] in bad or r["skipped"]]
    points = [(x_of(r["step"]), y_of(r["loss"]), r["step"], f"{r['loss']:.4g}", r["step"] in bad or r["skipped"])
              for r in pts]  # fmt: skip
    resumes = [
        {"x": x_of(b["step"]), "step": b["step"], "generation": b["generation"]}
        for a, b in zip(losses, losses[1:])
        if (b.get("generation") or 0) > (a.get("generation") or 0)
    ]
    return {"w": w, "h": h, "points": points, "line": " ".join(f"{x:.1f},{y:.1f}" for x, y, *_ in points),
            "left": left, "bottom": h - bottom, "right": w - right, "top": top,
            "yticks": [(y_of(v), f"{v:.4g}") for v in _ticks(lo, hi)],
            "xticks": [(x_of(v), int(v)) for v in _ticks(s0, s1, integer=True)], "resumes": resumes}  # fmt: skip


def _json(v) -> str:
    return json.dumps(v, default=str)


def _urlpath(path: str) -> str:
    """A path under ROOT as the path of a URL: every character but '/' that means something in a URL quoted."""
    return quote(str(path), safe="/")


templates.env.filters["tojson_plain"] = _json
templates.env.filters["urlpath"] = _urlpath

ROUTES = [
    ("/", overview),
    ("/rejects", rejects),
    ("/reject", reject),
    ("/clips", clips),
    ("/clip", clip),
    ("/manifest", manifest),
    ("/run", run),
    ("/step", step),
    ("/stage", stage),
    ("/media/raw", media_raw),
    ("/media/input", media_input),
    ("/media/thumb", media_thumb),
    ("/media/window", media_window),
    ("/media/latent", media_latent),
    ("/files/{path:path}", files),
]
