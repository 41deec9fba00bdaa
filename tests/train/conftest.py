"""The loader tests' shared data (test_loader.py, test_simulate.py): 97 latent samples of
tests/latent_data.py in the tiny buckets, written once per module."""

from __future__ import annotations

import pytest
from latent_data import write_latents


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("latents")
    return root, write_latents(root, 97)
