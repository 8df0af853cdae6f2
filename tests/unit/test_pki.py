"""The dev PKI: identities, names, usages, permissions, reuse and renewal."""

from __future__ import annotations

import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from servicekit.identity import SERVICE_NAMES, Identity, IdentityFiles, validate_name
from agentgw.pki import LOOPBACK_NAMES, ensure_dev_pki

pytestmark = pytest.mark.unit


def _cert(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def _spiffe_ids(cert) -> list[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.UniformResourceIdentifier)


def test_every_service_has_its_own_key_and_its_own_names(tmp_path):
    ensure_dev_pki(tmp_path)
    keys = set()
    for service in SERVICE_NAMES:
        files = IdentityFiles.of(tmp_path, Identity.service(service))
        cert = _cert(files.cert)
        assert _spiffe_ids(cert) == [f"spiffe://agentgw.local/service/{service}"]
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = set(san.get_values_for_type(x509.DNSName)) | {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
        assert names == {"localhost", "127.0.0.1", "::1", service}, names
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
        keys.add(files.key.read_bytes())
        # A service's folder holds its certificate, its key and the CA certificate: nothing else.
        assert {p.name for p in files.root.iterdir()} == {"cert.pem", "key.pem", "ca.pem"}
        assert files.ca.read_bytes() == (tmp_path / "ca.pem").read_bytes()
    assert len(keys) == len(SERVICE_NAMES)
    assert LOOPBACK_NAMES == ("localhost", "127.0.0.1", "::1")


def test_tenants_and_operators_carry_their_kind_in_the_uri(tmp_path):
    ensure_dev_pki(tmp_path, tenants=["acme", "globex"], operators=["ops"], trust_domain="example.org")
    for identity in ("tenant/acme", "tenant/globex", "operator/ops"):
        cert = _cert(IdentityFiles.of(tmp_path, Identity.parse(identity)).cert)
        assert _spiffe_ids(cert) == [f"spiffe://example.org/{identity}"]
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == identity.split("/")[1]
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
        assert cert.issuer == _cert(tmp_path / "ca.pem").subject


@pytest.mark.parametrize("kind", ["tenants", "operators"])
@pytest.mark.parametrize("name", SERVICE_NAMES)
def test_a_tenant_or_operator_may_not_take_a_service_name(tmp_path, kind, name):
    with pytest.raises(ValueError, match=f"{kind[:-1]} name '{name}' is a service's name"):
        ensure_dev_pki(tmp_path, **{kind: [name]})


def test_keys_are_private_and_folders_closed(tmp_path):
    root = tmp_path / "tls"
    ensure_dev_pki(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    keys = [root / "ca-key.pem", *root.glob("*/*/key.pem")]
    assert len(keys) == 1 + 4 + 1 + 1  # CA, four services (the edge among them), one operator, one tenant
    for key in keys:
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    for folder in root.glob("*/*"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE((folder / "cert.pem").stat().st_mode) == 0o644


def test_existing_files_are_reused_renewed_or_forced(tmp_path):
    first = ensure_dev_pki(tmp_path)
    ca_before = first.ca.cert.read_bytes()
    gateway = IdentityFiles.of(tmp_path, Identity.service("gateway"))
    serial_before = _cert(gateway.cert).serial_number
    second = ensure_dev_pki(tmp_path, tenants=["dev", "new"])
    assert second.ca.cert.read_bytes() == ca_before
    assert second.created == (IdentityFiles.of(tmp_path, Identity.tenant("new")).cert,)

    renewed = ensure_dev_pki(tmp_path, renew=True, leaf_days=3)
    assert renewed.ca.cert.read_bytes() == ca_before  # same CA: old and new leaves both verify
    assert _cert(gateway.cert).serial_number != serial_before
    lifetime = _cert(gateway.cert).not_valid_after_utc - _cert(gateway.cert).not_valid_before_utc
    assert 3 * 86400 <= lifetime.total_seconds() <= 3 * 86400 + 600

    forced = ensure_dev_pki(tmp_path, force=True)
    assert forced.ca.cert.read_bytes() != ca_before
    assert not forced.reused


@pytest.mark.parametrize("bad", ["", "../etc", "a b", "x" * 64, "-lead"])
def test_names_are_validated(bad):
    with pytest.raises(ValueError, match="invalid name"):
        validate_name(bad)


@pytest.mark.parametrize("uri,reason", [
    ("spiffe://elsewhere.example/service/gateway", "trust domain 'elsewhere.example'"),
    ("spiffe://agentgw.local/admin/root", "unknown identity kind 'admin'"),
    ("spiffe://agentgw.local/tenant", "is not an identity"),
    ("https://agentgw.local/tenant/dev", "not a SPIFFE ID"),
])
def test_foreign_or_malformed_spiffe_ids_are_refused(uri, reason):
    with pytest.raises(ValueError, match=reason):
        Identity.from_spiffe_id(uri, "agentgw.local")
    assert Identity.from_spiffe_id("spiffe://agentgw.local/tenant/dev", "agentgw.local") == Identity.tenant("dev")
