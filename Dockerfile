# mithrilfs sidecar: mounts the compile cache at /cache for the other containers of a pod.
# Build: docker build -t mithrilfs .    Run: see deploy/ and the README.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY mithrilfs ./mithrilfs
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends fuse3 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY deploy/entrypoint.sh /usr/local/bin/mithrilfs-entrypoint
ENV MITHRILFS_MOUNTPOINT=/cache MITHRILFS_STORE=/store MITHRILFS_MAX_SIZE=10G
VOLUME ["/store"]
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD mithrilfs status "$MITHRILFS_MOUNTPOINT" || exit 1
# SIGTERM (docker stop, a pod's termination) makes mithrilfs flush, unmount and exit 0
STOPSIGNAL SIGTERM
CMD ["/usr/local/bin/mithrilfs-entrypoint"]
