#!/usr/bin/env bash
# A tiny run with its inference node on vLLM: the trainer (transformers validator) in the node's environment, one
# `join --role inference --backend vllm` from the vLLM environment (.venv-vllm, made by .ci/vllm, plus
# `.venv-vllm/bin/pip install -e .` for the node's own dependencies). Prints the trainer's step, the groups it
# accepted per node, the nodes it banned and its validation failures every 5 s until step 30; then kills the
# inference node with SIGKILL and counts vLLM engine processes left behind (0 expected). Loopback only.
set -u
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
D=$(mktemp -d /tmp/intellect-vllm-swarm-XXXX)
intellect-node bootstrap --data-dir "$D/trainer" --max-steps 30 --set train.online_filter=false > "$D/trainer.out" 2> "$D/trainer.err" &
TP=$!
trap 'kill -9 $TP ${IP:-} 2>/dev/null' EXIT
for _ in $(seq 1 90); do grep -q "^READY " "$D/trainer.out" 2>/dev/null && break; sleep 1; done
READY=$(grep "^READY " "$D/trainer.out" | head -1 | cut -c7-)
JOIN=$(echo "$READY" | python3 -c "import json,sys; print(json.load(sys.stdin)['join'])")
URL=$(echo "$READY" | python3 -c "import json,sys; print(json.load(sys.stdin)['status_url'])")
# shellcheck disable=SC2086  # the join line is words
$VENV/bin/$JOIN --data-dir "$D/inf" --backend vllm --threads 1 > "$D/inf.out" 2> "$D/inf.err" &
IP=$!
for i in $(seq 1 240); do
  LINE=$(curl -s "$URL/status" | python3 -c "import json,sys; d=json.load(sys.stdin); print('step', d['step'], 'accepted', d['accepted_groups_by_node'], 'banned', d['banned'], 'failures', d['validation_failures_by_reason'])" 2>/dev/null)
  echo "$((i * 5))s $LINE"
  case "$LINE" in "step 30 "*) break;; esac
  kill -0 $IP 2>/dev/null || { echo "the vLLM node exited: $D/inf.err"; break; }
  sleep 5
done
grep -c "loaded version" "$D/inf.err" | sed 's/^/versions loaded by the vLLM node: /'
kill -9 $IP; sleep 5
echo "vLLM engine processes left after SIGKILL of the node: $(pgrep -fc VLLM::EngineCore || true)"
echo "logs: $D"
