PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: bench test venv clean lint

$(STAMP): pyproject.toml constraints.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -c constraints.txt torch==2.13.0
	$(VPY) -m pip install -q -c constraints.txt -e '.[test,mooncake]'
	touch $(STAMP)

venv: $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/hicache bench

test: $(STAMP)
	$(VPY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
