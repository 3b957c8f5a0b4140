"""docs/configuration.md is generated from the settings classes (inferx.settings_doc):
it must be what the generator writes now, and list every setting of every service."""

from __future__ import annotations

from inferx import settings_doc


def test_configuration_doc_is_up_to_date() -> None:
    current = settings_doc.DOC.read_text(encoding="utf-8") if settings_doc.DOC.exists() else ""
    assert current == settings_doc.render(), (
        "docs/configuration.md is stale (a setting was added or changed): regenerate it with "
        "`make docs` (or `.venv/bin/python -m inferx.settings_doc`) and commit it"
    )


def test_every_setting_of_every_service_has_a_row() -> None:
    text = settings_doc.render()
    for prog, cls in settings_doc.service_classes():
        section = text.split(f"## {prog}\n", 1)[1].split("\n## ", 1)[0]
        for name, field in cls.model_fields.items():
            row = f"| `{name}` | `--{name.replace('_', '-')}`"
            assert row in text, f"{prog}: {name} has no row"
            assert field.description, f"{prog}: {name} has no description"
        assert f"`{cls.__module__}.{cls.__name__}`" in section


def test_check_mode_says_stale_with_the_fix(tmp_path, capsys) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n")
    assert settings_doc.main([str(stale), "--check"]) == 1
    assert "run `make docs`" in capsys.readouterr().err
    assert settings_doc.main([str(stale)]) == 0
    assert settings_doc.main([str(stale), "--check"]) == 0
