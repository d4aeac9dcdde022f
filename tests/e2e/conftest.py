"""Clients of the module's `server` fixture (a real `kvserve serve` process, which each HTTP
test module starts with its own flags)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.server_process import ServerProcess


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    """The official openai client on the server."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                         max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    """Raw HTTP with the API key."""
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        yield c
