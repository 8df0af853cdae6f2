"""The README's configuration tables name every setting the code reads, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.settings import GatewaySettings
from inference.settings import InferenceSettings
from retrieval.settings import RetrievalSettings
from servicekit.settings import environment_names

pytestmark = pytest.mark.unit

README = Path(__file__).resolve().parents[2] / "README.md"
#: Read from the environment outside the Settings classes.
OTHER_VARIABLES = {"AGW_TEST_DATABASE_URL"}


def _documented() -> set[str]:
    names = set()
    for token in re.findall(r"AGW_[A-Z0-9_<>]+", README.read_text()):
        if "<SERVICE>" in token:  # a row for all three services at once
            names |= {token.replace("<SERVICE>", service) for service in ("GATEWAY", "RETRIEVAL", "INFERENCE")}
        elif "<" not in token and not token.endswith("_"):  # not a prefix such as AGW_GATEWAY_*
            names.add(token)
    return names


def _settings() -> set[str]:
    """What the services read: each service's own names, the shared ones included."""
    names = set()
    for cls in (GatewaySettings, RetrievalSettings, InferenceSettings):
        names |= set(environment_names(cls))
    return names


def test_every_setting_is_documented():
    missing = _settings() - _documented()
    assert not missing, f"settings missing from the README's configuration tables: {sorted(missing)}"


def test_the_readme_names_no_setting_that_does_not_exist():
    unknown = _documented() - _settings() - OTHER_VARIABLES
    assert not unknown, f"the README names variables no code reads: {sorted(unknown)}"
