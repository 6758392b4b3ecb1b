# mpicube: install, train, test, bench.  GNU make; recipes are indented with tabs.
#
#   make install            .venv with mpicube, the MPICH wheel (gives mpiexec), numba (fused
#                           CPU kernels, compiled into numba's cache here) and pytest
#   make install-site-mpi   .venv with mpi4py built against the `mpicc` on PATH (clusters)
#   make train              train the default small model; TRAIN_ARGS="--steps 50" overrides
#   make test               run the test suite in TEST_WORKERS pytest-xdist workers (2: one a core
#                           of the 2-core reference machine), each test file whole on one worker
#   make mutants            plant tools/mutants.py's bugs one at a time in a copy; say which survive
#   make bench              run `mpicube bench`; ARGS="..." appends options
#   make clean              remove the venv and build files (runs/ is kept)

PYTHON ?= python3
VENV = .venv
BIN = $(VENV)/bin
STAMP = $(VENV)/.installed
# Marker left by install-site-mpi: later reinstalls must not add the MPICH wheel.
SITE_MPI = $(VENV)/.site-mpi
MPICC ?= mpicc

TRAIN_DEFAULTS = --n-layer 4 --n-head 12 --n-embd 144 --seq-len 64 --batch-size 8 \
                 --steps 500 --lr 3e-3 --warmup 20 --eval-every 100 --out runs/default
TRAIN_ARGS ?=
ARGS ?=
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
MUTANTS ?=

# The venv's bin first on PATH, so `mpiexec` is the one that matches its mpi4py.
WITH_VENV = PATH="$(abspath $(BIN)):$$PATH"

.PHONY: install install-site-mpi train test mutants bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	if [ -f $(SITE_MPI) ]; then extras=test,fast; else extras=mpich,test,fast; fi; \
	$(BIN)/python -m pip install -e ".[$$extras]"
	$(BIN)/python -m mpicube.device.fused_attention
	touch $@

install-site-mpi:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip uninstall -y mpich mpi4py
	@mpicc=$$(command -v $(MPICC)) || { echo "install-site-mpi: '$(MPICC)' not found; load the site MPI module first (or set MPICC=/path/to/mpicc)" >&2; exit 1; }; \
	echo "building mpi4py against $$mpicc"; \
	MPICC="$$mpicc" $(BIN)/python -m pip install --no-cache-dir --no-binary mpi4py mpi4py
	$(BIN)/python -m pip install -e ".[test,fast]"
	$(BIN)/python -m mpicube.device.fused_attention
	touch $(SITE_MPI) $(STAMP)

train: install
	$(WITH_VENV) $(BIN)/mpicube train $(TRAIN_DEFAULTS) $(TRAIN_ARGS)

test: install
	$(WITH_VENV) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests $(PYTEST_ARGS)

# MUTANTS="shards-sorted ..." runs some of the catalogue (python tools/mutants.py --list)
mutants: install
	$(WITH_VENV) $(BIN)/python tools/mutants.py $(MUTANTS)

$(VENV)/.installed-bench: $(STAMP)
	$(BIN)/python -m pip install -e ".[bench]"
	touch $@

bench: $(VENV)/.installed-bench
	$(WITH_VENV) $(BIN)/mpicube bench $(ARGS)

clean:
	rm -rf $(VENV) build dist .eggs .pytest_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
