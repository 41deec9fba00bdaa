# reelcache: `make demo` (install + the whole pipeline on a generated dataset), `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
JOBS ?= $(shell nproc)

DEMO_DATA ?= demo-data
DEMO_ROOT ?= demo-root

# make ingest ROOT=/data/rc SOURCE=openvid META=OpenVid-1M.csv VIDEOS=/data/openvid [NAME=..] [ARGS=..]
ROOT ?=
SOURCE ?=
META ?=
VIDEOS ?=
NAME ?= $(SOURCE)
ARGS ?=

# make cache ROOT=/data/rc CONFIG=configs/cache/wan-stage1.toml [JOBS=<GPUs>]
CONFIG ?=

# make install-gpu [VENV=.venv-gpu]: the venv for CUDA nodes (docs/GPU.md, "GPU nodes"). torch 2.5.1 is the
# newest ColossalAI 0.5.0 declares (torch<=2.5.1); PyPI's Linux wheel of it is CUDA 12.4. transformers is
# ColossalAI's own pin; diffusers 0.39.0 is the newest that has AutoencoderKLWan (>= 0.33) and still
# allows huggingface-hub < 1.0, which transformers 4.51.3 needs. diffusers >= 0.35 refuses to import
# beside a peft < 0.17 (colossalai imports peft), so peft is 0.17.1, not ColossalAI's <= 0.13.2 (LoRA only).
GPU_TORCH ?= 2.5.1
GPU_PINS ?= torch==$(GPU_TORCH) transformers==4.51.3 diffusers==0.39.0 peft==0.17.1
GPU_STAMP := $(VENV)/.installed-gpu

.PHONY: sysdeps test-sysdeps install lock install-gpu gpu-kernels gpu-check gpu-wheels gpu-check-device demo ingest cache lint format test test-fast bench imports clean

# The programs the pipeline runs besides Python: ffmpeg (the tests' reference decoder) and GNU parallel
# (ingest and cache units, cluster checks): all `make demo` (and ingest, cache) installs. Installed once, with
# apt-get as root or through sudo; anywhere else, one line says what to install. `make test` also installs
# (test-sysdeps, as root only) what only the suite uses: Debian's Slurm and munge, for its one-node Slurm
# (tests/slurm_local.py, which runs only as root: elsewhere its tests skip, so no sudo for them); Chromium and
# its driver, for the viewer's browser tests (tests/view/test_server.py, skipped where they are missing);
# OpenSSH's server and iproute2, for its namespace cluster (tests/cluster_local.py; root only, else they
# skip). Each name is a package and the command that shows it installed (slurmctld brings sbatch), or
# package:command.
SYSDEPS := ffmpeg parallel
TEST_SYSDEPS := $(SYSDEPS) $(if $(filter 0,$(shell id -u)),munge slurmctld slurmd chromium chromium-driver:chromedriver \
    openssh-server:sshd iproute2:ip)
