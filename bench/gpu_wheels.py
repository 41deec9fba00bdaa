"""make gpu-wheels: what `make gpu-check` needs on the lent GPU machine and that machine lacks, as wheels.

The lent machines (README, "GPU check") have Python 3.12, torch 2.11 + CUDA 13, nvcc 13, transformers,
peft, pyarrow, numpy, safetensors, einops and psutil, reach no network, and take at most 64 MiB of
working tree and carried files per command. The check imports, beyond those:

- colossalai 0.5.0: the ZeRO-2 plugin and HybridAdam. PyPI has only its sdist; it is built here into a
  pure-Python wheel (no kernels compiled: its loaders compile them on the GPU machine at run time);
- galore-torch 1.0 and bitsandbytes 0.50.2: colossalai.nn.optimizer imports both. bitsandbytes' wheel is
  43 MB of per-CUDA libraries; only the CPU, CUDA 13.0 and 13.2 ones are kept (4 MB in all);
- diffusers 0.42.1: the VAE's spatial half (cache/opensora_vae.py);
- duckdb 2.0.1: train/loader.py resolves manifests through catalog/manifest.py, which imports it.

Not carried (not imported by the check): PyAV (no video is decoded), webdataset (local shards are read
with plain ranged reads), fabric (only `colossalai run` needs it).

    python bench/gpu_wheels.py [--dir bench/gpu-wheels] [--python 3.12]

Wheels for another Python (--python 3.11) let the same set be tried on this machine's venv.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BINARY = ["duckdb==2.0.1", "diffusers==0.42.1", "bitsandbytes==0.50.2", "galore-torch==1.0"]
SDIST = ["colossalai==0.5.0"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip
# bitsandbytes' native libraries the check can load: torch 2.11's CUDA 13, and the CPU one.
KEEP_BNB = re.compile(r"libbitsandbytes_(cpu|cuda13\d)\.so$")
LIMIT_MIB = 50


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def download(folder: Path, python: str) -> None:
    plats = [x for p in PLATFORMS for x in ("--platform", p)]
    pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
        *plats, "-d", str(folder), *BINARY)  # fmt: skip
    # colossalai's sdist builds a py3-none-any wheel (its setup.py compiles nothing unless BUILD_EXT=1)
    pip("wheel", "-q", "--no-deps", "-w", str(folder), *SDIST)


def slim_bitsandbytes(folder: Path) -> None:
    """Rewrite bitsandbytes' wheel without the native libraries of other CUDA/ROCm/XPU versions (and
    their RECORD lines): pip installs a wheel by its RECORD, so the rest installs as published."""
    for whl in folder.glob("bitsandbytes-*.whl"):
        with zipfile.ZipFile(whl) as src:
            drop = {n for n in src.namelist() if n.endswith(".so") and not KEEP_BNB.search(n)}
            if not drop:
                continue
            tmp = whl.with_suffix(".tmp")
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
                for item in src.infolist():
                    if item.filename in drop:
                        continue
                    data = src.read(item)
                    if item.filename.endswith(".dist-info/RECORD"):
                        lines = data.decode().splitlines(keepends=True)
                        data = "".join(x for x in lines if x.split(",")[0] not in drop).encode()
                    dst.writestr(item, data)
        tmp.replace(whl)


def replace_wheels(new: Path, folder: Path) -> None:
    """The wheels of ``folder`` replaced by those of ``new``, moved (a temporary folder is often on another
    file system than the checkout, a tmpfs /tmp: a rename across file systems fails)."""
    for old in folder.glob("*.whl"):
        old.unlink()
    for whl in new.glob("*.whl"):
        shutil.move(whl, folder / whl.name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, default=REPO / "bench/gpu-wheels")
    p.add_argument("--python", default="3.12", help="the Python the wheels are for (the GPU machine's: 3.12)")
    args = p.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:  # a fresh set: two versions of a package stop the install
        download(Path(tmp), args.python)
        slim_bitsandbytes(Path(tmp))
        replace_wheels(Path(tmp), args.dir)
    total = 0
    for whl in sorted(args.dir.glob("*.whl")):
        total += whl.stat().st_size
        print(f"{whl.stat().st_size / 2**20:7.1f} MiB  {whl.name}")
    print(f"{total / 2**20:7.1f} MiB  in {args.dir}")
    if total > LIMIT_MIB * 2**20:
        print(
            f"gpu-wheels: {total / 2**20:.1f} MiB is over the {LIMIT_MIB} MiB a device command carries beside the tree"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
