"""The router's watched copy of tenants and tokens (`AuthDirectory`) sees them in etcd's
order: a token made right after its tenant is never known there before the tenant. With
a watch per kind it could be, and a router then refused a fresh token as "the tenant of
token ... no longer exists" (seen in CI: test_stateless_routers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferx import etcd
from inferx.auth.model import Role
from inferx.auth.store import AuthDirectory, create_tenant, create_token
from inferx.etcd import make_client
from tests.conftest import make_stack
from tests.polling import poll_until

pytestmark = pytest.mark.integration


async def test_no_token_is_ever_known_before_its_tenant(tmp_path: Path) -> None:
    stack = make_stack(tmp_path)
    stack.start_etcd()
    try:
        async with make_client(stack.etcd_endpoint) as client, make_client(stack.etcd_endpoint) as writer:
            orphans: list[str] = []  # tokens known while their tenant was not, after any change

            class Checked(AuthDirectory):
                def _load(self, items: dict[str, bytes]) -> None:
                    super()._load(items)
                    orphans.extend(t.token_id for t in self._tokens.values() if self.tenant(t.tenant) is None)

            directory = Checked(client)
            assert all(m.prefix == etcd.AUTH for m in directory.mirrors)  # one watch for both kinds
            for mirror in directory.mirrors:
                mirror.start()
                assert await mirror.wait_synced(10)
            texts = []
            for i in range(20):  # each token written right after its tenant
                await create_tenant(writer, f"t{i}")
                text, _ = await create_token(writer, tenant=f"t{i}", role=Role.MANAGE)
                texts.append(text)

            async def all_known() -> bool:
                return len(directory._tokens) == len(texts)

            await poll_until(all_known, timeout_s=10, interval_s=0.05, what="the tokens to be watched")
            assert orphans == []
            principals = [directory.authenticate(f"Bearer {text}") for text in texts]
            assert [p.tenant for p in principals] == [f"t{i}" for i in range(20)]
            for mirror in directory.mirrors:
                await mirror.close()
    finally:
        stack.stop()
