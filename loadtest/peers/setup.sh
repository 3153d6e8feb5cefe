#!/usr/bin/env bash
# LiteLLM's proxy in a virtualenv of its own, for `switchyard-loadtest bench` (which runs this
# script itself, embedded in the binary): the peer gateway measured beside Switchyard against
# the same engine. Installs into $1 (the bench uses target/bench-peers) and nowhere else.
#   $1/litellm-venv : litellm[proxy]==$LITELLM_VERSION
# LITELLM_VERSION=1.108.7 is the newest litellm whose [proxy] extra resolves on the package
# index reachable here (1.108.8 .. 1.110.2 pin litellm-proxy / litellm-proxy-extras /
# litellm-enterprise builds the index does not have; 1.107.x, the compromised release line,
# is not on it). Wheels are downloaded first and refused if any ships a .pth file (the vector
# of the 2026 litellm supply-chain compromises), then installed from the checked wheels only.
# Adapted from the project's peers setup (shared/peers/litellm/setup.sh).
set -euo pipefail
PEERS=${1:?usage: setup.sh DIR}
LITELLM_VERSION="${LITELLM_VERSION:-1.108.7}"
PY="${PYTHON:-python3}"
mkdir -p "$PEERS/wheels"

if [ ! -x "$PEERS/litellm-venv/bin/litellm" ]; then
  "$PY" -m venv "$PEERS/litellm-venv"
  "$PEERS/litellm-venv/bin/pip" install -q -U pip
  "$PEERS/litellm-venv/bin/pip" download -q -d "$PEERS/wheels" "litellm[proxy]==${LITELLM_VERSION}"
  "$PEERS/litellm-venv/bin/python" - "$PEERS/wheels" <<'PYEOF'
import glob, sys, zipfile
bad = [(w, n) for w in glob.glob(sys.argv[1] + "/*.whl") for n in zipfile.ZipFile(w).namelist() if n.endswith(".pth")]
if bad:
    sys.exit(f"refusing to install: wheels ship .pth files: {bad}")
print("wheel check: no .pth files")
PYEOF
  "$PEERS/litellm-venv/bin/pip" install -q --no-index --find-links "$PEERS/wheels" "litellm[proxy]==${LITELLM_VERSION}"
  "$PEERS/litellm-venv/bin/pip" freeze > "$PEERS/litellm-freeze.txt"
fi
"$PEERS/litellm-venv/bin/python" -c 'import importlib.metadata as m; print(m.version("litellm"))'
