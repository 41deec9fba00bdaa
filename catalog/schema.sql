-- reelcache catalog schema.
-- schema_version: 4
--
-- The one definition of the catalog. Sidecar parquets are cast to a table's columns below (ingest's
-- to `clips`, the cache's to `latents`: catalog/db.py derives their Arrow schemas from this file), so
-- a column added here reaches every writer. A change to an existing table bumps
-- schema_version and comes with an explicit migration in catalog/db.py: MIGRATIONS.

CREATE TABLE IF NOT EXISTS meta (
    key   VARCHAR PRIMARY KEY,
    value VARCHAR
);

-- One row per input row of every source table, accepted or rejected.
CREATE TABLE IF NOT EXISTS clips (
    clip_id        VARCHAR NOT NULL,   -- stable: hash of (source, relative path[, occurrence])
    source         VARCHAR NOT NULL,   -- source name given at ingest (e.g. openvid, miradata)
    unit           VARCHAR NOT NULL,   -- ingest unit, e.g. 'openvid/000012'
    "row"          BIGINT  NOT NULL,   -- 0-based data row in the source table
    path           VARCHAR,            -- absolute path of the original video
    relpath        VARCHAR,            -- path as the table gives it, relative to --videos
    text           VARCHAR,            -- caption used for training
    status         VARCHAR NOT NULL,   -- 'ok' | 'rejected'
    reject_reason  VARCHAR,            -- fixed vocabulary, reelcache/rejects.py: Reason
    reject_detail  VARCHAR,            -- free text: what exactly was wrong

    -- probe of the file (headers and packets, never a full decode unless --verify decode)
    num_frames     BIGINT,
    frames_from    VARCHAR,            -- 'header' | 'demux' | 'decode'
    fps            DOUBLE,
    fps_num        BIGINT,             -- exact frame rate as a fraction
    fps_den        BIGINT,
    duration       DOUBLE,             -- seconds
    width          INTEGER,            -- displayed: stored width x SAR, then rotated (ffmpeg's display size)
    height         INTEGER,
    coded_width    INTEGER,            -- stored frame size, before SAR and rotation
    coded_height   INTEGER,
    rotation       INTEGER,            -- degrees, from the display matrix
    aspect_ratio   DOUBLE,             -- height / width (Open-Sora convention)
    resolution     BIGINT,             -- height * width
    codec          VARCHAR,
    pix_fmt        VARCHAR,
    bit_depth      INTEGER,
    container      VARCHAR,
    bit_rate       BIGINT,
    has_audio      BOOLEAN,
    file_size      BIGINT,

    -- what the source table claims; the probe is authoritative
    stated_num_frames BIGINT,
    stated_fps        DOUBLE,
    stated_duration   DOUBLE,
    stated_mismatch   VARCHAR,         -- e.g. 'num_frames 120!=121', NULL when they agree

    -- difficulty
    noun_count     INTEGER,
    noun_tagger    VARCHAR,            -- which tagger produced noun_count, with version
    level          TINYINT,            -- 1..5, equal-size quintiles of (noun_count, md5(clip_id)) over ok clips
    noun_pct       DOUBLE,             -- 0..100, percentile of the same ranking

    -- where the clip lives in the raw shards
    shard          VARCHAR,            -- relative to ROOT, e.g. 'raw/openvid/000012-00.tar'
    shard_offset   BIGINT,             -- byte offset of the video member's data in the tar
    ext            VARCHAR,            -- video member extension in the shard, e.g. 'mp4'

    -- OpenVid-1M scores
    aesthetic_score            DOUBLE,
    motion_score               DOUBLE,
    temporal_consistency_score DOUBLE,
    camera_motion              VARCHAR,

    -- MiraData: ids and every caption (which one is `text` is recorded in caption_column)
    mira_clip_id        VARCHAR,
    mira_source         VARCHAR,
    video_url           VARCHAR,
    video_id            VARCHAR,
    "timestamp"         VARCHAR,
    framestamp          VARCHAR,
    short_caption       VARCHAR,
    dense_caption       VARCHAR,
    background_caption  VARCHAR,
    main_object_caption VARCHAR,
    style_caption       VARCHAR,
    camera_caption      VARCHAR,
    caption_column      VARCHAR,

    -- schema version 2 (appended, so a migrated catalog has the same column order as a new one)
    sar_num        INTEGER,            -- sample (pixel) aspect ratio of the stored frames; 1:1 unless
    sar_den        INTEGER,            --   anamorphic. width = coded_width * sar_num / sar_den (rounded)
    stated_width   INTEGER,            -- the size the source table claims (csv/parquet width,height;
    stated_height  INTEGER,            --   MiraData), compared with the displayed size

    -- schema version 3
    content_hash   VARCHAR             -- blake2b-256 of the video's raw bytes (base/shards.py: content_hash),
                                       --   the store's content hash too; NULL for clips ingested before it
);

-- One row per merged unit of a stage: what merge has seen, so merging again is a no-op.
CREATE TABLE IF NOT EXISTS units (
    stage      VARCHAR NOT NULL,       -- 'ingest' | 'cache'
    unit       VARCHAR NOT NULL,       -- e.g. 'openvid/000012', 'tiny/000003'
    source     VARCHAR NOT NULL,       -- source name (ingest) or cache name (cache)
    sidecar    VARCHAR NOT NULL,       -- relative to ROOT
    signature  VARCHAR NOT NULL,       -- size:mtime_ns of the sidecar when merged
    num_rows   BIGINT NOT NULL,
    num_ok     BIGINT NOT NULL,
    merged_at  TIMESTAMP NOT NULL,
    PRIMARY KEY (stage, unit)
);

-- Raw shards, derived from clips (never stored twice).
CREATE VIEW IF NOT EXISTS shards AS
    SELECT shard, source, unit, count(*) AS num_clips, sum(file_size) AS video_bytes
    FROM clips WHERE shard IS NOT NULL GROUP BY ALL;

-- One row per (clip, cache, view) the cache stage planned: encoded, or rejected with a reason.
-- A cache of `views = K` draws K (bucket, window) views of each clip; two views that drew the same
-- bucket and window share one latent sample (the same shard and shard_offset).
CREATE TABLE IF NOT EXISTS latents (
    clip_id       VARCHAR NOT NULL,
    cache         VARCHAR NOT NULL,    -- cache name; ROOT/latents/<cache>/cache.json is its identity
    unit          VARCHAR NOT NULL,
    status        VARCHAR NOT NULL,    -- 'ok' | 'rejected'
    reject_reason VARCHAR,             -- fixed vocabulary, reelcache/rejects.py: Reason
    reject_detail VARCHAR,
    bucket        VARCHAR,             -- '<resolution>/<num_frames>/<aspect ratio>'
    num_frames    INTEGER,             -- frames encoded (the bucket's T)
    height        INTEGER,             -- pixels encoded
    width         INTEGER,
    window_start  BIGINT,              -- first source frame of the encoded window
    shape         INTEGER[],           -- latent shape [C, t, h, w]
    text_len      INTEGER,             -- caption tokens kept
    shard         VARCHAR,             -- latent shard, relative to ROOT
    shard_offset  BIGINT,              -- byte offset of the sample's .safetensors data
    -- schema version 4 (a catalog made before gains them when it is opened for writing: catalog/db.py)
    view          INTEGER DEFAULT 0,   -- which of the cache's K draws of the clip (0 .. K-1)
    -- the content-addressed store's (cache format 2, cache/store.py); NULL in format 1,
    -- whose samples hold their caption: shard/shard_offset then name latent and caption together
    video_key     VARCHAR,             -- the latent's store key (shard, shard_offset: where it lives)
    reused        BOOLEAN,             -- true: encoded before (by an earlier plan or another cache)
    text_key      VARCHAR,             -- the caption embedding's store key: (text encoder, caption)
    text_shard    VARCHAR,             -- caption shard, relative to ROOT (merge fills it from `captions`)
    text_offset   BIGINT               -- byte offset of the caption's .safetensors data
);

-- The store's caption embeddings (ROOT/store/text/<cache>/*.parquet, reloaded by every merge): one
-- row per stored embedding; each (text encoder identity, caption) is stored once.
CREATE TABLE IF NOT EXISTS captions (
    text_key      VARCHAR NOT NULL,
    shard         VARCHAR NOT NULL,
    shard_offset  BIGINT NOT NULL,
    text_len      INTEGER,
    bytes         BIGINT
);

-- Frozen selections: the parquet at `path` is named by its content fingerprint.
CREATE TABLE IF NOT EXISTS manifests (
    name        VARCHAR NOT NULL,
    fingerprint VARCHAR NOT NULL,
    path        VARCHAR NOT NULL,      -- relative to ROOT
    where_sql   VARCHAR,
    num_clips   BIGINT NOT NULL,
    created_at  TIMESTAMP NOT NULL,
    PRIMARY KEY (name, fingerprint)
);

-- Withdrawn clips (`reelcache takedown --apply`, lineage/takedown.py): one row per clip a takedown removed,
-- reloaded by every merge from ROOT/withdrawn/<takedown>.parquet (catalog/withdrawn.py), which ingest and
-- the trainer read without the catalog. Ingest rejects a video whose content hash is here (`withdrawn`).
CREATE TABLE IF NOT EXISTS withdrawn (
    clip_id       VARCHAR NOT NULL,
    content_hash  VARCHAR,             -- NULL only when the raw bytes were gone before the takedown
    takedown      VARCHAR NOT NULL,    -- the takedown's id: ROOT/withdrawn/<takedown>.parquet
    reason        VARCHAR NOT NULL,    -- the request, as given (--reason)
    withdrawn_at  TIMESTAMP NOT NULL,
    withdrawn_by  VARCHAR NOT NULL,    -- user@host that applied it
    source        VARCHAR,             -- the clip's source and original path, kept for the record
    path          VARCHAR
);
