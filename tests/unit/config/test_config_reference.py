"""docs/config.md is generated from the pydantic models (spmd.config.reference): it must be
current, and every key must carry a description."""

from __future__ import annotations

from pydantic import BaseModel

from spmd.config.reference import COMMAND, main, render, task_sections
from spmd.config.schema import Config
from tests.helpers.env import REPO

DOC = REPO / "docs" / "config.md"


def test_docs_config_md_is_generated_from_the_models():
    assert DOC.is_file(), f"docs/config.md is missing: run `{COMMAND}`"
    assert DOC.read_text() == render(), (
        f"docs/config.md is stale (a config key was added or changed): run `{COMMAND}` and "
        "commit docs/config.md")


def _keys(cls: type[BaseModel], prefix: str) -> list[tuple[str, str | None]]:
    out = []
    for name, info in cls.model_fields.items():
        key = f"{prefix}{info.alias or name}"
        candidates = [a for a in (info.annotation, *getattr(info.annotation, "__args__", ()))
                      if isinstance(a, type) and issubclass(a, BaseModel) and a is not BaseModel]
        if candidates:
            out += _keys(candidates[0], key + ".")
        elif name != "name" or prefix != "model.":
            out.append((key, info.description))
    return out


def test_every_key_is_documented_and_listed():
    keys = _keys(Config, "") + [k for _, _, section in task_sections()
                                for k in _keys(section, "model.")]
    assert len(keys) > 100, len(keys)
    undocumented = sorted(k for k, description in keys if not description)
    assert not undocumented, f"keys without Field(description=...): {undocumented}"
    text = DOC.read_text()
    missing = sorted(k for k, _ in keys if f"`{k}`" not in text)
    assert not missing, missing


def test_the_check_mode_fails_on_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text(render().replace("train.batch_size", "train.batch"))
    assert main(["--check", "--output", str(stale)]) == 1
    assert f"is stale: run `{COMMAND}`" in capsys.readouterr().err
    assert main(["--output", str(stale)]) == 0
    assert stale.read_text() == render()
    assert main(["--check", "--output", str(stale)]) == 0
