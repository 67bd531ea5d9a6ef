"""Configuration declared once: a config dataclass's field carries its help, its environment
variable and its flag, and the command lines are generated from the fields.

:func:`setting` puts them into the field's metadata, declared there or shared by several configs
(``setting(16, like=PAGE_SIZE)``). A command line lists the fields it exposes, one config at a
time (:class:`Flags`), and gets an argparse parser from them (:func:`build_parser`: the services,
the health probe) or typer options (:func:`typer_options`: the ``tandem`` commands), which name
their own variables. So a flag's help is written once.

Precedence: the flag, then the environment variable, then the default. A variable's name is the
command line's prefix (``TANDEM_TARGET_``) followed by the setting's ``env``, or ``env`` alone
where it starts with ``TANDEM_``. A bad variable raises ValueError naming it when the parser is
built; a required setting that neither its flag nor its variable gave is a usage error naming
both.

The settings more than one command line declares live at the end: the services' own, and those
of the target and the gateway that ``tandem serve`` passes on (tandem/ imports no service).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, MISSING, dataclass, field
from typing import Annotated, Any, Literal, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_METADATA = "tandem.setting"
_WHOLE = "TANDEM_"  # a variable named whole, not after the command line's prefix
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True, kw_only=True)
class Setting:
    """How one config field is set from outside."""

    help: str  # a lowercase phrase; the parsers add the default and the variable
    env: str  # the variable after the command line's prefix (PAGE_SIZE), or whole (TANDEM_...)
    flag: str | None = None  # without dashes; None: the field's name with dashes
    parse: Callable[[str], Any] | None = None  # text -> value; None: the field's type
    choices: tuple[str, ...] | None = None
    shown_default: str | None = None  # the default in words, where its value says too little


def setting(
    default: Any = MISSING,
    *,
    like: Setting | None = None,
    help: str | None = None,
    env: str | None = None,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    shown_default: str | None = None,
    repr: bool = True,
) -> Any:
    """A dataclass field that is a setting, declared here (``setting(0, help=..., env="PORT")``)
    or shared by several configs (``setting(0, like=PORT)``, where the keywords given replace
    the shared one's for this field: its own variable, say)."""
    changes: dict[str, Any] = {"help": help, "env": env, "flag": flag, "parse": parse}
    changes |= {"choices": choices, "shown_default": shown_default}
    changes = {key: value for key, value in changes.items() if value is not None}
    if like is None:
        if help is None or env is None:
            raise TypeError("setting: a setting not like another needs help and env")
        like = Setting(help=help, env=env)
    declared = dataclasses.replace(like, **changes)
    return field(default=default, repr=repr, metadata={_METADATA: declared})


def settings_of(config: type) -> dict[str, Setting]:
    """The settings among ``config``'s fields, by field name."""
    fields = dataclasses.fields(config)
    return {f.name: f.metadata[_METADATA] for f in fields if _METADATA in f.metadata}


@dataclass(frozen=True, kw_only=True)
class Option:
    """One setting as a flag of one command line."""

    name: str  # the field's name: the key of Flags.pick's result
    setting: Setting
    kind: Any  # the value's type without None: int, float, str, Path, bool, tuple[int, ...]
    default: Any  # MISSING: required
    flag: str  # without dashes
    env: str | None  # the variable read; None: none
    shown: str | None = None  # the default in words
    title: str | None = None  # the flag's group in help

    @classmethod
    def of(
        cls, declared: Setting, name: str, kind: Any, default: Any, *, env: str | None = None
    ) -> Option:
        """A setting that is no config's field on this command line (``tandem serve``'s
        ``--draft-deadline``, which it passes on to the target service)."""
        flag = declared.flag or name.replace("_", "-")
        return cls(
            name=name,
            setting=declared,
            kind=kind,
            default=default,
            flag=flag,
            env=env,
            shown=declared.shown_default,
        )

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")

    def options(self) -> list[Option]:
        return [self]

    def convert(self, text: str) -> Any:
        """A flag's or variable's text as a value."""
        if self.setting.parse is not None:
            return self.setting.parse(text)
        if self.kind is bool:
            word = text.strip().lower()
            if word not in (*_TRUE, *_FALSE):
                raise ValueError(f"not a boolean: {text!r}")
            return word in _TRUE
        return self.kind(text)

    def initial(self) -> Any:
        """The value before any flag: the variable's when it is set, else the default."""
        if self.env is None or self.env not in os.environ:
            return self.default
        try:
            return self.convert(os.environ[self.env])
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"{self.env}: {exc}") from None

    def default_text(self) -> str:
        return self.shown if self.shown is not None else _text(self.default)

    def argv(self, value: Any) -> list[str]:
        """The flag that gives a command line ``value`` (none for None)."""
        if value is None:
            return []
        if self.kind is bool:
            return [f"--{self.flag}" if value else f"--no-{self.flag}"]
        return [f"--{self.flag}", _text(value) if isinstance(value, tuple) else str(value)]


