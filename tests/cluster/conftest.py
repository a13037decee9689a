from __future__ import annotations

import pytest

from tests.cluster.processes import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()
