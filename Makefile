# Every target creates/uses .venv and installs what it needs, so `make demo` and `make test` work on a
# fresh machine. torch is installed first from the pinned CPU wheel so no dependency can pull a CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.draftsmith-installed
TORCH_SPEC ?= torch==2.13.0
SHARED ?= ../shared

.PHONY: install test demo bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,triton]"
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests

demo: $(STAMP)
	$(VENV)/bin/draftsmith demo

bench: $(STAMP)
	$(VENV)/bin/draftsmith bench --shared $(SHARED) --models demo-code-7m,house-code-28m --rounds 3 --json build/bench.json
	$(VENV)/bin/draftsmith bench-serve --shared $(SHARED)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
