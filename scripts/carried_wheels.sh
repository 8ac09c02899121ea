# Sourced by the device scripts: installs the Python packages carried as wheels in .whl/ (the
# device has no network; README "GPU check") into /tmp/site and puts them on PYTHONPATH.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 |
    grep -v "already exists" || true
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
