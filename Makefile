# make demo   set up .venv and run the main job on this machine (CPU is fine)
# make test   set up .venv, build the user guide (docs/, --strict) and run the test suite without the few slow
#             end-to-end tests (under ~8 min)
# make test-slow   the slow end-to-end tests (marked `slow`); CI (.ci/run) runs both
# Both create/update .venv themselves and install pinned dependencies (constraints.txt, torch==2.13.0).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gpufleet-installed
# A CPU wheel of torch 2.13.0 lies here on the project's machines; elsewhere pip uses PyPI.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PIP_FLAGS := --disable-pip-version-check --progress-bar off $(FIND_LINKS) -c constraints.txt

.PHONY: demo test test-slow test-all venv lint bench clean browser docs

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_FLAGS) -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gpufleet check examples/quickstart.yaml
	rm -rf runs/demo
	$(VENV)/bin/gpufleet train examples/quickstart.yaml --set output.dir=runs/demo

test: $(STAMP) browser docs
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

test-slow: $(STAMP) browser
	$(PY) -m pytest -q -p no:cacheprovider -m slow tests

test-all: test test-slow

# The report's test opens it in a real headless Chromium: installed here when missing and root.
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; } \
		|| echo "chromium is missing (and this is not root): tests/test_monitor_report.py's browser test is skipped"

# The user guide (docs/, mkdocs.yml) into build/site: --strict fails on a broken link, anchor or page; offline.
# (No -q: with mkdocs 1.6.1 it hides the warnings from --strict too, and the build passes.)
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

bench: $(STAMP)
	$(PY) bench/startup.py
	$(PY) bench/scaling.py
	$(PY) bench/vs_trl.py

clean:
	rm -rf $(VENV) runs .pytest_cache build/site
