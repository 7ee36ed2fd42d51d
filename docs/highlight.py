"""mkdocs hook: shell blocks are highlighted as the commands they are, not as a script.

Pygments' bash lexer colours shell builtins, so `make test` showed `test` as the `test` builtin; the
commands these pages show run programs (dsgpt2, make, python, deepspeed), and a builtin among their
arguments is a word like any other. The lexer below is bash's without the builtin colour, used for every
bash, sh and shell block.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pymdownx.highlight
from pygments.lexers.shell import BashLexer
from pygments.token import Name, Text, _TokenType

SHELL = ("bash", "sh", "shell")


class CommandLexer(BashLexer):
    name = "Shell commands"

    def get_tokens_unprocessed(
        self, text: str, stack: Any = ("root",)
    ) -> Iterator[tuple[int, _TokenType, str]]:
        for index, token, value in super().get_tokens_unprocessed(text, stack):
            yield index, (Text if token in Name.Builtin else token), value


_get_lexer = pymdownx.highlight.get_lexer_by_name


def _lexer(name: str, **options: Any) -> Any:
    return CommandLexer(**options) if name in SHELL else _get_lexer(name, **options)


def on_config(config: Any) -> Any:
    pymdownx.highlight.get_lexer_by_name = _lexer
    return config
