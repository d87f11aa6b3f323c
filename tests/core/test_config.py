from __future__ import annotations

import pytest

from kiln.config import ConfigError, load_settings


def test_defaults_have_default_source(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    loaded = load_settings(environ={})
    eff = loaded.effective()
    assert eff["server.port"] == {"value": 8420, "source": "default"}
    assert eff["server.host"]["value"] == "127.0.0.1"
    assert loaded.config_file is None


def test_precedence_file_env_cli(tmp_path) -> None:
    cfg = tmp_path / "kiln.toml"
    cfg.write_text('[server]\nport = 9000\nhost = "127.0.0.2"\n[batching]\ntoken_budget = 64\n')
    env = {"KILN_SERVER_PORT": "9001", "KILN_BATCHING_MAX_RUNNING_ROWS": "4", "KILN_VENV": "/x"}
    loaded = load_settings(cli={"server.port": 9002, "model.device": None}, config_path=cfg, environ=env)
    s, eff = loaded.settings, loaded.effective()
    assert s.server.port == 9002 and eff["server.port"]["source"] == "cli"
    assert s.server.host == "127.0.0.2" and eff["server.host"]["source"] == "file"
    assert s.batching.max_running_rows == 4 and eff["batching.max_running_rows"]["source"] == "env"
    assert s.batching.token_budget == 64 and eff["batching.token_budget"]["source"] == "file"
    assert eff["model.device"]["source"] == "default"


def test_kiln_config_env_selects_file(tmp_path) -> None:
    cfg = tmp_path / "other.toml"
    cfg.write_text("[limits]\nmax_n = 3\n")
    loaded = load_settings(environ={"KILN_CONFIG": str(cfg)})
    assert loaded.settings.limits.max_n == 3 and loaded.config_file == cfg


@pytest.mark.parametrize(
    "toml, needle",
    [
        ("[server]\nprot = 1\n", "server.prot"),
        ("[sever]\nport = 1\n", "sever"),
        ("[server]\nport = 70000\n", "server.port"),
        ("[limits]\ndefault_max_tokens = 4000\n", "default_max_tokens"),
        ('[model]\nlinear_kernels = "fla"\n', "model.linear_kernels"),
        ("[server\n", "not valid TOML"),
    ],
)
def test_bad_file_names_the_key(tmp_path, toml: str, needle: str) -> None:
    cfg = tmp_path / "kiln.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_settings(config_path=cfg, environ={})


def test_bad_env_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="KILN_SERVER_PROT"):
        load_settings(environ={"KILN_SERVER_PROT": "1"})
    with pytest.raises(ConfigError, match=r"server\.port \(from env\)"):
        load_settings(environ={"KILN_SERVER_PORT": "eighty"})


def test_unknown_cli_key() -> None:
    with pytest.raises(ConfigError, match="server.nope"):
        load_settings(cli={"server.nope": 1}, environ={})


def test_missing_config_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(config_path=tmp_path / "missing.toml", environ={})


def test_home_paths(tmp_path) -> None:
    s = load_settings(environ={"KILN_HOME": str(tmp_path)}).settings
    assert s.home == str(tmp_path)
    assert s.adapters_path == tmp_path / "adapters" and s.data_path == tmp_path / "data"


def test_security_lists_from_env_and_file(tmp_path) -> None:
    cfg = tmp_path / "kiln.toml"
    cfg.write_text('[server]\nallowed_origins = ["http://a.example"]\n')
    loaded = load_settings(config_path=cfg, environ={"KILN_SERVER_ALLOWED_HOSTS": "kiln.lan, box.local,"})
    server = loaded.settings.server
    assert server.allowed_origins == ("http://a.example",)
    assert server.allowed_hosts == ("kiln.lan", "box.local")
    assert loaded.sources["server.allowed_hosts"] == "env"


def test_security_defaults_are_closed() -> None:
    server = load_settings(environ={}).settings.server
    assert server.allowed_hosts == () and server.allowed_origins == ()
    assert server.api_key_env is None and server.expose_paths is False
    assert 0 < server.header_timeout_s <= server.body_timeout_s


def test_api_key_env_must_be_a_variable_name() -> None:
    with pytest.raises(ConfigError, match="server.api_key_env"):
        load_settings(environ={"KILN_SERVER_API_KEY_ENV": "not a name"})


def test_configuration_reference_is_generated_and_current():
    """docs/configuration.md and docs/kiln-config.schema.json come from the settings models: every key
    listed with its type, default, environment name and a description; stale docs fail here."""
    from kiln.config import SECTIONS
    from kiln.config_reference import main, render_markdown

    assert main(["--check"]) == 0, "run: python -m kiln.config_reference"
    page = render_markdown()
    for section, cls in SECTIONS.items():
        for name in cls.model_fields:
            row = next(line for line in page.splitlines() if line.startswith(f"| `{section}.{name}` |"))
            assert f"`KILN_{section.upper()}_{name.upper()}`" in row and not row.endswith("|  |"), row
