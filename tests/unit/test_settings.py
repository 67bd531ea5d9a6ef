"""Configuration declared once (tandem.settings): a setting's flag, variable and default as the
generated parsers read them; every setting has its help and variable; every flag of every command
line is generated from a setting or is the command's own, and no flag's help is written twice."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from tandem.settings import (
    Flags,
    Setting,
    SettingsParser,
    build_parser,
    generated_options,
    setting,
    settings_of,
    typer_options,
)

SHARED = Setting(help="a shared one", env="SHARED", flag="common")


def sizes(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


@dataclass(frozen=True, kw_only=True)
class Toy:
    name: str = setting(help="a name", env="NAME")
    count: int = setting(3, help="a count", env="COUNT")
    fast: bool | None = setting(None, help="go fast", env="FAST", shown_default="on for CUDA")
    sizes: tuple[int, ...] = setting((1, 2), help="the sizes", env="SIZES", parse=sizes)
    path: Path | None = setting(None, help="a path", env="TANDEM_WHOLE_PATH")
    shared: str = setting("x", like=SHARED, env="OWN")


TOY = Flags(Toy, ("name", "count", "fast", "sizes", "path", "shared"), env_prefix="TANDEM_TOY_")


def test_flag_then_variable_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    def parse(*argv: str) -> dict[str, Any]:
        return TOY.pick(vars(build_parser("toy", None, TOY).parse(list(argv))))

    plain = {"name": "a", "count": 3, "fast": None, "sizes": (1, 2), "path": None, "shared": "x"}
    assert parse("--name", "a") == plain
    given = ["--count", "5", "--no-fast", "--sizes", "7,8", "--path", "p", "--common", "y"]
    assert parse("--name", "b", *given) == {
        **plain,
        **{"name": "b", "count": 5, "fast": False, "sizes": (7, 8), "path": Path("p")},
        "shared": "y",
    }
    for name, value in {"NAME": "c", "COUNT": "4", "FAST": "on", "SIZES": "9", "OWN": "z"}.items():
        monkeypatch.setenv(f"TANDEM_TOY_{name}", value)
    monkeypatch.setenv("TANDEM_WHOLE_PATH", "q")
    from_env = {"name": "c", "count": 4, "fast": True, "sizes": (9,), "path": Path("q")}
    assert parse() == {**from_env, "shared": "z"}
    assert parse("--count", "6", "--no-fast")["count"] == 6  # the flag wins
    assert parse("--no-fast")["fast"] is False
    assert settings_of(Toy)["shared"] == dataclasses.replace(SHARED, env="OWN")


def test_bad_values_and_required_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser("toy", None, TOY)
    with pytest.raises(SystemExit) as done:
        parser.parse([])
    assert done.value.code == 2
    assert "--name (or TANDEM_TOY_NAME) is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse(["--name", "a", "--count", "many"])
    assert "--count" in capsys.readouterr().err
    monkeypatch.setenv("TANDEM_TOY_COUNT", "many")
    with pytest.raises(ValueError, match="TANDEM_TOY_COUNT"):
        build_parser("toy", None, TOY)
    monkeypatch.setenv("TANDEM_TOY_COUNT", "2")
    monkeypatch.setenv("TANDEM_TOY_FAST", "maybe")
    with pytest.raises(ValueError, match="TANDEM_TOY_FAST: not a boolean"):
        build_parser("toy", None, TOY)
    with pytest.raises(TypeError, match="needs help and env"):
        setting(1, help="no variable")


def test_help_and_passing_flags_on() -> None:
    text = " ".join(build_parser("toy", None, TOY).format_help().split())
    assert "a name (required; env: TANDEM_TOY_NAME)" in text
    assert "a count (default: 3; env: TANDEM_TOY_COUNT)" in text
    assert "go fast (default: on for CUDA; env: TANDEM_TOY_FAST)" in text
    assert "a path (default: none; env: TANDEM_WHOLE_PATH)" in text
    values = {"name": "a", "count": 5, "fast": False, "sizes": (7, 8), "path": None}
    values["shared"] = "y"
    argv = TOY.argv(values)
    assert argv == ["--name", "a", "--count", "5", "--no-fast", "--sizes", "7,8", "--common", "y"]
    assert TOY.pick(vars(build_parser("toy", None, TOY).parse(argv))) == values


def test_typer_options(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = dataclasses.replace(TOY, env_prefix=None, env={"count": "TOY_COUNT"}, title="Toy")
    seen: list[dict[str, Any]] = []

    @typer_options(flags)
    def command(own: int = 1, **settings: Any) -> None:
        seen.append({"own": own, **flags.pick(settings)})

    assert [o.name for o in generated_options(command)] == list(TOY.names)
    app = typer.Typer()
    app.command()(command)
    runner = CliRunner()
    assert runner.invoke(app, ["--name", "a"]).exit_code == 0
    assert seen.pop() == {"own": 1, "name": "a", "count": 3, "fast": None, "sizes": (1, 2)} | {
        "path": None,
        "shared": "x",
    }
    result = runner.invoke(app, ["--name", "b", "--no-fast"], env={"TOY_COUNT": "4"})
    assert result.exit_code == 0 and seen.pop()["count"] == 4
    assert runner.invoke(app, []).exit_code == 2  # --name is required
    shown = " ".join(runner.invoke(app, ["--help"]).output.replace("│", " ").split())
    assert "a count. [env var: TOY_COUNT] [default: 3]" in shown
    assert "go fast. [default: (on for CUDA)]" in shown


# ---- every command line ----

# Flags that mean different things in different commands (each is declared once per meaning).
DIFFERENT_MEANINGS = {
    "--dtype": "train-draft's is the saved checkpoint's dtype, elsewhere the models'",
    "--seed": "generate's seeds sampling, train-draft's seeds training",
    "--json": "generate prints its records, bench its report",
    "--log-dir": "serve writes the services' logs there instead of the terminal, bench keeps them",
    "--tls-cert": "the services present a server certificate, the probe a client one",
    "--tls-key": "the services' server key, the probe's client key",
}


def service_parsers() -> dict[str, SettingsParser]:
    from draft_service.__main__ import build_parser as draft
    from gateway.__main__ import build_parser as gateway
    from tandem.serving.health_probe import build_parser as probe
    from target_service.__main__ import build_parser as target

    return {"target": target(), "draft": draft(), "gateway": gateway(), "probe": probe()}


def tandem_options() -> Iterator[tuple[str, typer.core.TyperOption, Setting | None]]:
    """Every option of every ``tandem`` command: (command, option, its setting; None for the
    command's own)."""
    from tandem.apps.cli import app

    group = typer.main.get_command(app)
    assert isinstance(group, typer.core.TyperGroup) and app.registered_callback is not None
    functions = {"tandem": app.registered_callback.callback}
    for info in app.registered_commands:
        assert info.callback is not None
        functions[info.name or info.callback.__name__] = info.callback
    for name, function in functions.items():
        command = group if name == "tandem" else group.commands[name]
        generated = {o.dest: o.setting for o in generated_options(function)}  # type: ignore[arg-type]
        for param in command.params:
            if isinstance(param, typer.core.TyperOption) and param.name != "help":
                yield name, param, generated.get(param.name or "")


def test_every_setting_has_help_and_a_variable() -> None:
    from draft_service.config import DraftServiceConfig
    from gateway.config import GatewayConfig, TokenSources
    from tandem.config import DraftConfig, EngineConfig
    from tandem.serving.health_probe import ProbeConfig
    from tandem.serving.security import ClientTLS, ServerTLS
    from tandem.spec.types import SpecConfig
    from target_service.config import TargetServiceConfig

    declared = [EngineConfig, DraftConfig, SpecConfig, TargetServiceConfig, DraftServiceConfig]
    declared += [GatewayConfig, TokenSources, ServerTLS, ClientTLS, ProbeConfig]
    found = [s for config in declared for s in settings_of(config).values()]
    for parser in service_parsers().values():
        found += [o.setting for o in parser.options]
        assert all(o.env for o in parser.options)  # a service reads a variable for each flag
    found += [s for _, _, s in tandem_options() if s is not None]
    assert len(found) > 100
    for s in found:
        assert s.help.strip() and s.env.strip(), s


def test_service_flags_are_all_generated_from_settings() -> None:
    for name, parser in service_parsers().items():
        flags = {"-h", "--help"} | {f"--{o.flag}" for o in parser.options}
        flags |= {f"--no-{o.flag}" for o in parser.options if o.kind is bool}
        assert {s for a in parser._actions for s in a.option_strings} == flags, name


def test_no_flag_has_its_help_written_twice() -> None:
    helps: dict[str, set[str]] = defaultdict(set)
    where: dict[str, set[str]] = defaultdict(set)
    declared, own = set(), set()
    for name, parser in service_parsers().items():
        for option in parser.options:
            flag = f"--{option.flag}"
            helps[flag].add(option.setting.help)
            where[flag].add(name)
            declared.add(flag)
    for name, param, declaration in tandem_options():
        flag = param.opts[0]
        where[flag].add(name)
        if declaration is not None:
            helps[flag].add(declaration.help)
            declared.add(flag)
        else:
            helps[flag].add((param.help or "").rstrip(".").lower())
            own.add(flag)
    twice = {flag for flag, texts in helps.items() if len(texts) > 1}
    assert twice <= set(DIFFERENT_MEANINGS), {flag: helps[flag] for flag in twice}
    # A command's own option never takes the flag of a setting: that would be its help again.
    assert own & declared <= set(DIFFERENT_MEANINGS), own & declared
    # What it is for: the flags most command lines share have their one help.
    assert where["--spec-policy"] == {"target", "generate", "bench"}
    assert where["--spec-steps"] == {"target", "generate", "serve", "demo", "bench"}
    assert where["--device"] >= {"target", "draft", "generate", "serve", "bench", "train-draft"}
    assert len(helps["--spec-policy"]) == len(helps["--device"]) == len(helps["--target"]) == 1