sysdeps test-sysdeps:
	@missing=""; for c in $(if $(filter test-sysdeps,$@),$(TEST_SYSDEPS),$(SYSDEPS)); do \
	    PATH="$$PATH:/usr/sbin:/sbin" command -v $${c#*:} >/dev/null || missing="$$missing $${c%%:*}"; done; \
	[ -z "$$missing" ] && exit 0; \
	if ! command -v apt-get >/dev/null; then \
	    echo "reelcache needs$$missing: install them with your system's package manager, then run make again"; exit 2; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; else \
	    echo "reelcache needs$$missing: run 'apt-get install -y$$missing' as root, then make again"; exit 2; fi; \
	echo "installing$$missing (apt-get)"; \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends$$missing >/dev/null

# A venv made by install-gpu stays a GPU venv: `make test|cache|demo VENV=...` never puts the CPU torch in it.
ifneq ($(wildcard $(GPU_STAMP)),)
install: $(GPU_STAMP)
	@touch $(STAMP)
else
install: $(STAMP)
endif

# torch is pinned (an unpinned one pulls gigabytes of CUDA wheels); colossalai 0.5.0 pins an old
# torch, so it goes in with --no-deps plus the few modules it imports, never via pyproject. It goes in
# last: a resolving install after it would print pip's false "dependency resolver" error about its pins.
# constraints.txt holds every other package at the version the suite last passed with.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,train,view,s3]' diffusers psutil einops peft accelerate bitsandbytes fabric
	$(BIN)/pip install -q -c constraints.txt --no-deps colossalai==0.5.0 galore-torch
	touch $@

# make lock: constraints.txt from this venv (run it after `make test` passed on newer packages:
# `$(BIN)/pip install -U ...`, then the suite, then this). Its header stays; torch's local label (+cpu) goes.
lock: install
	@{ grep '^#' constraints.txt; $(BIN)/pip freeze --exclude-editable | grep -v '^#' | \
	    sed 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/'; } > constraints.txt.new && mv constraints.txt.new constraints.txt
	@echo "constraints.txt: $$(grep -vc '^#' constraints.txt) packages"

install-gpu: $(GPU_STAMP)
	@$(MAKE) --no-print-directory gpu-kernels VENV=$(VENV)

# Every resolving install names the pins, so nothing moves torch; colossalai goes in last with
# --no-deps (pip checks no declared requirements then, so no false "dependency resolver" error).
$(GPU_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q torch==$(GPU_TORCH)
	$(BIN)/pip install -q -e '.[dev,train,view,s3]' $(GPU_PINS)
	$(BIN)/pip install -q $(GPU_PINS) psutil einops accelerate bitsandbytes fabric ninja
	$(BIN)/pip install -q --no-deps colossalai==0.5.0 galore-torch
	touch $@ $(STAMP)

# Builds (or, once built, loads) HybridAdam's two kernels, cpu_adam_x86 and fused_optim_cuda, with
# ColossalAI's own loaders into ~/.cache/colossalai/torch_extensions/, where every rank of a launch
# finds them. fused_optim is compiled for the visible GPU's compute capability: run it on a GPU node.
define GPU_KERNELS_PY
import os, subprocess, sys
import torch
from torch.utils.cpp_extension import CUDA_HOME
cuda = torch.version.cuda
if cuda is None:
    sys.exit(f"gpu-kernels: torch {torch.__version__} is a CPU build; make install-gpu VENV=... makes a CUDA venv")
nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
if not nvcc or not os.path.exists(nvcc):
    print(f"gpu-kernels: no nvcc (PATH, CUDA_HOME): HybridAdam's kernels not built; with a CUDA {cuda} toolkit, "
          "run make gpu-kernels on a GPU node, or each node compiles them when the run starts")
    sys.exit(0)
out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
release = next((line.split("release", 1)[1].split(",")[0].strip() for line in out.splitlines() if "release" in line), "?")
gpu = torch.cuda.is_available()
if release.split(".")[0] != cuda.split(".")[0]:
    msg = (f"gpu-kernels: nvcc {release} (CUDA_HOME={CUDA_HOME}) does not match torch's CUDA {cuda}: "
           f"export CUDA_HOME=<a CUDA {cuda.split('.')[0]}.x toolkit> and run make gpu-kernels")
    if gpu:
        sys.exit(msg)
    print(msg + " on a GPU node")
    sys.exit(0)
if not gpu:
    print(f"gpu-kernels: nvcc {release} found but no GPU visible: HybridAdam's kernels not built; "
          "run make gpu-kernels on a GPU node (fused_optim is compiled for its compute capability)")
    sys.exit(0)
from colossalai.kernel.extensions.base_extension import _Extension
from colossalai.kernel.kernel_loader import CPUAdamLoader, FusedOptimizerLoader
CPUAdamLoader().load()
FusedOptimizerLoader().load()
print(f"gpu-kernels: HybridAdam's kernels ready for torch {torch.__version__} (CUDA {cuda}, nvcc {release}) "
      f"in {_Extension.get_jit_extension_folder_path()}")
endef
export GPU_KERNELS_PY

gpu-kernels:
	@[ -x $(BIN)/python ] || { echo "gpu-kernels: no venv at $(VENV); make install-gpu VENV=$(VENV)"; exit 2; }
	@$(BIN)/python -c "$$GPU_KERNELS_PY"

# make gpu-check [GPU_CHECK_OUT=bench-out]: the real-size GPU paths measured on this machine's GPU in under
# 8 minutes (bench/gpu_check.py; README and docs/GPU.md, "GPU check"); without a GPU it says so and measures nothing.
# A lent GPU machine has no venv and no network: `make gpu-wheels` here fetches what it lacks into
# bench/gpu-wheels/ (git-ignored, 38 MiB), `make gpu-check-device` prints the device run to paste.
GPU_CHECK_OUT ?= bench-out
GPU_CHECK_DEVICE := python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	--target /tmp/site bench/gpu-wheels/*.whl || exit 1; export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; \
	timeout 570 python3 bench/gpu_check.py $$OUT 2>&1 | tee $$OUT/gpu_check.log
gpu-check: install
	$(BIN)/python bench/gpu_check.py $(GPU_CHECK_OUT)

gpu-wheels:
	$(PYTHON) bench/gpu_wheels.py

gpu-check-device:
	@[ -n "$$(ls bench/gpu-wheels/*.whl 2>/dev/null)" ] || echo "first: make gpu-wheels (bench/gpu-wheels/ is empty)"
	@echo 'device run: carry ["bench/gpu-wheels"], timeout_s 600, command:'
	@echo '$(GPU_CHECK_DEVICE)'

demo: sysdeps install
	@[ -f $(DEMO_DATA)/OpenVid-demo.csv ] || $(BIN)/reelcache demo generate --out $(DEMO_DATA)
	$(MAKE) --no-print-directory ingest ROOT=$(DEMO_ROOT) SOURCE=openvid META=$(DEMO_DATA)/OpenVid-demo.csv \
	    VIDEOS=$(DEMO_DATA)/videos ARGS="--config configs/ingest/demo.toml"
	$(BIN)/reelcache catalog stats --root $(DEMO_ROOT)
	$(BIN)/reelcache catalog manifest --root $(DEMO_ROOT) --name demo-stage1 \
	    --where "height >= 240 AND level <= 3 AND noun_pct < 99.99"
	$(BIN)/reelcache catalog export --root $(DEMO_ROOT) --format opensora --where "level <= 3" \
	    --out $(DEMO_ROOT)/exports/demo-stage1-opensora.csv
	$(MAKE) --no-print-directory cache ROOT=$(DEMO_ROOT) CONFIG=configs/cache/tiny.toml
	$(BIN)/reelcache catalog sql --root $(DEMO_ROOT) \
	    "SELECT cache, view, bucket, status, count(*) AS clips, any_value(shape) AS latent_shape FROM latents GROUP BY ALL ORDER BY 2, 3"
	$(BIN)/reelcache catalog manifest --root $(DEMO_ROOT) --name demo-stage1-tiny --cache tiny \
	    --where "height >= 240 AND level <= 3 AND noun_pct < 99.99"
	$(BIN)/reelcache loader simulate --root $(DEMO_ROOT) --manifest demo-stage1-tiny --buckets configs/buckets/demo.toml \
	    --world-size 4 --workers 2 --seed 42 --epochs 2 --save-at 5 --resume-world-size 3 \
	    --out $(DEMO_ROOT)/runs/demo/simulated-consumed.parquet
	$(BIN)/reelcache demo train --root $(DEMO_ROOT)
	$(BIN)/reelcache eval once --root $(DEMO_ROOT) --run runs/debug-stage2 --checkpoint latest --preset debug \
	    --prompts configs/eval/debug-prompts.txt --val-manifest demo-stage1-tiny --val-max-clips 32 --device cpu
	$(BIN)/reelcache catalog manifest --root $(DEMO_ROOT) --name demo-grow --where "height >= 240 AND noun_pct < 99.99"
	$(BIN)/reelcache cache plan --root $(DEMO_ROOT) --config configs/cache/tiny-grow.toml > $(DEMO_ROOT)/units-cache-tiny-grow.txt
	@echo "demo done: catalog $(DEMO_ROOT)/catalog.duckdb, plots $(DEMO_ROOT)/stats/catalog.png, latents $(DEMO_ROOT)/latents/tiny," \
	    "runs $(DEMO_ROOT)/runs/debug-stage{1,2}, loss plot $(DEMO_ROOT)/runs/demo-loss.png," \
	    "samples $(DEMO_ROOT)/runs/debug-stage2/eval/"
	@echo "see it in a browser: $(BIN)/reelcache view --root $(DEMO_ROOT) --videos $(DEMO_DATA)/videos   # http://127.0.0.1:8050"

ingest: sysdeps install
	@[ -n "$(ROOT)" ] && [ -n "$(SOURCE)" ] && [ -n "$(VIDEOS)" ] || \
	    { echo "usage: make ingest ROOT=... SOURCE=openvid|miradata|csv|parquet|folder META=... VIDEOS=... [NAME=] [ARGS=]"; exit 2; }
	mkdir -p $(ROOT)
	$(BIN)/reelcache ingest plan --root $(ROOT) --source $(SOURCE) --name $(NAME) \
	    $(if $(META),--meta $(META)) --videos $(VIDEOS) $(ARGS) > $(ROOT)/units-$(NAME).txt
	parallel --will-cite $$([ -t 2 ] && echo --bar) -j $(JOBS) --joblog $(ROOT)/ingest-$(NAME).joblog \
	    $(BIN)/reelcache ingest run --root $(ROOT) {} :::: $(ROOT)/units-$(NAME).txt
	$(BIN)/reelcache catalog merge --root $(ROOT)

cache: sysdeps install
	@[ -n "$(ROOT)" ] && [ -n "$(CONFIG)" ] || { echo "usage: make cache ROOT=... CONFIG=configs/cache/....toml [JOBS=]"; exit 2; }
	$(BIN)/reelcache cache plan --root $(ROOT) --config $(CONFIG) > $(ROOT)/units-cache-$(notdir $(basename $(CONFIG))).txt
	parallel --will-cite $$([ -t 2 ] && echo --bar) -j $(JOBS) --joblog $(ROOT)/cache-$(notdir $(basename $(CONFIG))).joblog \
	    $(BIN)/reelcache cache run --root $(ROOT) {} :::: $(ROOT)/units-cache-$(notdir $(basename $(CONFIG))).txt
	$(BIN)/reelcache catalog merge --root $(ROOT)

# The formatter's and the linter's verdict (pyproject.toml [tool.ruff]); `make format` applies both fixes.
lint: install
	$(BIN)/ruff format --check --quiet . || { echo "make lint: run 'make format' to reformat"; exit 1; }
	$(BIN)/ruff check --quiet .

format: install
	$(BIN)/ruff check --fix --quiet .
	$(BIN)/ruff format --quiet .

# The suite in 3 xdist workers (TEST_WORKERS), grouped and ordered by tests/conftest.py: much of it waits
# on timers (Slurm's node timeouts, lease TTLs, watchdog limits), so more workers than cores keep the two
# cores busy. TEST_WORKERS=0 runs it one test at a time.
TEST_WORKERS ?= 3
test: test-sysdeps install lint
	$(BIN)/pytest -q -n $(TEST_WORKERS)

# The unit tests alone: every component in milliseconds, no multi-process or end-to-end run (those
# are marked slow; multinode, slurm and browser tests count as slow too). Under a minute.
test-fast: install
	$(BIN)/pytest -q -m "not slow"

bench: install
	@[ -f $(DEMO_ROOT)/latents/tiny/cache.json ] || $(MAKE) --no-print-directory demo
	$(BIN)/python bench/bench_gpu_projection.py
	$(BIN)/python bench/bench_ingest.py
	$(BIN)/python bench/bench_loader.py
	$(BIN)/python bench/bench_loader_s3.py
	$(BIN)/python bench/bench_ingest_s3.py
	$(BIN)/python bench/bench_cache.py
	$(BIN)/python bench/bench_view.py
	$(BIN)/python bench/bench_lineage.py
	DEMO_ROOT=$(DEMO_ROOT) $(BIN)/python bench/bench_train.py
	DEMO_ROOT=$(DEMO_ROOT) $(BIN)/python bench/bench_launch.py
	DEMO_ROOT=$(DEMO_ROOT) $(BIN)/torchrun --nproc_per_node 2 bench/bench_log.py

# docs/imports.png, the picture in docs/DESIGN.md ("Floors"): the import graph of the package drawn from the code
# (reelcache/layers.py, whose rules tests/core/test_layers.py checks). Run it when an arrow between packages changes.
imports: install
	$(BIN)/python -m reelcache.layers docs/imports.png

clean:
	rm -rf $(DEMO_ROOT) bench-out .pytest_cache
