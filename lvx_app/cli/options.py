"""Command-line options made from the config's fields, and the one way to make a typer app.

`@config_options(...)` gives a command every option of the config sections it names (a field's
`flag` and `help`), checks them once by building the `Config` (a bad value is one line, exit 2) and
calls the command with `config=`. A new config field is a new option of every command that takes
its section, with no code here.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import typing
from typing import Any, Callable

import typer
from typer.core import TyperCommand, TyperGroup

from lvx_app.config import NOT_CLI, SECTIONS, Config, ConfigError, cli_fields, field_default


class OneErrorForm:
    """Every mistake on the command line in one form: click's own (a missing argument, an unknown
    option or command) prints like lvx's (the usage line, then `error: ...`), with exit 2."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except typer.Abort:  # a question answered with Ctrl-D
            typer.echo(err=True)
            raise SystemExit(_error_line("aborted", 1)) from None
        except typer.TyperException as exc:  # click's errors (typer carries its own click)
            raise SystemExit(_usage_error(exc)) from None
        sys.exit(code if isinstance(code, int) else 0)


def _usage_error(exc: Any) -> int:
    """Print a click error (its `ctx`, `exit_code`, `format_message`) in lvx's form."""
    ctx = getattr(exc, "ctx", None)
    if type(exc).__name__ == "NoArgsIsHelpError":  # a group called bare: its help
        exc.show()
        return exc.exit_code
    if ctx is not None:
        typer.echo(f"{ctx.get_usage()}\nTry '{ctx.command_path} --help' for help.\n", err=True)
    return _error_line(exc.format_message(), exc.exit_code)


NO_BREAK_HYPHEN = "\u2011"  # stands in for "-" while help is wrapped, then goes back


class WholeWordsHelp(TyperCommand.context_class.formatter_class):  # typer's own click's
    """Help wrapped at spaces only: a model id (mPLUG/mPLUG-Owl3-7B-241101), a flag or a name like
    LV-XAttn never splits at one of its hyphens (the wrapper would break there)."""

    def write_text(self, text: str) -> None:
        super().write_text(text.replace("-", NO_BREAK_HYPHEN))

    def write_dl(self, rows: Any, *args: Any, **kwargs: Any) -> None:
        rows = [(term, text.replace("-", NO_BREAK_HYPHEN)) for term, text in rows]
        super().write_dl(rows, *args, **kwargs)

    def getvalue(self) -> str:
        return super().getvalue().replace(NO_BREAK_HYPHEN, "-")


class LvxContext(TyperCommand.context_class):
    formatter_class = WholeWordsHelp


