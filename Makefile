# Every target creates and fills .venv itself, so on a fresh machine `make train` and `make test` are all you run.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
STAMP   := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
PRESET  ?=
TOKENS  ?=
ARGS    ?=
BENCH   ?= kda

.PHONY: setup test test-gpu train bench export notebooks lab data clean-venv

setup: $(DEV_STAMP)

# Runtime install (what `make train` needs). On a machine whose python already has a CUDA torch (a GPU image) the
# venv links that site-packages in with a .pth file instead of installing torch again; elsewhere torch==2.13.0 comes
# first, so pip never pulls a multi-GB CUDA build onto a CPU machine. An offline GPU image that lacks some
# dependency still gets the package itself (--no-deps); whatever is missing then fails at import with its name.
$(STAMP): pyproject.toml
	@test -x $(PYTHON) || $(PY) -m venv $(VENV)
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
	    echo "setup: reusing $(PY)'s CUDA torch and packages"; \
	    $(PY) -c "import site; print('\n'.join(site.getsitepackages()))" \
	        > $$($(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/system_torch.pth; \
	    $(PYTHON) -m pip install -q -e . || { echo "setup: offline? installing moe_book without its dependencies"; \
	        $(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .; }; \
	else \
	    $(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0; \
	    $(PYTHON) -m pip install -q -e .; \
	fi
	@touch $(STAMP)

# Development tools (tests, notebooks, export, JupyterLab).
$(DEV_STAMP): $(STAMP)
	$(PYTHON) -m pip install -q -e ".[dev]"
	@touch $(DEV_STAMP)

export: setup
	$(PYTHON) tools/export.py

# The README's test command, and what .ci/run calls: no drift between chapters and package, unit tests, notebooks.
test: export
	@git status --porcelain -- moe_book kernels | grep . && { echo "make test: moe_book/ or kernels/ differ from what the chapters export; edit the notebook, run make export, commit both"; git diff --stat -- moe_book kernels; exit 1; } || true
	$(PYTHON) -m pytest -q tests/; rc=$$?; [ $$rc -eq 5 ] && echo "make test: pytest collected no tests in tests/ - the setup is broken"; [ $$rc -eq 0 ] || exit 1
	$(PYTHON) -m pytest -q --nbval-lax --nbval-current-env chapters/; rc=$$?; [ $$rc -eq 5 ] && echo "make test: no notebooks collected in chapters/"; [ $$rc -eq 0 ] || exit 1

test-gpu: $(STAMP)
	$(PYTHON) -m pytest -q -m gpu tests/

train: $(STAMP)
	$(PYTHON) -m moe_book.train $(if $(PRESET),--preset $(PRESET)) $(if $(TOKENS),train.tokens=$(TOKENS)) $(ARGS)

data: $(STAMP)
	$(PYTHON) -m moe_book.data prepare $(if $(PRESET),--preset $(PRESET)) $(ARGS)

bench: $(STAMP)
	$(PYTHON) -m moe_book.bench $(BENCH) $(ARGS)

# Re-execute every chapter in place (committed notebooks carry the outputs of a CPU run).
notebooks: setup
	$(BIN)/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=1200 chapters/[0-9][0-9]_*.ipynb

lab: setup
	$(PYTHON) -m ipykernel install --user --name moe-book --display-name "moe_book (.venv)"
	$(BIN)/jupyter lab chapters/

clean-venv:
	rm -rf $(VENV)
