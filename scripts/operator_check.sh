#!/usr/bin/env bash
# The README's operator and volunteer sequences on loopback, through the real CLI (scripts/operator_check.py says
# what each scenario checks). Prints one line per scenario, then:
#   operator scenarios=N ok=N silent_states=0 tracebacks=0 max_stop_s=X
set -euo pipefail
cd "$(dirname "$0")/.."
exec python scripts/operator_check.py "$@"
