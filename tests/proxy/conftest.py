"""The proxy tests' fixture: ``setup``, a :class:`Setup` (tests/proxy/proxy_stubs.py)
built with the test's parameters (``indirect=True``), closed after it."""

import pytest

from tests.proxy.proxy_stubs import Setup


@pytest.fixture
def setup(request):
    s = Setup(**getattr(request, "param", {}))
    yield s
    s.close()
