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

.PHONY: install demo ingest cache test bench clean

install: $(STAMP)

# torch is pinned (an unpinned one pulls gigabytes of CUDA wheels); colossalai 0.5.0 pins an old
# torch, so it goes in with --no-deps plus the few modules it imports, never via pyproject.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,train]'
	$(BIN)/pip install -q --no-deps colossalai==0.5.0 galore-torch
	$(BIN)/pip install -q psutil einops peft accelerate bitsandbytes fabric
	$(BIN)/pip install -q diffusers
	touch $@

demo: install
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
	    "SELECT cache, bucket, status, count(*) AS clips, any_value(shape) AS latent_shape FROM latents GROUP BY ALL ORDER BY 2"
	$(BIN)/reelcache catalog manifest --root $(DEMO_ROOT) --name demo-stage1-tiny --cache tiny \
	    --where "height >= 240 AND level <= 3 AND noun_pct < 99.99"
	$(BIN)/reelcache loader simulate --root $(DEMO_ROOT) --manifest demo-stage1-tiny --buckets configs/buckets/demo.toml \
	    --world-size 4 --workers 2 --seed 42 --epochs 2 --save-at 5 --resume-world-size 3 \
	    --out $(DEMO_ROOT)/runs/demo/simulated-consumed.parquet
	$(BIN)/reelcache demo train --root $(DEMO_ROOT)
	$(BIN)/reelcache eval once --root $(DEMO_ROOT) --run runs/debug-stage2 --checkpoint latest --preset debug \
	    --prompts configs/eval/debug-prompts.txt --val-manifest demo-stage1-tiny --val-max-clips 32 --device cpu
	@echo "demo done: catalog $(DEMO_ROOT)/catalog.duckdb, plots $(DEMO_ROOT)/stats/catalog.png, latents $(DEMO_ROOT)/latents/tiny," \
	    "runs $(DEMO_ROOT)/runs/debug-stage{1,2}, loss plot $(DEMO_ROOT)/runs/demo-loss.png," \
	    "samples $(DEMO_ROOT)/runs/debug-stage2/eval/"

ingest: install
	@[ -n "$(ROOT)" ] && [ -n "$(SOURCE)" ] && [ -n "$(VIDEOS)" ] || \
	    { echo "usage: make ingest ROOT=... SOURCE=openvid|miradata|csv|parquet|folder META=... VIDEOS=... [NAME=] [ARGS=]"; exit 2; }
	mkdir -p $(ROOT)
	$(BIN)/reelcache ingest plan --root $(ROOT) --source $(SOURCE) --name $(NAME) \
	    $(if $(META),--meta $(META)) --videos $(VIDEOS) $(ARGS) > $(ROOT)/units-$(NAME).txt
	parallel --will-cite $$([ -t 2 ] && echo --bar) -j $(JOBS) --joblog $(ROOT)/ingest-$(NAME).joblog \
	    $(BIN)/reelcache ingest run --root $(ROOT) {} :::: $(ROOT)/units-$(NAME).txt
	$(BIN)/reelcache catalog merge --root $(ROOT)

cache: install
	@[ -n "$(ROOT)" ] && [ -n "$(CONFIG)" ] || { echo "usage: make cache ROOT=... CONFIG=configs/cache/....toml [JOBS=]"; exit 2; }
	$(BIN)/reelcache cache plan --root $(ROOT) --config $(CONFIG) > $(ROOT)/units-cache-$(notdir $(basename $(CONFIG))).txt
	parallel --will-cite $$([ -t 2 ] && echo --bar) -j $(JOBS) --joblog $(ROOT)/cache-$(notdir $(basename $(CONFIG))).joblog \
	    $(BIN)/reelcache cache run --root $(ROOT) {} :::: $(ROOT)/units-cache-$(notdir $(basename $(CONFIG))).txt
	$(BIN)/reelcache catalog merge --root $(ROOT)

test: install
	$(BIN)/pytest -q

bench: install
	@[ -f $(DEMO_ROOT)/latents/tiny/cache.json ] || $(MAKE) --no-print-directory demo
	$(BIN)/python bench/bench_ingest.py
	$(BIN)/python bench/bench_loader.py
	$(BIN)/python bench/bench_cache.py
	DEMO_ROOT=$(DEMO_ROOT) $(BIN)/python bench/bench_train.py

clean:
	rm -rf $(DEMO_ROOT) bench-out .pytest_cache