class PlainUsage(OneErrorForm, TyperCommand):
    """A command whose usage line and help name its arguments as users write them (`VIDEO`,
    `[OUT]`), without a type beside them."""

    context_class = LvxContext

    def format_options(self, ctx, formatter) -> None:
        args = [
            (param.metavar or param.name.upper(), param.help or "")
            for param in self.get_params(ctx)
            if param.param_type_name == "argument"
        ]
        opts = [
            record
            for param in self.get_params(ctx)
            if param.param_type_name == "option" and (record := param.get_help_record(ctx))
        ]
        for title, rows in (("Arguments", args), ("Options", opts)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = param.metavar or param.name.upper()
                pieces.append(name if param.required else f"[{name}]")
        return pieces


class LvxGroup(OneErrorForm, TyperGroup):
    """A command group whose usage mistakes print in lvx's one form."""

    context_class = LvxContext


class LvxTyper(typer.Typer):
    """Every command of lvx has the plain usage line and lvx's one form of errors."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cls=LvxGroup, **kwargs)

    def command(self, *args: Any, cls: type | None = None, **kwargs: Any):
        return super().command(*args, cls=cls or PlainUsage, **kwargs)


def new_app(name: str, help: str) -> typer.Typer:
    """A typer app (or sub-app) as every lvx command group has it: help when called bare, plain
    help text that fits 80 columns and a pipe (no boxes, flags without values), no shell-completion
    commands, plain Python tracebacks."""
    return LvxTyper(
        name=name,
        help=help,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
    )


def _error_line(message: str, code: int) -> int:
    typer.secho(f"error: {message}", err=True, fg="red")
    return code


def exit_code(exc: BaseException) -> int:
    """The exit code for a failure: 2 for a mistake in what the command was given (an option, a
    path, a file or folder lvx cannot use), 1 when the work itself failed (a rank died, a write
    failed)."""
    from lvx_app.engine.records import GroupFailed

    if isinstance(exc, GroupFailed):
        return 1
    return 1 if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError) else 2


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one error line on stderr; raise the returned Exit. Code 2: a mistake in the command
    line (an option, a path); 1: the work itself failed."""
    return typer.Exit(_error_line(message, code))


def _metavar(annotation: Any) -> str | None:
    """What an option's value is called in help when its field names none: N, X, TEXT."""
    names = {int: "N", float: "X", str: "TEXT"}
    for kind in typing.get_args(annotation) or (annotation,):
        if kind in names:
            return names[kind]
    return None


def _option(f: Any, default: Any, annotation: Any, help: str | None) -> typer.models.OptionInfo:
    extra = {k: v for k, v in f.metadata.items() if k not in ("flag", "help", "required", *NOT_CLI)}
    if "/" not in f.metadata["flag"] and annotation is not bool:
        extra.setdefault("metavar", _metavar(annotation))
    default = ... if f.metadata.get("required") else default
    return typer.Option(default, f.metadata["flag"], help=help or f.metadata["help"], **extra)


def _own_default(f: Any) -> str:
    """A field's help for a command that sets its own default: without the config's "Default: ..."
    (typer shows the command's)."""
    return re.sub(r"\s*Default: .*$", "", f.metadata["help"], flags=re.S)


def config_options(
    *sections: str,
    include: tuple[str, ...] | None = None,
    exclude: tuple[str, ...] = (),
    defaults: dict[str, Any] | None = None,
    helps: dict[str, str] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give the decorated command the options of `sections` (only `include` when given, minus
    `exclude`; a name is a field's, or "section.field"), with `defaults` and `helps` overriding the
    config's for this command; it is called with `config: Config` instead."""
    defaults, helps = defaults or {}, helps or {}

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(command).parameters.values() if p.name != "config"]
        hints = typing.get_type_hints(command)
        chosen: list[tuple[str, Any]] = []
        params, annotations = list(own), {p.name: hints.get(p.name, Any) for p in own}
        for name in sections:
            types = typing.get_type_hints(SECTIONS[name])
            for f in cli_fields(SECTIONS[name]):
                names = {f.name, f"{name}.{f.name}"}  # a bare field name, or section.field
                if names & set(exclude) or (include is not None and not names & set(include)):
                    continue
                if f.name in annotations:
                    raise TypeError(f"option {f.name!r} is declared twice in {command.__name__}")
                default = defaults.get(f.name, field_default(f))
                help = helps.get(f.name) or (_own_default(f) if f.name in defaults else None)
                params.append(
                    inspect.Parameter(
                        f.name,
                        inspect.Parameter.KEYWORD_ONLY,
                        default=_option(f, default, types[f.name], help),
                        annotation=types[f.name],
                    )
                )
                annotations[f.name] = types[f.name]
                chosen.append((name, f.name))

        @functools.wraps(command)
        def run(**values: Any) -> Any:
            by_section: dict[str, dict[str, Any]] = {}
            for name, key in chosen:
                by_section.setdefault(name, {})[key] = values.pop(key)
            try:
                config = Config.from_dict(by_section)
            except ConfigError as exc:
                raise fail(str(exc)) from None
            return command(**values, config=config)

        del run.__wrapped__  # typer reads the signature below, not the command's own
        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = annotations
        return run

    return decorate
