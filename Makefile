# The set-up on a fresh machine is one command: `make install` (or `make train`, `make test`, which run it).
# Each creates the virtualenv when it is missing. VENV may point outside the repo (CI does).
VENV ?= .venv
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-installed
CONFIG ?= configs/default.yaml
ARGS ?=

.PHONY: install train test lint format bench speedrun tensorboard clean

$(PY):
	python3 -m venv $(VENV)

# Heavy dependencies: reinstalled only when pyproject.toml, constraints.txt or the extras change. The extras:
# dev (pytest, ruff, sybil for the tested guides, httpx and playwright for the demo's tests), onnx (`vitmask
# export --onnx`, which the README's tour runs), demo (`vitmask demo`: starlette, uvicorn), and wandb and
# mlflow (train.loggers; their tests read back what each recorded, so CI installs them), and sweep (`vitmask
# sweep`: optuna, matplotlib).
EXTRAS := dev,onnx,demo,wandb,mlflow,sweep
$(DEPS): pyproject.toml constraints.txt Makefile | $(PY)
	$(PY) -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	touch $(DEPS)

# The project itself is reinstalled every time (cheap), so a venv shared between clones stays right.
install: $(DEPS)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .

train: install
	$(VENV)/bin/vitmask train --config $(CONFIG) --resume auto $(ARGS)

# Two pytest-xdist workers, whole files each (--dist loadfile: a file's module fixtures are built once),
# one intra-op thread each (tests/conftest.py): on 2 cores the suite takes about half its serial time
# (docs/contributing.md). The suite fails when it takes longer than SUITE_BUDGET seconds
# (tests/suite_budget.py: one line naming the total and the slowest files, printed on every run);
# --durations lists the 20 slowest tests.
SUITE_BUDGET ?= 420
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=20 --suite-budget $(SUITE_BUDGET) $(ARGS)

# the last line: pyright (on Node.js) type-checks a script of the public API; the variable skips its look-up
# of pyright's latest version on PyPI
lint: install
	$(PY) -m ruff check src tests scripts
	$(PY) -m ruff format --check src tests scripts
	$(PY) scripts/check_imports.py
	$(PY) scripts/check_history.py
	$(PY) scripts/check_links.py
	$(PY) scripts/gen_reference.py --check
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(PY) -m pyright --pythonpath $(PY) tests/typecheck/user_script.py

format: install
	$(PY) -m ruff format src tests scripts
	$(PY) -m ruff check --fix src tests scripts

bench: install
	$(PY) scripts/benchmark.py --config configs/bench.yaml $(ARGS)

# The speedrun of docs/benchmarks.md: MNIST (its test set, split 8000/1000/1000: MNIST_TEST, the test-set
# idx file of torchvision's download, or a folder of t10k-* idx files) to 0.60 non-empty accuracy at mask
# ratio 0.5, 10 minutes at most. It trains the ratio-0.5 recipe it is measured with:
# configs/mnist.yaml at a fixed ratio (32x32, ratio 0.5, random masks, rope2d,
# AdamW at lr 5e-3, beta2 0.999, a cosine over 5000 steps, fp32 eager).
SPEEDRUN_RECIPE = --set data.image_size=32 --set data.fit=pad \
	--set mask.strategy=random --set mask.ratio_schedule=fixed --set mask.ratio=0.5 \
	--set model.pos=rope2d --set train.optimizer=adamw --set train.lr=0.005 --set train.beta2=0.999 \
	--set train.max_steps=5000 --set train.precision=fp32 --set train.compile=false
MNIST_TEST ?= data/mnist/MNIST/raw/t10k-images-idx3-ubyte
speedrun: install
	$(PY) scripts/speedrun.py --config configs/mnist.yaml --set data.source=idx --set data.path=$(MNIST_TEST) \
		$(SPEEDRUN_RECIPE) --budget 600 --eval-every 60 --curve runs/speedrun/curve.csv --save runs/speedrun/last.pt $(ARGS)

tensorboard: install
	$(VENV)/bin/tensorboard --logdir runs

clean:
	rm -rf build dist src/*.egg-info .pytest_cache .ruff_cache

# The models shipped inside vitmask (src/vitmask/pretrained/, docs/models.md): configs/mnist.yaml, its fine-tuned
# classifier and configs/default.yaml, trained, exported, scored and carded by one script (tens of minutes on
# 2 CPU cores). PRETRAINED_DATA: a folder with MNIST's test-set idx files (t10k-*, plain or gzipped).
PRETRAINED_DATA ?= data/mnist/MNIST/raw
.PHONY: pretrained
pretrained: install
	$(PY) scripts/build_pretrained.py --data $(PRETRAINED_DATA) $(ARGS)