def _text(value: Any) -> str:
    """A value as help shows it, and as a flag's text gives it (tuples comma-separated)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if value == "":
        return "empty"
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "off"
    return str(value)


@dataclass(frozen=True)
class Flags:
    """Some settings of one config on one command line, listed in this order."""

    config: type[Any]
    names: tuple[str, ...]
    _: KW_ONLY
    env_prefix: str | None = None  # before each setting's variable; None: only `env`'s
    flag_prefix: str = ""  # before each flag ("draft-": the target's TLS to the draft)
    title: str | None = None  # the flags' group in help
    defaults: Mapping[str, Any] = field(default_factory=dict)  # this command line's own
    shown: Mapping[str, str] = field(default_factory=dict)  # ... and their words
    env: Mapping[str, str] = field(default_factory=dict)  # variables named whole, instead
    optional: bool = False  # may stay unset as a whole (TLS): no flag is required

    def options(self) -> list[Option]:
        declared = settings_of(self.config)
        fields = {f.name: f for f in dataclasses.fields(self.config)}
        hints = typing.get_type_hints(self.config)
        out = []
        for name in self.names:
            own = declared[name]
            default = self.defaults.get(name, fields[name].default)
            if default is MISSING and self.optional:
                default = None
            env = self.env.get(name)
            if env is None and self.env_prefix is not None:
                env = own.env if own.env.startswith(_WHOLE) else self.env_prefix + own.env
            flag = self.flag_prefix + (own.flag or name.replace("_", "-"))
            shown = self.shown.get(name, own.shown_default)
            kind = _without_none(hints[name])
            out.append(
                Option(
                    name=name,
                    setting=own,
                    kind=kind,
                    default=default,
                    flag=flag,
                    env=env,
                    shown=shown,
                    title=self.title,
                )
            )
        return out

    def pick(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """This config's fields from parsed values (``vars(args)``, a command's keywords)."""
        return {option.name: values[option.dest] for option in self.options()}

    def argv(self, values: Mapping[str, Any]) -> list[str]:
        """The flags that give another command line these fields' values (None left out)."""
        return [arg for o in self.options() for arg in o.argv(values[o.name])]


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


# ---- argparse: the services and the health probe ----


