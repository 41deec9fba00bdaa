"""Open-Sora 1.2's own outputs on tiny seeded configs, shipped with the suite.

``tests/fixtures/opensora12/README.md`` says how they were made (the upstream commit, the
classes, the versions), their sha256 and the tolerances to compare with. A missing or changed file
fails the tests that need it (``test_fixtures_are_the_published_ones``), never skips them.
"""

from pathlib import Path

FIX = Path(__file__).resolve().parent / "fixtures" / "opensora12"


def checksums() -> dict[str, str]:
    """file name -> sha256, as the fixtures' README lists them."""
    text = (FIX / "README.md").read_text()
    block = text.split("sha256 of these exact files:", 1)[1].split("```")[1]
    return {name: digest for digest, name in (line.split() for line in block.strip().splitlines())}
