# mithrilfs sidecar: mounts the compile cache at /mithrilfs/cache for the other containers of a pod
# (share /mithrilfs with them: the mount sits on a subdirectory of the shared volume).
# Build: docker build -t mithrilfs .    Run: see deploy/ and the README.
# BASE: any Debian-like image with python3 and pip on PATH (the tests use a debootstrap'd one).
# PIP_CONFIG_FILE (optional): a pip.conf for both pip steps, e.g. a local wheelhouse or a mirror.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
ARG PIP_CONFIG_FILE
WORKDIR /src
COPY pyproject.toml README.md ./
COPY mithrilfs ./mithrilfs
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${BASE}
ARG PIP_CONFIG_FILE
RUN command -v fusermount3 >/dev/null || { apt-get update && apt-get install -y --no-install-recommends fuse3 \
    && rm -rf /var/lib/apt/lists/*; }
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY deploy/entrypoint.sh /usr/local/bin/mithrilfs-entrypoint
# the same image runs the shared tier's budget on a schedule (deploy/fleet-gc-cronjob.yaml)
COPY deploy/fleet-gc.sh /usr/local/bin/mithrilfs-fleet-gc
# no MITHRILFS_MAX_SIZE here: unset, the budget is the store's own (`mithrilfs config /store --max-size 50G`,
# kept in the store), else 10G; set it on the container to fix one for that container
ENV MITHRILFS_MOUNTPOINT=/mithrilfs/cache MITHRILFS_STORE=/store
VOLUME ["/store"]
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD mithrilfs status "$MITHRILFS_MOUNTPOINT" || exit 1
# SIGTERM (docker stop, a pod's termination) makes mithrilfs flush, unmount and exit 0
STOPSIGNAL SIGTERM
CMD ["/usr/local/bin/mithrilfs-entrypoint"]
