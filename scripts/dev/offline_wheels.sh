# Sourced by the GPU scripts: installs the Python packages brought along as wheels in .whl/
# and any other .whl-*/ folder (for a GPU machine without network; CONTRIBUTING.md; more than
# one folder where a transfer limits each one's size) into /tmp/site and puts them on
# PYTHONPATH, ahead of the machine's own.
if compgen -G ".whl*/*.whl" >/dev/null; then
  python3 -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --target /tmp/site .whl*/*.whl 2>&1 |
    grep -v "already exists" || true
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
