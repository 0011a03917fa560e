import pytest

SAMPLE = """\
; the defaults
name = demo

[server]
host = localhost
# the port the server listens on
port = 8080
"""


@pytest.fixture
def sample() -> str:
    return SAMPLE
