"""Difficulty: nouns in the caption, and levels 1..5 by quantile.

``noun_count`` comes from a real part-of-speech tagger, run in batches inside each ingest unit
(so GNU parallel spreads it over every core and node). Two taggers:

- ``pattern`` (default): textblob's PatternTagger; its lexicon ships inside the wheel, so it
  works offline everywhere. Fast (~1,300 short captions/s per core), less accurate.
- ``spacy``: spaCy's ``en_core_web_sm`` when the user has it installed; more accurate, slower.

The tagger and its version are recorded per clip (``noun_tagger``): counts from different
taggers are not comparable, and levels should be computed over one.

Levels are recomputed on every merge over accepted clips, from one ranking: ok clips ordered by
``(noun_count, md5(clip_id))``. Noun counts are small integers, so ties are the normal case; cut
points on the counts alone would give levels of very unequal size (a fifth of the clips may have
exactly 6 nouns). Ranking breaks ties by a hash of the id (deterministic, the same on every
machine and DuckDB version, and uncorrelated with ingest order, unlike the id of a sequential
source), so the levels are true quintiles: ``level = 1 + floor(5 * (rank - 1) / n)`` gives five
levels whose sizes differ by at most one, and never puts more nouns in a lower level. The
trade-off: clips with the same noun count may land in two neighbouring levels, by their hash.
``noun_pct`` is ``100 * (rank - 1) / n`` from the same ranking, so ``WHERE noun_pct < 99.99``
drops exactly the hardest 0.01%.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import version

from reelcache import UserError

# textblob and spacy are imported by the tagger that uses them: ingest plan reads only TAGGERS and
# catalog merge only ranks counts (textblob takes 0.2 s to import), and spacy is optional (its absence
# is a UserError saying what to install).

TAGGERS = ("pattern", "spacy")
NOUN_TAGS = {"NN", "NNS", "NNP", "NNPS"}


@lru_cache(maxsize=2)
def _tagger(name: str):
    if name == "pattern":
        from textblob.en.taggers import PatternTagger

        tagger = PatternTagger()
        return f"textblob-{version('textblob')}-pattern", lambda texts: [
            sum(1 for _, tag in tagger.tag(t) if tag in NOUN_TAGS) for t in texts
        ]
    if name == "spacy":
        try:
            import spacy

            nlp = spacy.load("en_core_web_sm", disable=["parser", "ner", "lemmatizer"])
        except (ImportError, OSError) as e:
            raise UserError(
                "--tagger spacy needs spaCy and its en_core_web_sm model installed "
                f"(pip install spacy, then the model package): {e}"
            ) from e
        label = f"spacy-{spacy.__version__}-{nlp.meta['name']}-{nlp.meta['version']}"
        return label, lambda texts: [
            sum(1 for tok in doc if tok.pos_ in ("NOUN", "PROPN")) for doc in nlp.pipe(texts, batch_size=256)
        ]
    raise UserError(f"unknown tagger {name!r}; choose one of {', '.join(TAGGERS)}")


def tagger_name(name: str) -> str:
    return _tagger(name)[0]


def count_nouns(texts: list[str], tagger: str = "pattern") -> list[int]:
    """Nouns per caption, batched through one tagger instance."""
    return _tagger(tagger)[1]([t or "" for t in texts])


LEVELS_SQL = """
WITH ranked AS (
    SELECT clip_id, row_number() OVER (ORDER BY noun_count, md5(clip_id), clip_id) - 1 AS r, count(*) OVER () AS n
    FROM clips WHERE status = 'ok' AND noun_count IS NOT NULL
)
UPDATE clips SET
    level = 1 + (5 * ranked.r) // ranked.n,
    noun_pct = 100.0 * ranked.r / ranked.n
FROM ranked
WHERE clips.clip_id = ranked.clip_id
"""


def recompute_levels(con) -> None:
    con.execute("UPDATE clips SET level = NULL, noun_pct = NULL WHERE status <> 'ok' OR noun_count IS NULL")
    con.execute(LEVELS_SQL)
