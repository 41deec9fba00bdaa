"""``reelcache view``: a read-only local web app over a data root's catalog, caches and runs.

Pages are rendered on the server (Starlette + Jinja2 templates, no JavaScript build step) and
served by uvicorn on 127.0.0.1 unless ``--host`` says otherwise. Nothing is written but the
viewer's own thumbnails and previews under ``ROOT/view-cache/``; the catalog is opened read-only
with DuckDB's file access off for user SQL, and only files under ROOT (or a ``--videos`` folder
the operator names, for rejected input files) are ever served.
"""
