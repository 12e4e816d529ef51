# syntax=docker/dockerfile:1
#
# Two images from one build, each with only its program's dependencies (pyproject.toml's extras):
#
#   operator    (the default target) `better-compute-operator`: kopf handlers, admission
#               webhooks, reconciler, HTTP API; the 'server' extra (PostgreSQL driver, kopf, Cedar).
#   node-agent  `better-compute-deviceplugin`: the node agent and device plugin; the 'node'
#               extra (gRPC, NVML), without PostgreSQL, kopf or Cedar. The Helm chart's DaemonSet
#               runs it as root, because it writes host paths.
#
#   docker build -t better-compute:0.1.0 --build-arg VERSION=0.1.0 --build-arg SOURCE=<repo URL> .
#   docker build --target node-agent -t better-compute-node:0.1.0 --build-arg VERSION=0.1.0 .
#
# Every dependency comes from a hashed lock (requirements.lock for the operator's 'server' extra,
# requirements-node.lock for the node agent's 'node' extra, requirements-build.lock for the
# build backend; each file's first lines say how to refresh it) installed with --require-hashes,
# and our own wheel with --no-deps: two builds of one commit install the same files, and a
# changed file on the index fails the build.
#
# The base is pinned by version tag. It is not pinned by digest: no registry could be reached
# where this file was written, so no digest could be read honestly. Pin one in your build
# (--build-arg PYTHON_IMAGE=python:3.11.14-slim-trixie@sha256:…) once you have pulled it.
ARG PYTHON_IMAGE=python:3.11.14-slim-trixie

# --- build: our wheel and every dependency's, installed into one virtual environment per image -
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md requirements.lock requirements-node.lock requirements-build.lock ./
COPY src ./src
# Binary wheels for the dependencies where there are any (no compiler is needed, and none is
# used), each checked against its lock's hashes; ours is built from the source tree with the
# locked setuptools (requirements-build.lock, no build isolation that would fetch another), here
# and nowhere else, and installed without resolving anything.
RUN python -m pip install --require-hashes -r requirements-build.lock \
 && python -m pip wheel --no-deps --no-build-isolation --wheel-dir /wheels . \
 && for image in operator:requirements.lock node:requirements-node.lock; do \
      venv="/opt/bcd-${image%%:*}"; \
      python -m venv "$venv" \
      && "$venv/bin/pip" install --require-hashes --prefer-binary -r "${image##*:}" \
      && "$venv/bin/pip" install --no-deps --no-index /wheels/better_compute-*.whl \
      && "$venv/bin/python" -m compileall -q "$venv/lib" \
      && "$venv/bin/pip" uninstall --yes pip setuptools; \
    done

# --- runtime: a clean base, nothing to build with; each image adds its virtual environment ----
FROM ${PYTHON_IMAGE} AS runtime
ARG VERSION=0.1.0
ARG SOURCE=""
LABEL org.opencontainers.image.title="better-compute" \
      org.opencontainers.image.description="GPU reservations for Kubernetes" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0"
# The base's own pip and setuptools go too: nothing is installed at run time. A fixed uid with a
# passwd entry, so that getpass and the chart's runAsUser agree.
RUN python -m pip uninstall --yes --disable-pip-version-check pip setuptools wheel \
 && groupadd --system --gid 10001 bcd \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin bcd
ENV PATH=/opt/bcd/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
# No ENTRYPOINT, so `docker run IMAGE better-compute --help` works as well as the default;
# no HEALTHCHECK: Kubernetes probes /healthz and /readyz.

# --- node-agent: the device plugin, without PostgreSQL, kopf or Cedar -------------------------
FROM runtime AS node-agent
LABEL org.opencontainers.image.title="better-compute-node"
COPY --from=build /opt/bcd-node /opt/bcd
CMD ["better-compute-deviceplugin"]

# --- operator (the default target, last) ------------------------------------------------------
FROM runtime AS operator
COPY --from=build /opt/bcd-operator /opt/bcd
CMD ["better-compute-operator"]
