"""Named entries of one kind, in one list: the input formats ingest reads, the steps that curate documents,
the optimizers training builds. The command line's choices, the dispatch and the reference docs read the
same registry, so a new entry is one class and one ``register`` line, and a plugin (or a test) may add its
own before the command runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from dsgpt2.errors import ConfigError, DsGpt2Error

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries by name, in the order they were registered.

    Args:
        what: what an entry is, as an error names it (``"input format"``).
        flag: the option that chooses an entry (``"--format"``).
        error: what an unknown name raises.
        declare: called with each entry's name and the entry as it is registered, ``forget`` as it is
            taken out: what an entry declares elsewhere (a step's marks on the document schema).
    """

    def __init__(
        self,
        what: str,
        flag: str,
        error: type[DsGpt2Error] = ConfigError,
        *,
        declare: Callable[[str, T], None] | None = None,
        forget: Callable[[str], None] | None = None,
    ) -> None:
        self.what, self.flag, self.error = what, flag, error
        self._declare, self._forget = declare, forget
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that registers its class (or function) under ``name``.

        Raises:
            ConfigError: ``name`` is taken by another entry.
        """

        def add(entry: T) -> T:
            held = self._entries.get(name)
            if held is not None and held is not entry:
                raise ConfigError(f"{self.what} {name!r} is registered twice ({held!r} and {entry!r})")
            if self._declare is not None:
                self._declare(name, entry)
            self._entries[name] = entry
            return entry

        return add

    def unregister(self, name: str) -> None:
        """Take ``name`` out (a plugin's, or a test's, entry)."""
        if self._entries.pop(name, None) is not None and self._forget is not None:
            self._forget(name)

    def __getitem__(self, name: str) -> T:
        """The entry named ``name``.

        Raises:
            DsGpt2Error: (the registry's ``error``) no entry has that name; the message lists those that
                do.
        """
        try:
            return self._entries[name]
        except KeyError:
            raise self.error(f"unknown {self.flag} {name!r}; choose one of {', '.join(self)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[str, T]]:
        """The entries with their names, in order."""
        return list(self._entries.items())

    def choices(self, *leading: str) -> Choices:
        """The names a flag accepts, read when the parser is built: ``leading`` (e.g. ``auto``), then
        every entry registered by then."""
        return Choices(self, leading)


class Choices:
    """A flag's choices that follow a registry: ``leading`` names, then the registry's."""

    def __init__(self, registry: Registry, leading: tuple[str, ...]) -> None:
        self.registry, self.leading = registry, leading

    def __iter__(self) -> Iterator[str]:
        return iter([*self.leading, *self.registry])

    def __contains__(self, name: object) -> bool:
        return name in self.leading or name in self.registry

    def __len__(self) -> int:
        return len(self.leading) + len(self.registry)
