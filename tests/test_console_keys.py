"""Host keys pinned from what a server published (issue 12 item 1: its metadata password; issue 14 item 12: a
console log, where one exists): CRLF line ends, several boots' blocks,
stray lines. The real path runs in test_provision.py against the local cloud (bare metal: no console log)."""

from appliance.sites.openstack import parse_console_host_keys

ED = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeKeyForTestsOnly0000000000000000000000"
ED2 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAISecondBootKey000000000000000000000000000"
EC = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBFake="


def block(*lines: str, eol: str = "\n") -> str:
    return eol.join(["-----BEGIN SSH HOST KEY KEYS-----", *lines, "-----END SSH HOST KEY KEYS-----", ""])


def test_crlf_console_output():
    out = "[  1.0] boot\r\n" + block(f"{ED} root@node", EC, eol="\r\n") + "login: "
    assert parse_console_host_keys(out) == [ED, EC]


def test_the_last_boot_wins():
    out = block(ED) + "reboot\n" + block(ED2)
    assert parse_console_host_keys(out) == [ED2]


def test_stray_lines_are_not_keys():
    out = block("ci-info: something else", f"{ED} comment", "ssh-ed25519 not*base64", "")
    assert parse_console_host_keys(out) == [ED]


def test_no_block_no_keys():
    assert parse_console_host_keys("no keys here\n") == []


def test_published_host_keys_are_read_only_under_our_header():
    from appliance.sites.openstack import parse_password_host_keys

    assert parse_password_host_keys(f"appliance-hostkeys/1\n{ED}\n{EC}\n") == [ED, EC]
    assert parse_password_host_keys(f"appliance-hostkeys/1\r\n{ED} root@node\r\n") == [ED]
    # an image's own password (cloudbase-init posts an encrypted one) or nothing yet: no keys
    assert parse_password_host_keys("aGVsbG8gZW5jcnlwdGVkIHBhc3N3b3Jk") == []
    assert parse_password_host_keys("") == []
    assert parse_password_host_keys(f"appliance-hostkeys/1\nnot a key\n{ED}\n") == [ED]
