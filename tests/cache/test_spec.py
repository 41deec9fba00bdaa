"""cache/spec.py alone, in milliseconds: an encoder's identity without loading it.

The weights hash is compared with sha256 computed here over the same files (relative name, then
bytes, in sorted order: the rule the module docstring states); the cache beside the weights is shown
to be used (a planted digest comes back while the stamp matches) and to be dropped when a file
changes. That the identity needs no torch is checked in a fresh interpreter.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from reelcache import UserError
from reelcache.cache.spec import EncoderSpec, files_hash, spatial_multiple, spec_identity, temporal_ratio


def _weights(folder):
    folder.mkdir()
    (folder / "config.json").write_text('{"z_dim": 4}')
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(bytes(range(256)) * 3)
    (folder / "notes.md").write_text("not a weight file: not hashed")
    return folder


def _reference(folder) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        h.update(name.encode())
        h.update((folder / name).read_bytes())
    return h.hexdigest()


def test_files_hash_is_sha256_of_names_and_bytes_and_is_cached_by_stamp(tmp_path):
    folder = _weights(tmp_path / "vae")
    assert files_hash(folder) == _reference(folder)
    cache = folder / ".reelcache-sha256.json"
    doc = json.loads(cache.read_text())
    cache.write_text(json.dumps({**doc, "sha256": "planted"}))
    assert files_hash(folder) == "planted"  # same sizes and mtimes: not read again
    (folder / "config.json").write_text('{"z_dim": 16}')
    assert files_hash(folder) == _reference(folder) != doc["sha256"]


def test_a_folder_without_weights_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no weights"):
        files_hash(tmp_path / "empty")


def test_identity_names_what_makes_the_outputs(tmp_path):
    folder = _weights(tmp_path / "vae")
    real = spec_identity(EncoderSpec(kind="wan", path=str(folder), dtype="float32"))
    assert (real["kind"], real["tiny"], real["dtype"]) == ("wan", False, "float32")
    assert real["config"] == {"z_dim": 4} and real["weights_sha256"] == _reference(folder)
    assert set(real["versions"]) == {"torch", "diffusers", "transformers"}
    tiny = spec_identity(EncoderSpec(kind="t5", tiny=True, seed=3, max_tokens=12))
    assert tiny["weights_sha256"] == "seeded-random:3" and tiny["max_tokens"] == 12
    assert "max_tokens" not in real  # only a text encoder's captions have a token count


def test_shape_rules_of_real_and_tiny_models():
    assert [temporal_ratio(EncoderSpec(kind=k, path="w")) for k in ("wan", "ltx", "sd-per-frame")] == [4, 8, 1]
    assert [temporal_ratio(EncoderSpec(kind=k, tiny=True)) for k in ("wan", "hunyuan", "sd-per-frame")] == [2, 4, 1]
    assert spatial_multiple(EncoderSpec(kind="ltx", path="w")) == 32
    assert spatial_multiple(EncoderSpec(kind="ltx", tiny=True)) == 8


@pytest.mark.parametrize(
    "kw,says",
    [
        (dict(kind="wan"), "give `path`"),
        (dict(kind="vae9000", tiny=True), "vae9000"),
        (dict(kind="wan", tiny=True, dtype="fp8"), "fp8"),
    ],
)
def test_a_bad_spec_is_one_line(kw, says):
    with pytest.raises(UserError) as e:
        EncoderSpec(**kw)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_identity_loads_no_torch(tmp_path):
    code = (
        "import sys; from reelcache.cache.spec import EncoderSpec, spec_identity; "
        "spec_identity(EncoderSpec(kind='wan', tiny=True)); "
        "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
