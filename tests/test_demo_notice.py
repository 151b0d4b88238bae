"""How clients learn that the served model is the random-weight demo: its model object in
/v1/models carries a `notice` (an extra field, as `max_model_len`: the OpenAI schema still holds
and the SDK keeps it), set when the served directory is one server/demo_model.py wrote, however
it is named (by default, or with --w). The web UI and `taper chat` show it: test_web_ui.py and
test_chat_client.py."""
from __future__ import annotations

import json

import pytest

from server_fakes import FakeEngine, ThreadedServer, client_for, http_request, validate


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> str:
    from server.demo_model import write_demo_checkpoint
    return write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo"))


def settings_for(*flags):
    from server.__main__ import build_parser, engine_config, server_settings
    args = build_parser().parse_args(["--cpu", *flags])
    return server_settings(args, engine_config(args))


def test_the_demo_directory_gets_the_notice_however_it_is_named(demo_dir, tmp_path, monkeypatch):
    from server.__main__ import DEMO_NOTICE
    assert settings_for("--w", demo_dir).model_notice == DEMO_NOTICE
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert settings_for().model_notice == DEMO_NOTICE              # no model given: the demo
    other = tmp_path / "real"
    other.mkdir()
    config = json.loads((tmp_path / "cache" / "taper" / "demo" / "config.json").read_text())
    del config["taper_demo"]                  # the same checkpoint without the demo's stamp
    (other / "config.json").write_text(json.dumps(config))
    assert settings_for("--w", str(other)).model_notice is None
    assert settings_for("--m", "org/model").model_notice is None


@pytest.mark.parametrize("notice", ["Random weights: gibberish.", None])
def test_the_notice_is_a_field_of_the_model_object(notice):
    from server.app import ServerSettings, create_app
    server = ThreadedServer(create_app(FakeEngine(), ServerSettings(["demo"],
                                                                    model_notice=notice)))
    try:
        listed = json.loads(http_request(server.port, "GET", "/v1/models")[2])
        one = json.loads(http_request(server.port, "GET", "/v1/models/demo")[2])
        validate(listed, "ListModelsResponse")
        validate(one, "Model")
        assert listed["data"][0].get("notice") == one.get("notice") == notice
        assert ("notice" in one) == (notice is not None)     # absent, not null, for others
        model = client_for(server.port).models.list().data[0]   # the SDK keeps the field
        assert getattr(model, "notice", None) == notice
    finally:
        server.close()
