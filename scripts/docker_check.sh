#!/usr/bin/env bash
# The Docker path, proven against a real daemon (run by hand as root; not part of CI): builds the image, starts a
# trainer on this machine, runs the README's `docker run ... join` line, and checks that the trainer accepts the
# container's batches, that the container turns healthy, that a new container on the same volume keeps the node
# id, and that `docker stop` ends it cleanly within 10 s. Prints a summary line:
#   docker image_mb=... accepted_groups=... same_id_after_restart=yes stop_s=... healthy=yes
#
# On a machine without a registry or internet access (this project's), it starts dockerd (vfs), makes a local
# python:3.11-slim-equivalent base with debootstrap, and builds against local package indexes served from
# /opt/wheels (the CPU torch) and /opt/pypi-more, PyPI for the rest (ENVIRONMENT.md). Everything it starts is
# stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-intellect-node:check}
WORK=$(mktemp -d /tmp/docker-check-XXXX)
PIDS=()
cleanup() {
    docker rm -f inode-check >/dev/null 2>&1 || true
    docker volume rm -f inode-check-data >/dev/null 2>&1 || true
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT

if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || apt-get install -y -qq docker.io >/dev/null
    (dockerd --storage-driver=vfs >"$WORK/dockerd.log" 2>&1 &)
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
if ! docker image inspect python:3.11-slim >/dev/null 2>&1; then
    echo "making a local python:3.11-slim (debootstrap bookworm)"
    command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
    BASE="$WORK/base"
    debootstrap --variant=minbase bookworm "$BASE" >/dev/null
    cp /etc/apt/sources.list* "$BASE/etc/apt/" 2>/dev/null || true
    chroot "$BASE" bash -c "apt-get update -qq && apt-get install -y -qq python3 python3-pip python3-venv ca-certificates >/dev/null && python3 -m venv /usr/local && rm -rf /var/lib/apt/lists/*"
    cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$BASE/etc/ssl/certs/host-ca.crt"
    tar -C "$BASE" -c . | docker import --change 'ENV PIP_CERT=/etc/ssl/certs/host-ca.crt' \
        --change 'ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - python:3.11-slim >/dev/null
fi

BUILD_ARGS=()
if [ -d /opt/wheels ]; then  # this project's machine: the PyTorch CPU index is unreachable; its wheel is local
    python -m http.server 18766 --bind 127.0.0.1 --directory /opt/wheels >/dev/null 2>&1 & PIDS+=($!)
    python -m http.server 18767 --bind 127.0.0.1 --directory /opt/pypi-more >/dev/null 2>&1 & PIDS+=($!)
    sleep 1
    BUILD_ARGS=(--network host --build-arg PIP_FIND_LINKS=http://127.0.0.1:18766/ --build-arg PIP_TRUSTED_HOST=127.0.0.1
                --build-arg TORCH_INDEX_URL=http://127.0.0.1:18767/simple)
fi
started=$(date +%s)
docker build -q "${BUILD_ARGS[@]}" -t "$IMAGE" . >/dev/null
echo "built $IMAGE in $(( $(date +%s) - started )) s"
image_mb=$(( $(docker image inspect "$IMAGE" --format '{{.Size}}') / 1000000 ))

# a trainer on this machine (the host's install), and the README's one-liner against it
intellect-node bootstrap --data-dir "$WORK/trainer" --max-steps 100000 >"$WORK/trainer.out" 2>"$WORK/trainer.log" & PIDS+=($!)
for _ in $(seq 120); do grep -q '^READY ' "$WORK/trainer.out" && break; sleep 1; done
ready=$(grep '^READY ' "$WORK/trainer.out" | cut -c7-)
peer=$(python -c "import json,sys; print(json.loads(sys.argv[1])['p2p_maddrs'][0])" "$ready")
run_id=$(python -c "import json,sys; print(json.loads(sys.argv[1])['run_id'])" "$ready")
status_url=$(python -c "import json,sys; print(json.loads(sys.argv[1])['status_url'])" "$ready")
join=(docker run -d --rm --name inode-check --network host -v inode-check-data:/data "$IMAGE"
      join --role inference --peers "$peer" --run-id "$run_id")
"${join[@]}" >/dev/null
node_id=$(docker run --rm -v inode-check-data:/data "$IMAGE" id)
accepted=0
for _ in $(seq 240); do
    accepted=$(curl -s "$status_url/status" | python -c "import json,sys; print(json.load(sys.stdin)['accepted_groups_by_node'].get(sys.argv[1], 0))" "$node_id")
    [ "$accepted" -gt 0 ] && break; sleep 1
done
healthy=no
for _ in $(seq 200); do
    [ "$(docker inspect --format '{{.State.Health.Status}}' inode-check)" = healthy ] && { healthy=yes; break; }; sleep 1
done
t0=$(date +%s.%N); docker stop inode-check >/dev/null; t1=$(date +%s.%N)
stop_s=$(python -c "print(f'{$t1 - $t0:.1f}')")
for _ in $(seq 60); do docker inspect inode-check >/dev/null 2>&1 || break; sleep 1; done  # --rm removes it
"${join[@]}" >/dev/null  # a new container on the same volume
sleep 5
again=$(docker exec inode-check intellect-node id)  # the id the new container's node runs with
same=$([ "$again" = "$node_id" ] && echo yes || echo no)
docker stop inode-check >/dev/null
echo "node $node_id: accepted groups $accepted; healthy $healthy; stop ${stop_s} s; same id after restart: $same"
docker image ls "$IMAGE" --format '{{.Repository}}:{{.Tag}} {{.Size}}'
echo "docker image_mb=$image_mb accepted_groups=$accepted same_id_after_restart=$same stop_s=$stop_s healthy=$healthy"
[ "$accepted" -gt 0 ] && [ "$same" = yes ] && [ "$healthy" = yes ] && python -c "import sys; sys.exit(0 if $stop_s <= 10 else 1)"
