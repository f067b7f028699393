#!/bin/sh
# mithrilfs sidecar entrypoint (the Docker image's default command; also usable directly).
# Mounts the cache in the foreground, configured from the environment, and stays until
# SIGTERM/SIGINT, on which mithrilfs flushes, unmounts and exits 0.  A daemon that dies is
# replaced on the live mount; to upgrade in place: pip install -U mithrilfs, then
# mithrilfs restart "$MITHRILFS_MOUNTPOINT" (both with docker exec / kubectl exec).
# App containers (no mithrilfs installed) put every JIT cache of the stack on the mount with
#   eval "$(cat /mithrilfs/cache/.mithrilfs/env)"      (what `mithrilfs env --list` describes)
#
#   MITHRILFS_MOUNTPOINT     where to mount (default /mithrilfs/cache): a subdirectory of the volume
#                            shared with the app containers (/mithrilfs), never the volume's root
#   MITHRILFS_STORE          the store, on a volume that outlives the container (default /store)
#   MITHRILFS_MAX_SIZE       byte budget, e.g. 50G (default: the store's setting from `mithrilfs config`, else 10G)
#   MITHRILFS_MIN_AGE / MITHRILFS_IDLE_TTL      eviction options (see mithrilfs mount --help)
#   MITHRILFS_REMOTE         redis://host:port/db, rediss://... or s3://BUCKET/PREFIX (shared tier)
#   MITHRILFS_REMOTE_S3      s3://BUCKET/PREFIX: a bucket (behind the Redis of MITHRILFS_REMOTE when set);
#                            credentials and region from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
#                            AWS_SESSION_TOKEN / AWS_REGION or AWS_PROFILE, as for the aws CLI
#   MITHRILFS_REMOTE_ENDPOINT  the S3 endpoint of a server that is not AWS (or AWS_ENDPOINT_URL)
#   MITHRILFS_REMOTE_PASSWORD_FILE   the Redis password (or MITHRILFS_REMOTE_PASSWORD itself)
#   MITHRILFS_REMOTE_CLUSTER 1: MITHRILFS_REMOTE is a node of a Redis Cluster
#   MITHRILFS_REMOTE_NAMESPACE, MITHRILFS_REMOTE_KEY_FILE, MITHRILFS_REMOTE_OWNER (UID:GID)
#   MITHRILFS_STARTUP_SET    the startup set this node records into (default "default")
#   MITHRILFS_PREFETCH       1: fetch the startup set from the shared tier at start and wait for it
#                            (hold the app back with `mithrilfs status --ready` as startup probe);
#                            0: do not fetch it at all; unset: fetch it in the background
#   MITHRILFS_METRICS_PORT   serve Prometheus metrics on 127.0.0.1:PORT
#   MITHRILFS_ALLOW_OTHER    1 (default): let the app containers' users in
#   MITHRILFS_BIN            the mithrilfs executable (default: mithrilfs on PATH)
set -eu
mountpoint="${MITHRILFS_MOUNTPOINT:-/mithrilfs/cache}"
store="${MITHRILFS_STORE:-/store}"
mkdir -p "$mountpoint" "$store"
# An app container that binds a path with the FUSE mount right on it gets that mount as its own
# volume root, which no unmount or new mount of the sidecar reaches: after a sidecar restart it
# keeps the dead mount (ENOTCONN).  Mounted on a subdirectory of the shared volume, both propagate.
if command -v mountpoint >/dev/null && mountpoint -q "$mountpoint"; then
    echo "mithrilfs-entrypoint: warning: $mountpoint is a volume's root: app containers started after this mount keep a dead mount when the sidecar restarts; mount on a subdirectory of the shared volume" >&2
fi
set -- mount "$mountpoint" --store "$store" --foreground
if [ -n "${MITHRILFS_MAX_SIZE:-}" ]; then set -- "$@" --max-size "$MITHRILFS_MAX_SIZE"; fi
if [ -n "${MITHRILFS_MIN_AGE:-}" ]; then set -- "$@" --min-age "$MITHRILFS_MIN_AGE"; fi
if [ -n "${MITHRILFS_IDLE_TTL:-}" ]; then set -- "$@" --idle-ttl "$MITHRILFS_IDLE_TTL"; fi
if [ -n "${MITHRILFS_REMOTE:-}" ]; then set -- "$@" --remote "$MITHRILFS_REMOTE"; fi
if [ -n "${MITHRILFS_REMOTE_S3:-}" ]; then set -- "$@" --remote "$MITHRILFS_REMOTE_S3"; fi
if [ -n "${MITHRILFS_REMOTE_ENDPOINT:-}" ]; then set -- "$@" --remote-endpoint "$MITHRILFS_REMOTE_ENDPOINT"; fi
if [ -n "${MITHRILFS_REMOTE_NAMESPACE:-}" ]; then set -- "$@" --remote-namespace "$MITHRILFS_REMOTE_NAMESPACE"; fi
if [ -n "${MITHRILFS_REMOTE_KEY_FILE:-}" ]; then set -- "$@" --remote-key-file "$MITHRILFS_REMOTE_KEY_FILE"; fi
if [ -n "${MITHRILFS_REMOTE_PASSWORD_FILE:-}" ]; then set -- "$@" --remote-password-file "$MITHRILFS_REMOTE_PASSWORD_FILE"; fi
if [ "${MITHRILFS_REMOTE_CLUSTER:-0}" = 1 ]; then set -- "$@" --remote-cluster; fi
if [ -n "${MITHRILFS_REMOTE_OWNER:-}" ]; then set -- "$@" --remote-owner "$MITHRILFS_REMOTE_OWNER"; fi
if [ -n "${MITHRILFS_STARTUP_SET:-}" ]; then set -- "$@" --startup-set "$MITHRILFS_STARTUP_SET"; fi
if [ "${MITHRILFS_PREFETCH:-}" = 1 ]; then set -- "$@" --prefetch; fi
if [ "${MITHRILFS_PREFETCH:-}" = 0 ]; then set -- "$@" --no-prefetch; fi
if [ -n "${MITHRILFS_METRICS_PORT:-}" ]; then set -- "$@" --metrics-port "$MITHRILFS_METRICS_PORT"; fi
if [ "${MITHRILFS_ALLOW_OTHER:-1}" = 1 ]; then set -- "$@" --allow-other; fi
exec "${MITHRILFS_BIN:-mithrilfs}" "$@"
