"""The package's tests run on the real default model (SmolLM2-135M-Instruct, which
``scripts/fetch-assets`` installs), through the installed package as users import it."""

import pytest

import pensieve


@pytest.fixture(scope="module")
def engine():
    """One engine on the default model for a test module's tests, stopped after them."""
    with pensieve.Engine() as e:
        yield e
