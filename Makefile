PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test demo install clean

$(BIN)/flexflow: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(BIN)/flexflow

install: $(BIN)/flexflow

test: install
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/python examples/demo.py

clean:
	rm -rf $(VENV) build *.egg-info
