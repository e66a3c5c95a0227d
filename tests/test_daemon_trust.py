"""edgekitd's [trust]: with public keys configured, a variant's bundle loads and is switched to only when a trusted
key signed it; a refusal names the bundle and the reason (422 with a stable code) and the live variant serves on."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("fastapi")

from edgekit.bundle.minisign import SecretKey, SignatureError  # noqa: E402
from edgekit.bundle.signing import sign_bundle  # noqa: E402
from edgekit.daemon.config import check_files, load_config  # noqa: E402
from edgekit.daemon.testing import DaemonProcess  # noqa: E402
from edgekit.daemon.variants import VariantRegistry  # noqa: E402
from edgekit.errors import ConfigError  # noqa: E402

TRUSTED, ROTATED, STRANGER = SecretKey.generate(), SecretKey.generate(), SecretKey.generate()


@pytest.fixture
def bundles(tiny_orin_bundles, tmp_path):
    """Copies of the tiny cpu bundle: signed by the trusted key, by the next (rotated) key, by a stranger, and not
    at all; with the trust config naming the first two."""
    cpu = tiny_orin_bundles[1]
    out = {}
    for name, key in (("signed", TRUSTED), ("rotated", ROTATED), ("stranger", STRANGER), ("unsigned", None)):
        out[name] = shutil.copytree(cpu, tmp_path / name)
        if key is not None:
            sign_bundle(out[name], key)
    (tmp_path / "trusted.pub").write_text(TRUSTED.public().to_text())
    variants = "".join(f'[[variants]]\nname = "{n}"\nbundle = "{p}"\n' for n, p in out.items())
    trust = f'[trust]\npublic_keys = ["trusted.pub", "{ROTATED.public().to_base64()}"]\n'
    (tmp_path / "edgekitd.toml").write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n{trust}{variants}')
    return out


def test_the_registry_loads_only_trusted_bundles_and_rechecks_on_a_switch(bundles, tmp_path):
    cfg = load_config(tmp_path / "edgekitd.toml")
    assert [k.id_hex for k in cfg.trusted_keys] == [TRUSTED.public().id_hex, ROTATED.public().id_hex]
    registry = VariantRegistry(cfg)
    assert registry.get("signed").reporter.bundle.name
    registry.activate("rotated")  # key rotation: either trusted key
    for name, code in (("unsigned", "unsigned_bundle"), ("stranger", "untrusted_key")):
        with pytest.raises(SignatureError) as err:
            registry.activate(name)
        assert err.value.code == code and err.value.path == str(bundles[name])
        assert registry.active == "rotated" and name not in registry.loaded
    # a loaded variant's bundle replaced on disk by a stranger's: the switch checks again and refuses
    registry.activate("signed")
    shutil.rmtree(bundles["signed"])
    shutil.copytree(bundles["stranger"], bundles["signed"])
    with pytest.raises(SignatureError, match="not trusted"):
        registry.activate("signed")
    # replaced by another bundle (another manifest) a trusted key signed: loaded afresh, every file checked
    before = registry.loaded["signed"]
    manifest = json.loads((bundles["rotated"] / "manifest.json").read_text())
    shutil.rmtree(bundles["signed"])
    shutil.copytree(bundles["rotated"], bundles["signed"])
    (bundles["signed"] / "manifest.json").write_text(json.dumps({**manifest, "name": "rebuilt"}))
    sign_bundle(bundles["signed"], TRUSTED)
    registry.activate("signed")
    assert registry.loaded["signed"] is not before and registry.active == "signed"
    assert registry.loaded["signed"].reporter.bundle.name == "rebuilt"


def test_config_and_check_config_refuse_in_one_line(bundles, tmp_path):
    with pytest.raises(ConfigError, match="variant 'stranger': signed by key .* which is not trusted"):
        check_files(load_config(tmp_path / "edgekitd.toml"))
    shutil.rmtree(bundles["stranger"])
    shutil.copytree(bundles["signed"], bundles["stranger"])
    with pytest.raises(ConfigError, match="variant 'unsigned': the bundle is not signed"):
        check_files(load_config(tmp_path / "edgekitd.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text('[trust]\npublic_keys = ["missing.pub"]\n')
    with pytest.raises(ConfigError, match="trust.public_keys: .*missing.pub: no such file"):
        load_config(bad)
    bad.write_text('[trust]\npublic_keys = "one.pub"\n')
    with pytest.raises(ConfigError, match="must be a list"):
        load_config(bad)
    bad.write_text("[trust]\nkeys = []\n")
    with pytest.raises(ConfigError, match="unknown key trust.keys"):
        load_config(bad)


def test_the_api_refuses_a_switch_to_an_unsigned_bundle_and_keeps_serving(bundles, tmp_path):
    config = tmp_path / "edgekitd.toml"
    config.write_text(config.read_text() + '[models]\nactive = "signed"\n')
    with DaemonProcess(tmp_path / "state", config=config).start() as d:
        reply = d.client.put_json("/v1/variants/active", {"name": "unsigned"})
        assert reply.status == 422 and reply.error_code == "unsigned_bundle", reply.body
        assert reply.json()["error"]["file"] == "unsigned"  # the bundle's name, never a full path
        reply = d.client.put_json("/v1/variants/active", {"name": "stranger"})
        assert reply.status == 422 and reply.error_code == "untrusted_key"
        assert d.client.get("/v1/variants").json()["active"] == "signed"
        assert d.client.put_json("/v1/variants/active", {"name": "rotated"}).status == 200
    log = (tmp_path / "state" / "daemon.log").read_text()
    assert "variant unsigned refused" in log and "signed by key" in log


def test_a_daemon_whose_active_bundle_is_unsigned_does_not_start(bundles, tmp_path):
    config = tmp_path / "edgekitd.toml"
    config.write_text(config.read_text() + '[models]\nactive = "unsigned"\n')
    d = DaemonProcess(tmp_path / "state2", config=config)
    with pytest.raises(RuntimeError, match="not signed"):
        d.start(wait_ready=60)
    assert d.proc.returncode != 0