class SettingsParser(argparse.ArgumentParser):
    """An argparse parser whose flags are settings."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.options: list[Option] = []

    def add_flags(self, *groups: Flags) -> None:
        """A flag per setting, its default the variable's value when that is set (a bad one
        raises ValueError naming the variable)."""
        for group in groups:
            target = self if group.title is None else self.add_argument_group(group.title)
            for option in group.options():
                initial = option.initial()
                kwargs: dict[str, Any] = {
                    "dest": option.dest,
                    "default": None if initial is MISSING else initial,
                    "help": _argparse_help(option),
                }
                if option.kind is bool:
                    kwargs["action"] = argparse.BooleanOptionalAction
                else:
                    kwargs["type"] = option.setting.parse or option.kind
                    kwargs["choices"] = option.setting.choices
                target.add_argument(f"--{option.flag}", **kwargs)
                self.options.append(option)

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """``parse_args``, and a usage error for a required setting left unset."""
        args = self.parse_args(argv)
        for option in self.options:
            if option.default is MISSING and getattr(args, option.dest) is None:
                self.error(f"--{option.flag} (or {option.env}) is required")
        return args


def build_parser(prog: str, description: str | None, *groups: Flags) -> SettingsParser:
    parser = SettingsParser(prog=prog, description=description)
    parser.add_flags(*groups)
    return parser


def _argparse_help(option: Option) -> str:
    default = "required" if option.default is MISSING else f"default: {option.default_text()}"
    where = "" if option.env is None else f"; env: {option.env}"
    return f"{option.setting.help} ({default}{where})".replace("%", "%%")


# ---- typer: the tandem commands ----


def typer_options(*sources: Flags | Option) -> Callable[[F], F]:
    """Adds the settings of ``sources`` to a typer command as options after its own parameters;
    the command takes them as keyword arguments (``**settings``), named as their flags."""

    def add(command: F) -> F:
        own = inspect.signature(command, eval_str=True)
        kept = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
        options = [o for source in sources for o in source.options()]
        added = [_typer_parameter(o) for o in options]
        command.__signature__ = own.replace(parameters=[*kept, *added])  # type: ignore[attr-defined]
        _GENERATED[command] = options
        return command

    return add


_GENERATED: dict[Callable[..., Any], list[Option]] = {}


def generated_options(command: Callable[..., Any]) -> list[Option]:
    """The options :func:`typer_options` gave ``command`` (none when it gave it none)."""
    return _GENERATED.get(command, [])


def _typer_parameter(option: Option) -> inspect.Parameter:
    import typer

    choices, text, metavar = option.setting.choices, option.setting.help, None
    kind, default = option.kind, option.default
    if option.setting.parse is not None:  # typer parses the text, the default's too
        kind = Any
        if default is not None and default is not MISSING:
            default = _text(default)
    if choices is not None:  # checked as typer checks a Literal; listed in the help, not wide
        kind, metavar = Literal[choices], f"<{option.kind.__name__}>"
        if not all(choice in text for choice in choices):
            text = f"{text}: {', '.join(choices)}"
    if option.default is None:
        kind = kind | None
    flag = f"--{option.flag}"
    info = typer.Option(
        f"{flag}/--no-{option.flag}" if option.kind is bool else flag,
        help=_sentence(text),
        metavar=metavar,
        parser=option.setting.parse,
        envvar=option.env,
        show_default=option.shown if option.shown is not None else True,
        rich_help_panel=option.title,
    )
    default = inspect.Parameter.empty if default is MISSING else default
    return inspect.Parameter(
        option.dest,
        inspect.Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[kind, info],
    )


def _sentence(text: str) -> str:
    return text if text.endswith(".") else f"{text}."


# ---- settings that more than one command line declares ----

HOST = Setting(help="interface to listen on (0.0.0.0: every one)", env="HOST")
PORT = Setting(help="port to listen on; 0 = any free port (logged once bound)", env="PORT")
GRACE = Setting(
    help="seconds a SIGTERM gives open calls to finish before the process exits",
    env="GRACE",
    flag="grace",
)
LOG_LEVEL = Setting(help="Python logging level (DEBUG, INFO, WARNING, ERROR)", env="LOG_LEVEL")
REFLECTION = Setting(
    help="gRPC server reflection (for grpcurl); off in production", env="REFLECTION"
)
# The target service's and the gateway's, which `tandem serve` (and `tandem bench`) pass on.
DRAFT_DEADLINE = Setting(
    help="seconds a step waits for the draft's trees; past it the step decodes without them",
    env="DRAFT_DEADLINE",
    flag="draft-deadline",
)
# The requests' temperature on the command lines that make requests (generate, bench).
TEMPERATURE_HELP = "Sampling temperature of every request: 0 means greedy."
TWO_LANE_BATCH = Setting(
    help="split running requests into two lanes (the draft drafts one while the target "
    "verifies the other) from this many on; 0 = always one lane",
    env="TWO_LANE_BATCH",
)
SERVED_MODEL_NAME = Setting(
    help="the model's name to clients, in metrics (model_name) and in traces "
    "(gen_ai.request.model)",
    env="SERVED_MODEL_NAME",
    shown_default="the checkpoint directory's name; its family's for the embedded model",
)
SMG_PORT = Setting(
    help="also serve the SMG router's gRPC worker protocol (sglang.grpc.scheduler) on this "
    "port, for `smg launch --worker-urls grpc://HOST:PORT` (docs/client.md; 0: any free port)",
    env="SMG_PORT",
    shown_default="off",
)
FAILOVER_WAIT = Setting(
    help="seconds an in-flight request waits for a lost target to come back (then it is "
    "re-admitted with what it streamed) before it fails with UNAVAILABLE; 0 = fail at once",
    env="FAILOVER_WAIT",
    flag="failover-wait",
)
