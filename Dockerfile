# syntax=docker/dockerfile:1
# The one image of every HybridCache role and of the operator; the command picks what runs:
#   hybridcache serve router|combine|scatter|cache-tier ...   (built by operator/builders.py)
#   kopf run -m hybridcache.operator.main --all-namespaces     (manifests/operator/, the chart)
# The image of the `hybridcache-serve` distribution. Build from the repository root, then push to
# a registry the clusters pull from (docs/deploy.md, "The image"):
#   docker build -t hybridcache/hybridcache-serve:0.1.0 .

FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/hybridcache
ENV PATH=/opt/hybridcache/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY kernels/ kernels/
COPY services/ services/
COPY operator/ operator/
# the shipped QA model: package data of the distribution (hybridcache/models/default, what `hybridcache
# up` and `serve` load without --model)
COPY models/ models/
# the project with its gpu extra (fla-core, Triton) and the operator's, at the pinned versions;
# torch from the default index is the Linux build that carries the CUDA runtime the GPU roles need
RUN pip install -c constraints.txt ".[gpu,operator]" \
    && hybridcache model init --arch qwen3_5_text --preset tiny --out /app/models/tiny
# the same model at the path the CPU demo resource names (manifests/examples/cpu-demo.yaml)
COPY models/default/ /app/models/default/

FROM python:3.11-slim-bookworm
RUN groupadd --gid 10001 hybridcache \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin hybridcache
COPY --from=build /opt/hybridcache /opt/hybridcache
COPY --from=build --chown=10001:10001 /app/models /app/models
# Pods run with a read-only root filesystem: caches and scratch go to the /tmp emptyDir.
ENV PATH=/opt/hybridcache/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HOME=/tmp/hf \
    HF_HUB_OFFLINE=1
WORKDIR /app
USER 10001:10001
EXPOSE 8000 50051
ENTRYPOINT ["hybridcache"]
CMD ["--help"]
