"""Where no Docker engine can be had, the Docker tests skip, except on CI (`CI=true`), where they fail: a
skip there would pass a run in which no Docker test ran."""

from __future__ import annotations

import pytest
from docker_env import DockerRequired, DockerUnavailable, docker_engine, must_have_docker


@pytest.mark.parametrize(
    ("env", "required"),
    [({}, False), ({"CI": ""}, False), ({"CI": "false"}, False), ({"CI": "true"}, True), ({"CI": "1"}, True)],
)
def test_an_engine_is_required_on_ci_only(env: dict[str, str], required: bool) -> None:
    assert must_have_docker(env) is required


@pytest.mark.parametrize(("ci", "error"), [("true", DockerRequired), ("", DockerUnavailable)])
def test_no_engine_fails_on_ci_and_skips_elsewhere(
    monkeypatch: pytest.MonkeyPatch, ci: str, error: type[Exception]
) -> None:
    """No engine at DOCKER_HOST and no `dockerd` on PATH to start one: what the tests' fixture then gets (it
    skips on `DockerUnavailable` only)."""
    monkeypatch.setenv("CI", ci)
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(error, match="no Docker engine"), docker_engine():
        pass
    assert not issubclass(DockerRequired, DockerUnavailable)
