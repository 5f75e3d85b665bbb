"""The compat build's bindings, generated once per test session (both test modules use them)."""

from __future__ import annotations

import pytest

from compat_common import generate_bindings


@pytest.fixture(scope="session")
def generated():
    return generate_bindings()
