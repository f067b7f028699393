#!/bin/sh
# mithrilfs fleet gc, configured from the same environment as the sidecar (entrypoint.sh): a budget for
# the shared tier, run on a schedule by deploy/fleet-gc-cronjob.yaml (Kubernetes) or
# deploy/mithrilfs-fleet-gc.timer (systemd).  One run deletes the cache entries unused for longer than
# MITHRILFS_GC_MAX_AGE, then the least recently used until the rest fits MITHRILFS_GC_MAX_SIZE, then the
# blobs no name references; it prints what it did in a few lines, and every node logs a fleet_gc event.
#
#   MITHRILFS_REMOTE, MITHRILFS_REMOTE_S3, MITHRILFS_REMOTE_ENDPOINT, MITHRILFS_REMOTE_NAMESPACE,
#   MITHRILFS_REMOTE_KEY_FILE, MITHRILFS_REMOTE_PASSWORD_FILE (or MITHRILFS_REMOTE_PASSWORD),
#   MITHRILFS_REMOTE_CLUSTER, AWS_*      the shared tier, exactly as the nodes mount it
#   MITHRILFS_GC_MAX_SIZE    bytes the names may reference after a run, e.g. 500G
#   MITHRILFS_GC_MAX_AGE     delete cache entries unused for longer, e.g. 14d
#   MITHRILFS_GC_GRACE       never delete a blob written more recently (default: the minimum, 7h)
#   MITHRILFS_GC_DRY_RUN     1: print what it would delete, delete nothing
#   MITHRILFS_BIN            the mithrilfs executable (default: mithrilfs on PATH)
set -eu
set -- fleet gc
if [ -n "${MITHRILFS_REMOTE:-}" ]; then set -- "$@" --remote "$MITHRILFS_REMOTE"; fi
if [ -n "${MITHRILFS_REMOTE_S3:-}" ]; then set -- "$@" --remote "$MITHRILFS_REMOTE_S3"; fi
if [ -n "${MITHRILFS_REMOTE_ENDPOINT:-}" ]; then set -- "$@" --remote-endpoint "$MITHRILFS_REMOTE_ENDPOINT"; fi
if [ -n "${MITHRILFS_REMOTE_NAMESPACE:-}" ]; then set -- "$@" --remote-namespace "$MITHRILFS_REMOTE_NAMESPACE"; fi
if [ -n "${MITHRILFS_REMOTE_KEY_FILE:-}" ]; then set -- "$@" --remote-key-file "$MITHRILFS_REMOTE_KEY_FILE"; fi
if [ -n "${MITHRILFS_REMOTE_PASSWORD_FILE:-}" ]; then set -- "$@" --remote-password-file "$MITHRILFS_REMOTE_PASSWORD_FILE"; fi
if [ "${MITHRILFS_REMOTE_CLUSTER:-0}" = 1 ]; then set -- "$@" --remote-cluster; fi
if [ -n "${MITHRILFS_GC_MAX_SIZE:-}" ]; then set -- "$@" --max-size "$MITHRILFS_GC_MAX_SIZE"; fi
if [ -n "${MITHRILFS_GC_MAX_AGE:-}" ]; then set -- "$@" --max-age "$MITHRILFS_GC_MAX_AGE"; fi
if [ -n "${MITHRILFS_GC_GRACE:-}" ]; then set -- "$@" --grace "$MITHRILFS_GC_GRACE"; fi
if [ "${MITHRILFS_GC_DRY_RUN:-0}" = 1 ]; then set -- "$@" --dry-run; fi
exec "${MITHRILFS_BIN:-mithrilfs}" "$@"
