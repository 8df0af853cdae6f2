"""The dev PKI: names, usages, permissions, reuse."""

from __future__ import annotations

import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from servicekit.pki import DEFAULT_SERVER_NAMES, ensure_dev_pki, validate_name

pytestmark = pytest.mark.unit


def _cert(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_server_certificate_names_loopback_and_compose_services(tmp_path):
    layout = ensure_dev_pki(tmp_path).layout
    san = _cert(layout.server_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = set(san.get_values_for_type(x509.DNSName)) | {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    assert names == {str(ipaddress.ip_address(n)) if n[0].isdigit() or ":" in n else n for n in DEFAULT_SERVER_NAMES}
    usage = _cert(layout.server_cert).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usage


def test_client_certificates_name_their_tenant(tmp_path):
    layout = ensure_dev_pki(tmp_path, tenants=["acme", "globex"]).layout
    for tenant in ("acme", "globex", "gateway"):
        cert = _cert(layout.client_cert(tenant))
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == tenant
        assert ExtendedKeyUsageOID.CLIENT_AUTH in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert cert.issuer == _cert(layout.ca_cert).subject


def test_keys_are_private_and_folder_closed(tmp_path):
    root = tmp_path / "tls"
    layout = ensure_dev_pki(root).layout
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for key in (layout.ca_key, layout.server_key, layout.client_key("dev")):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(layout.server_cert.stat().st_mode) == 0o644


def test_existing_files_are_reused_unless_forced(tmp_path):
    first = ensure_dev_pki(tmp_path)
    ca_before = first.layout.ca_cert.read_bytes()
    second = ensure_dev_pki(tmp_path, tenants=["dev", "new"])
    assert second.layout.ca_cert.read_bytes() == ca_before
    assert second.created == (second.layout.client_cert("new"),)
    forced = ensure_dev_pki(tmp_path, force=True)
    assert forced.layout.ca_cert.read_bytes() != ca_before
    assert not forced.reused


@pytest.mark.parametrize("bad", ["", "../etc", "a b", "x" * 64, "-lead"])
def test_tenant_names_are_validated(bad):
    with pytest.raises(ValueError, match="invalid name"):
        validate_name(bad)
