"""The doctor reads every certificate in use: WARN within 7 days of its end, FAIL once expired."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from agentgw.connection import Connection
from agentgw.doctor import Doctor, Status, served_certificate_check
from servicekit.identity import Identity
from agentgw.pki import issue, server_names_for, write_identity
from tests.support.pki import make_test_pki
from tests.support.servers import scripted_app

pytestmark = pytest.mark.integration


def _reissue(pki, identity: str, **validity) -> None:
    parsed = Identity.parse(identity)
    ca = pki.load_ca()
    names = server_names_for(parsed.name) if parsed.kind == "service" else ()
    write_identity(pki.identity(identity), issue(ca, parsed, server_names=names, **validity), ca.cert_pem)


async def _served(port: int, pki) -> object:
    return await asyncio.to_thread(served_certificate_check, "inference", f"127.0.0.1:{port}",
                                   pki.identity("operator/admin"))


async def test_a_served_certificate_near_its_end_warns_and_an_expired_one_fails(tmp_path):
    pki = make_test_pki(tmp_path / "tls")
    now = dt.datetime.now(dt.timezone.utc)
    async with scripted_app(pki.root, tls_reload_s=0.05) as (running, _):
        healthy = await _served(running.port, pki)
        assert healthy.status is Status.PASS, healthy.line()

        _reissue(pki, "service/inference", days=3)  # short-lived: the running server takes it on its next handshake
        await asyncio.sleep(0.1)
        soon = await _served(running.port, pki)
        assert soon.status is Status.WARN, soon.line()
        assert "in 3.0 days" in soon.measured or "in 2.9 days" in soon.measured
        assert "agentgw certs --renew" in soon.fix

        _reissue(pki, "service/inference", not_before=now - dt.timedelta(days=10), not_after=now - dt.timedelta(hours=1))
        await asyncio.sleep(0.1)
        expired = await _served(running.port, pki)
        assert expired.status is Status.FAIL, expired.line()
        assert expired.measured.startswith("EXPIRED")


async def test_the_doctor_checks_its_own_certificates_too(tmp_path):
    pki = make_test_pki(tmp_path / "tls")
    _reissue(pki, "operator/admin", days=2)
    async with scripted_app(pki.root) as (running, _):
        connection = Connection(gateway="", inference=f"127.0.0.1:{running.port}", tls_dir=str(pki.root))
        checks = {check.name: check for check in await asyncio.to_thread(Doctor(connection, []).certificate_checks)}
    assert checks["certificate valid (inference, served)"].status is Status.PASS
    assert checks["certificate valid (operator/admin)"].status is Status.WARN
    assert checks["certificate valid (tenant/dev)"].status is Status.PASS
