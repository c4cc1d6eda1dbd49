PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

EXT := .venv-ext

.PHONY: test test-ext demo docs install clean

$(BIN)/flexflow: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(BIN)/flexflow

install: $(BIN)/flexflow

test: install
	$(BIN)/python -m pytest -q

# Optional suite: models as transformers, timm and torchvision ship them
# (tests/test_foreign.py). torchvision needs its own torch release, so these
# live in a separate environment; the main suite skips them.
$(EXT)/bin/flexflow: pyproject.toml
	test -x $(EXT)/bin/python || $(PY) -m venv $(EXT)
	$(EXT)/bin/pip install -q --upgrade pip
	$(EXT)/bin/pip install -q torch==2.14.1 torchvision==0.29.1
	$(EXT)/bin/pip install -q -e '.[dev,ext]'
	touch $(EXT)/bin/flexflow

test-ext: $(EXT)/bin/flexflow
	$(EXT)/bin/python -m pytest -q tests/test_foreign.py tests/test_capture.py

demo: install
	$(BIN)/python examples/demo.py

# The docs site (MkDocs, Material theme, API pages from the docstrings) in build/site;
# --strict: a broken link or a missing page fails the build.
$(BIN)/mkdocs: pyproject.toml $(BIN)/flexflow
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,docs]'
	touch $(BIN)/mkdocs

docs: $(BIN)/mkdocs
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(EXT) build *.egg-info
